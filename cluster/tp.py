"""Tensor parallelism for a gated student (Megatron-style), on a torch.distributed sub-group.

Each selectable Linear is split across the ``tp`` ranks of a tensor-parallel group according
to its adapter's :attr:`voodoo.arch.TensorSpec.tp`:

* ``"column"`` (q/k/v, MLP gate/up): the output rows are split; rank r keeps rows
  ``[r*n/tp, (r+1)*n/tp)``. Rows of q/k/v are head-major in HF layout, so this is a split by
  attention heads (``n_head`` and ``n_head_kv`` must divide by ``tp``).
* ``"row"`` (attn_output, ffn_down): the input columns are split the same way; the partial
  outputs are summed with an all-reduce, then the bias (if any) is added once.
* ``None`` (token embedding, untied lm_head): replicated.

A candidate is split along the same axis as its weight. Candidates are llama.cpp's dequantized
rows; dequantization is row-wise and, within a row, block-wise, so a shard of rows (column
parallel) or of whole blocks of columns (row parallel) equals what dequantizing the same cut of
the quantized bytes gives. Row-parallel cuts must therefore fall on multiples of every candidate
type's block size (32 for Q4_0/Q8_0..., 256 for the K-/IQ-quants): :func:`check_tp` refuses a
split that does not, naming the tensor and type.

Autograd (the f/g operators of Megatron-LM): the input of each parallel block (the attention or
MLP module) goes through :func:`copy_to_tp` (identity forward, all-reduce of the gradient
backward); row-parallel outputs through :func:`reduce_from_tp` (all-reduce forward, identity
backward). Gate logits are replicated and identical on every rank. A sharded gate
(:class:`ShardedMixedWeight`) sums ``dL/dp`` over the group in backward (each rank's partial
``<g^T x, W_k shard>`` over its shard sums to the full gradient), while its expected size uses
the full tensor's bytes and is *not* summed (the size penalty is computed identically on every
rank), so after backward every rank of the group holds the same, full gate gradient. Data
parallelism on top only has to average over data-parallel replicas.

The core (``voodoo/``) knows nothing of this; no Ray here either (only torch.distributed).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from voodoo.gates import MixedQuantLinear, MixedWeight

__all__ = [
    "TensorParallelError", "TPGroup", "ShardedMixedWeight", "ParallelLinear", "copy_to_tp",
    "reduce_from_tp", "tp_plan", "check_tp", "shard_model", "head_counts", "shard_bounds",
]


class TensorParallelError(ValueError):
    """Tensor parallelism cannot run on this model / split (the message says why)."""


@dataclass
class TPGroup:
    """One rank's view of its tensor-parallel group.

    rank: rank inside the group (0..size-1). size: ranks in the group. group: the
    ``torch.distributed`` process group (None: the default group; unused when size == 1)."""

    rank: int = 0
    size: int = 1
    group: object | None = None


# --------------------------------------------------------------------------- collectives


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; backward all-reduces (sums) the gradient over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduces (sums) partial outputs over the group; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Identity forward; the gradient is summed over ``tp``'s group in backward."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp.group)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum of ``x`` over ``tp``'s group (all-reduce) forward; identity backward."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp.group)


# --------------------------------------------------------------------------- modules


class ShardedMixedWeight(MixedWeight):
    """A :class:`MixedWeight` holding one rank's shard of the candidates.

    candidates: (K, n_rows / tp, n_per_row) for a column split, (K, n_rows, n_per_row / tp) for
    a row split. ``shape`` and ``nbytes`` stay the **full** tensor's (so the budget, the gate
    init's bits per weight and the expected size are those of the whole tensor, identical on
    every rank); ``shard_shape`` is the local one. ``probs()`` (used by the forward) sums its
    gradient over the TP group; ``expected_bytes()`` (the size penalty) does not."""

    def __init__(self, full: MixedWeight, shard: torch.Tensor, tp: TPGroup, mode: str):
        super().__init__(shard, full.nbytes.tolist(), full.gguf_name, full.types)
        with torch.no_grad():
            self.logits.copy_(full.logits)
            self.temperature.copy_(full.temperature)
        self.full_shape = tuple(full.shape)
        self.tp, self.mode = tp, mode

    @property
    def shape(self) -> tuple[int, int]:
        """The full tensor's (n_rows, n_per_row)."""
        return self.full_shape

    @property
    def shard_shape(self) -> tuple[int, int]:
        store = getattr(self, "store", None)
        if store is not None:
            return tuple(store.shape2d)
        return tuple(self.candidates.shape[1:])

    def probs(self) -> torch.Tensor:
        return copy_to_tp(torch.softmax(self.logits / self.temperature, dim=0), self.tp)

    def expected_bytes(self) -> torch.Tensor:
        p = torch.softmax(self.logits / self.temperature, dim=0)
        return (p * self.nbytes).sum()

    @torch.no_grad()
    def weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """This rank's shard of the mixed weight (shard_shape), detached."""
        p = torch.softmax(self.logits / self.temperature, dim=0)
        store = getattr(self, "store", None)
        if store is not None:
            return store.mix(p, dtype).reshape(store.shape2d)
        return torch.tensordot(p.to(self.candidates.dtype), self.candidates, dims=1).to(dtype)

    def extra_repr(self) -> str:
        return (f"{self.gguf_name!r}, K={self.k}, shape={self.full_shape}, "
                f"shard={self.shard_shape} ({self.mode}, rank {self.tp.rank}/{self.tp.size})")


class ParallelLinear(nn.Module):
    """A column- or row-parallel wrapper around one rank's shard of a Linear.

    ``inner``: the shard, an ``nn.Linear`` or a :class:`MixedQuantLinear` (no bias for a row
    split). Column: x (..., in) -> y (..., out / tp). Row: x (..., in / tp) -> partial y,
    all-reduced over the group to (..., out), then ``bias`` (out,) added once."""

    def __init__(self, inner: nn.Module, mode: str, tp: TPGroup,
                 bias: torch.Tensor | None = None):
        super().__init__()
        if mode not in ("column", "row"):
            raise ValueError(f"mode must be 'column' or 'row', got {mode!r}")
        self.inner, self.mode, self.tp = inner, mode, tp
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if self.mode == "row":
            y = reduce_from_tp(y, self.tp)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"{self.mode}, rank {self.tp.rank}/{self.tp.size}"


# --------------------------------------------------------------------------- planning


def _field(spec, name, default=None):
    if isinstance(spec, Mapping):
        return spec.get(name, default)
    return getattr(spec, name, default)


def head_counts(config) -> tuple[int, int]:
    """(n_head, n_head_kv) from an HF config or an adapter (``n_head``/``n_head_kv``
    attributes, else ``num_attention_heads``/``num_key_value_heads``). Raises
    TensorParallelError when neither is there."""
    n = getattr(config, "n_head", None) or getattr(config, "num_attention_heads", None)
    if n is None:
        raise TensorParallelError(f"cannot read the attention head counts from "
                                  f"{type(config).__name__}; tensor parallel needs them")
    kv = getattr(config, "n_head_kv", None) or getattr(config, "num_key_value_heads", None) or n
    return int(n), int(kv)


def shard_bounds(n: int, tp: TPGroup) -> tuple[int, int]:
    """[start, stop) of rank ``tp.rank``'s equal share of ``n`` (n divisible by tp.size)."""
    per = n // tp.size
    return tp.rank * per, (tp.rank + 1) * per


def tp_plan(specs) -> dict[str, dict[str, str]]:
    """Groups the TP-split tensors of ``specs`` by parent module.

    specs: TensorSpec-like objects (``module_name``, ``tp``, ``gguf_name``). Returns
    ``{parent module name: {module name: "column"|"row"}}`` (e.g. ``model.layers.0.self_attn
    -> {q_proj: column, ..., o_proj: row}``). Raises TensorParallelError when no spec carries
    TP information (the adapter has no tensor-parallel policy) or a parent has column splits
    without a row split or the reverse (its output would stay partial)."""
    specs = list(specs or [])
    if not specs or all(_field(s, "tp") is None for s in specs):
        raise TensorParallelError(
            "tensor parallel needs the adapter's per-tensor TP policy (TensorSpec.tp = "
            "'column'/'row'), and none of the selectable tensors has one; add it to the "
            "architecture's adapter in voodoo/arch/ or run without tensor parallelism")
    plan: dict[str, dict[str, str]] = defaultdict(dict)
    for s in specs:
        mode = _field(s, "tp")
        if mode is None:
            continue
        if mode not in ("column", "row"):
            raise TensorParallelError(f"{_field(s, 'gguf_name')}: unknown tp {mode!r}")
        parent, _, child = _field(s, "module_name").rpartition(".")
        plan[parent][child] = mode
    for parent, mods in plan.items():
        modes = set(mods.values())
        if modes != {"column", "row"}:
            raise TensorParallelError(
                f"{parent}: has only {sorted(modes)}-parallel tensors ({sorted(mods)}); a "
                f"parallel block needs column splits feeding a row split")
    return dict(plan)


def _block_size(type_name: str) -> int:
    from voodoo.quants import qtype
    return qtype(type_name).block_size


def check_tp(model: nn.Module, specs, tp_size: int, n_head: int, n_head_kv: int) -> dict:
    """Checks that ``model`` (gated or not) can be split ``tp_size`` ways; returns
    :func:`tp_plan`'s plan.

    Rules: ``n_head`` and ``n_head_kv`` divide by ``tp_size`` (heads are not split); each
    column-split module's output rows and each row-split module's input columns divide by
    ``tp_size``; for a row split of a gated module, ``n_per_row / tp_size`` is a multiple of
    each candidate type's block size (so the cut falls between quantization blocks; types from
    ``MixedWeight.types``, skipped when unknown). Raises TensorParallelError naming the first
    failing tensor, or when ``tp_size < 1``."""
    if tp_size < 1:
        raise TensorParallelError(f"tensor_parallel must be >= 1, got {tp_size}")
    plan = tp_plan(specs)
    if tp_size == 1:
        return plan
    if n_head % tp_size or n_head_kv % tp_size:
        raise TensorParallelError(
            f"tensor_parallel={tp_size} must divide the attention heads (n_head={n_head}, "
            f"n_head_kv={n_head_kv}); heads are not split across ranks")
    for parent, mods in plan.items():
        for child, mode in mods.items():
            name = f"{parent}.{child}"
            m = model.get_submodule(name)
            if isinstance(m, MixedQuantLinear):
                n_rows, n_per_row = m.mixed.shape
                types = m.mixed.types
            elif isinstance(m, nn.Linear):
                n_rows, n_per_row, types = m.out_features, m.in_features, None
            else:
                raise TensorParallelError(f"{name} is a {type(m).__name__}; tensor parallel "
                                          f"splits nn.Linear / MixedQuantLinear only")
            n = n_rows if mode == "column" else n_per_row
            if n % tp_size:
                raise TensorParallelError(f"{name}: {n} {'rows' if mode == 'column' else 'columns'}"
                                          f" do not split {tp_size} ways")
            if mode == "row" and types:
                for t in types:
                    bs = _block_size(t)
                    if (n_per_row // tp_size) % bs:
                        raise TensorParallelError(
                            f"{name}: a row-parallel shard of {n_per_row // tp_size} columns "
                            f"({n_per_row} / {tp_size}) is not a multiple of {t}'s block size "
                            f"{bs}; shards must be cut between quantization blocks. Use a "
                            f"smaller tensor_parallel or drop {t} from the menu")
    return plan


# --------------------------------------------------------------------------- sharding


def _shard_linear(m: nn.Module, mode: str, tp: TPGroup) -> ParallelLinear:
    """One rank's shard of ``m`` (nn.Linear or MixedQuantLinear) wrapped in ParallelLinear."""
    if isinstance(m, MixedQuantLinear):
        full = m.mixed
        n_rows, n_per_row = full.shape
        store = getattr(full, "store", None)
        if mode == "column":
            a, b = shard_bounds(n_rows, tp)
        else:
            a, b = shard_bounds(n_per_row, tp)
        if store is not None:  # lazy: a copy of this shard's ggml blocks only
            sub = store.narrow(0 if mode == "column" else 1, a, b - a)
            shard = torch.empty(full.k, 0, 0, device=full.logits.device)
        elif mode == "column":
            shard = full.candidates[:, a:b].clone()
        else:
            shard = full.candidates[:, :, a:b].clone()
        mw = ShardedMixedWeight(full, shard, tp, mode)
        if store is not None:
            mw.store = sub
        bias = m.bias
        inner = MixedQuantLinear(mw, bias[a:b] if (bias is not None and mode == "column")
                                 else None)
        inner.out_features, inner.in_features = mw.shard_shape
        return ParallelLinear(inner, mode, tp, bias if mode == "row" else None)
    if isinstance(m, nn.Linear):
        w = m.weight.detach()
        if mode == "column":
            a, b = shard_bounds(m.out_features, tp)
            w = w[a:b]
        else:
            a, b = shard_bounds(m.in_features, tp)
            w = w[:, a:b]
        inner = nn.Linear(w.shape[1], w.shape[0], bias=(m.bias is not None and mode == "column"),
                          device=w.device, dtype=w.dtype)
        with torch.no_grad():
            inner.weight.copy_(w)
            if m.bias is not None and mode == "column":
                inner.bias.copy_(m.bias[a:b])
        inner.weight.requires_grad_(m.weight.requires_grad)
        bias = m.bias.detach() if (m.bias is not None and mode == "row") else None
        return ParallelLinear(inner, mode, tp, bias)
    raise TensorParallelError(f"cannot shard a {type(m).__name__}")


def _input_hook(tp: TPGroup):
    """Forward pre-hook (with kwargs) applying f to a block's input: the first positional
    tensor, else the ``hidden_states`` keyword."""
    def hook(module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            return (copy_to_tp(args[0], tp), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            kwargs = dict(kwargs, hidden_states=copy_to_tp(kwargs["hidden_states"], tp))
            return args, kwargs
        raise TensorParallelError(f"{type(module).__name__}: cannot find the block input "
                                  f"(first positional tensor or hidden_states=)")
    return hook


def shard_model(model: nn.Module, specs, tp: TPGroup, n_head: int, n_head_kv: int) -> dict:
    """Splits ``model`` in place for rank ``tp.rank`` of a ``tp.size``-way group.

    model: a HF causal LM, gated (:func:`voodoo.gates.install_gates`) or plain (the teacher).
    specs: its adapter's TensorSpecs (module names and ``tp``), taken before gates were
    installed. n_head, n_head_kv: from the adapter/config (:func:`head_counts`).

    Every column/row module becomes a :class:`ParallelLinear` over its shard; each parent block
    gets a forward pre-hook applying :func:`copy_to_tp` to its input; per-module head-count
    attributes (``num_heads``, ``num_key_value_heads``, ``hidden_size`` where a module has
    them, as in older transformers' LlamaAttention) are divided by ``tp.size`` (transformers
    5.x's LlamaAttention reshapes with ``-1`` heads and keeps ``num_key_value_groups``, which
    does not change). Gates keep their logits (copied). Returns the plan (:func:`tp_plan`).
    ``tp.size == 1``: nothing changes. Raises TensorParallelError (see :func:`check_tp`)."""
    plan = check_tp(model, specs, tp.size, n_head, n_head_kv)
    if tp.size == 1:
        return plan
    for parent_name, mods in plan.items():
        parent = model.get_submodule(parent_name)
        for child, mode in mods.items():
            setattr(parent, child, _shard_linear(getattr(parent, child), mode, tp))
        for attr in ("num_heads", "num_key_value_heads", "hidden_size"):
            v = getattr(parent, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and "self_attn" in parent_name:
                setattr(parent, attr, v // tp.size)
        parent.register_forward_pre_hook(_input_hook(tp), with_kwargs=True)
    return plan


def sharded_weights(model: nn.Module) -> list[ShardedMixedWeight]:
    """The sharded gates of ``model``."""
    return [m for m in model.modules() if isinstance(m, ShardedMixedWeight)]
