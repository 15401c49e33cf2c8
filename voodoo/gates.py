"""Gated mixed-quant modules: each selectable tensor becomes a softmax mixture of its candidates.

A selectable weight tensor ``W`` (``(n_rows, n_per_row)`` = torch's ``(out_features,
in_features)``; ``(n_vocab, n_embd)`` for the embedding) is replaced by K candidates ``W_k`` --
the weights quantized to the K types of its menu and dequantized exactly as llama.cpp would,
in HF layout -- and K gate logits ``z``::

    p = softmax(z / T)            # (K,)  T: temperature, annealed by the trainer
    W = sum_k p_k W_k             # (n_rows, n_per_row)

The mixture is computed inside custom autograd functions (:class:`_MixLinearFn`,
:class:`_MixEmbeddingFn`) that keep no K-fold copy in the autograd graph: backward recomputes
``W`` from the candidates buffer (a reference, not a copy) and returns
``dL/dp_k = <g^T x, W_k>`` (summed over tokens), from which autograd through the softmax gives
``dL/dz``.

One :class:`MixedWeight` holds a tensor's candidates and logits. The modules that use it
(:class:`MixedQuantLinear`, :class:`MixedQuantEmbedding`) only reference it, so a tied token
embedding and lm_head share one gate: both paths add to the same logits' gradient, and the
tensor's bytes are counted once (GGUF stores ``token_embd.weight`` once for a tied head).

Precision: gate logits are float32. Candidates may be stored bfloat16 (``--dtype``); the
mixture and the gate gradient are then accumulated in float32, one candidate at a time, since
the differences between high-bit candidates are below bfloat16's resolution of a dot product.

No Ray, no architecture names here.
"""

from __future__ import annotations

import math

import numpy as np
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MixedWeight", "MixedQuantLinear", "MixedQuantEmbedding", "install_gates", "init_gates",
    "mixed_weights", "gate_parameters", "gate_state", "load_gate_state", "set_temperature",
    "model_expected_bytes", "GATE_INITS", "install_param_gates", "ParamGates", "mix_weight",
]

#: Gate initialisations understood by :func:`init_gates`.
GATE_INITS = ("uniform", "budget")

_EXACT = (torch.float32, torch.float64)


# --------------------------------------------------------------------------- mixing kernels


def _mix(probs: torch.Tensor, cand: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``sum_k probs[k] * cand[k]``: probs (K,), cand (K, R, C) -> (R, C) in ``out_dtype``.

    One GEMV over the flattened candidates, ``probs (1, K) @ cand (K, R*C)``, so each candidate
    is read once; for bf16/f16 candidates the GEMV accumulates in float32 (cuBLAS / CPU BLAS)
    and the probabilities are rounded to the candidates' dtype (a one-hot gate stays exact)."""
    k, r, c = cand.shape
    if cand.dtype in _EXACT:
        w = probs.to(cand.dtype).unsqueeze(0) @ cand.reshape(k, r * c)
    elif cand.is_cuda:
        from . import kernels
        return kernels.mix(probs, cand, out_dtype)  # Triton when available
    else:  # bf16 on the CPU: float32 accumulation, one candidate at a time
        p = probs.float()
        w = cand[0].float() * p[0]
        for i in range(1, k):
            w.add_(cand[i].float(), alpha=float(p[i]))
    return w.reshape(r, c).to(out_dtype)


def _dots(cand: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``<cand[k], g>`` for each k: cand (K, R, C), g (R, C) -> (K,) float32; one GEMV, each
    candidate read once (bf16/f16 on CUDA: ``g`` rounded to that dtype, float32 accumulation)."""
    k = cand.shape[0]
    if cand.is_cuda and cand.dtype not in _EXACT:
        from . import kernels
        return kernels.dots(cand, g)  # Triton when available
    if cand.dtype in _EXACT:
        return (cand.reshape(k, -1) @ g.reshape(-1).to(cand.dtype)).float()
    gf = g.reshape(-1).float()
    return torch.stack([torch.dot(cand[i].reshape(-1).float(), gf) for i in range(k)])


#: Keep the mixed weight W from the forward pass for the backward pass instead of recomputing
#: it (one (out, in) copy per layer alive until its backward; saves one read of the K
#: candidates). On by default on CUDA, where reading the candidates is the cost; off on the
#: CPU, where memory is the tighter limit.
SAVE_MIXED_WEIGHT = {"cuda": True, "cpu": False}


class _MixLinearFn(torch.autograd.Function):
    """``y = x @ (sum_k p_k W_k).T + b``.

    Inputs: x (..., in), probs (K,) float32, candidates (K, out, in) (a buffer, no grad),
    bias (out,) or None. Output (..., out) in x's dtype. Saves x, probs and a reference to the
    candidates; backward recomputes W."""

    @staticmethod
    def forward(ctx, x, probs, cand, bias):
        w = _mix(probs, cand, x.dtype)  # (out, in)
        y = F.linear(x, w, None if bias is None else bias.to(x.dtype))
        ctx.keep_w = SAVE_MIXED_WEIGHT.get(cand.device.type, False)
        ctx.save_for_backward(x, probs, cand, w if ctx.keep_w else None)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, g):
        x, probs, cand, w = ctx.saved_tensors
        gx = gp = gb = None
        if ctx.needs_input_grad[0]:
            if w is None:
                w = _mix(probs, cand, g.dtype)
            gx = g @ w.to(g.dtype)  # (..., in)
        g2 = g.reshape(-1, g.shape[-1])  # (N, out)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])  # (N, in)
            if x2.dtype in _EXACT:
                gtx = g2.float().T @ x2.float()  # (out, in) = sum over tokens of g^T x
            else:  # the weight-gradient GEMM of plain training, fp32 accumulation
                gtx = g2.T @ x2
            gp = _dots(cand, gtx).to(probs.dtype)  # (K,)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            gb = g2.sum(0)
        return gx, gp, None, gb


class _MixEmbeddingFn(torch.autograd.Function):
    """``e = (sum_k p_k W_k)[ids]``, gathering only the rows of ``ids``.

    Inputs: ids (...) int64, probs (K,) float32, candidates (K, n_vocab, n_embd), out dtype.
    Output (..., n_embd). Backward: ``dL/dp_k = sum_t <g_t, W_k[ids_t]>``."""

    @staticmethod
    def forward(ctx, ids, probs, cand, out_dtype):
        if cand.dtype in _EXACT:
            e = torch.zeros(*ids.shape, cand.shape[-1], dtype=cand.dtype, device=cand.device)
        else:
            e = torch.zeros(*ids.shape, cand.shape[-1], dtype=torch.float32, device=cand.device)
        for k in range(cand.shape[0]):
            e.add_(F.embedding(ids, cand[k]).to(e.dtype) * probs[k].to(e.dtype))
        ctx.save_for_backward(ids, probs, cand)
        return e.to(out_dtype)

    @staticmethod
    def backward(ctx, g):
        ids, probs, cand = ctx.saved_tensors
        gp = None
        if ctx.needs_input_grad[1]:
            gf = g.float()
            gp = torch.stack([(F.embedding(ids, cand[k]).float() * gf).sum()
                              for k in range(cand.shape[0])]).to(probs.dtype)
        return None, gp, None, None


# --------------------------------------------------------------------------- modules


class MixedWeight(nn.Module):
    """One selectable tensor's candidates and gate.

    Buffers (non-persistent, so they stay out of ``state_dict``):
        candidates: (K, n_rows, n_per_row), HF layout, already dequantized; float32 or bf16.
        nbytes: (K,) float32, bytes llama.cpp writes for the tensor as each candidate type
            (from :func:`voodoo.quants.tensor_nbytes`).
        temperature: () float32, set by :func:`set_temperature` (a tensor, so changing it does
            not recompile under ``torch.compile``).
    Parameter:
        logits: (K,) float32 gate logits; ``probs() = softmax(logits / temperature)``.

    Candidate k is menu entry k (menus run from most to fewest bits per weight).
    """

    def __init__(self, candidates: torch.Tensor, nbytes: Sequence[int] | None = None,
                 gguf_name: str = "", types: Sequence[str] | None = None):
        super().__init__()
        if candidates.dim() != 3:
            raise ValueError(f"{gguf_name}: candidates must be (K, n_rows, n_per_row), got "
                             f"shape {tuple(candidates.shape)}")
        k = candidates.shape[0]
        if nbytes is not None and len(nbytes) != k:
            raise ValueError(f"{gguf_name}: {len(nbytes)} byte sizes for {k} candidates")
        if types is not None and len(types) != k:
            raise ValueError(f"{gguf_name}: {len(types)} type names for {k} candidates")
        self.gguf_name = gguf_name
        self.types = list(types) if types is not None else None
        self.register_buffer("candidates", candidates.detach(), persistent=False)
        nb = torch.tensor([float("nan")] * k if nbytes is None else [float(b) for b in nbytes],
                          dtype=torch.float32, device=candidates.device)
        self.register_buffer("nbytes", nb, persistent=False)
        self.register_buffer("temperature", torch.ones((), dtype=torch.float32,
                                                       device=candidates.device),
                             persistent=False)
        self.logits = nn.Parameter(torch.zeros(k, dtype=torch.float32, device=candidates.device))

    def _apply(self, fn, recurse=True):
        # model.to(dtype) casts candidates (wanted) but must not cast the logits, byte sizes
        # or temperature: they stay float32 whatever the model's dtype.
        super()._apply(fn, recurse)
        for name in ("nbytes", "temperature"):
            setattr(self, name, getattr(self, name).float())
        if self.logits.dtype != torch.float32:
            self.logits.data = self.logits.data.float()
        return self

    @property
    def k(self) -> int:
        return self.candidates.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """(n_rows, n_per_row)."""
        store = getattr(self, "store", None)
        if store is not None:
            return tuple(store.shape2d)
        return tuple(self.candidates.shape[1:])

    def probs(self) -> torch.Tensor:
        """(K,) float32, ``softmax(logits / temperature)``; differentiable in the logits."""
        return torch.softmax(self.logits / self.temperature, dim=0)

    def expected_bytes(self) -> torch.Tensor:
        """() float32, ``sum_k p_k * bytes_k`` in bytes; differentiable in the logits.

        Raises ValueError if the byte sizes were not given."""
        if torch.isnan(self.nbytes).any():
            raise ValueError(f"{self.gguf_name}: no byte sizes were given for the candidates")
        return (self.probs() * self.nbytes).sum()

    @torch.no_grad()
    def weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The current mixed weight (n_rows, n_per_row), detached (for inspection)."""
        store = getattr(self, "store", None)
        if store is not None:
            return store.mix(self.probs(), dtype).reshape(store.shape2d)
        return _mix(self.probs(), self.candidates, dtype)

    def extra_repr(self) -> str:
        return f"{self.gguf_name!r}, K={self.k}, shape={self.shape}"


class MixedQuantLinear(nn.Module):
    """A Linear whose weight is a gated mixture of K candidates.

    ``y = x @ (sum_k p_k W_k).T + bias``: x (..., in_features) -> y (..., out_features) in
    x's dtype. ``mixed`` is either a :class:`MixedWeight` (shared, e.g. a tied lm_head using
    the token embedding's gate) or a candidates tensor (K, out, in), in which case a new
    MixedWeight is made from it, ``nbytes``, ``gguf_name`` and ``types``. The bias, if any, is
    a frozen buffer.
    """

    def __init__(self, mixed: MixedWeight | torch.Tensor, bias: torch.Tensor | None = None,
                 nbytes: Sequence[int] | None = None, gguf_name: str = "",
                 types: Sequence[str] | None = None):
        super().__init__()
        if not isinstance(mixed, MixedWeight):
            mixed = MixedWeight(mixed, nbytes, gguf_name, types)
        self.mixed = mixed
        self.out_features, self.in_features = mixed.shape
        if bias is not None:
            bias = bias.detach()
        self.register_buffer("bias", bias)

    # Convenience views of the shared holder.
    @property
    def logits(self) -> nn.Parameter:
        return self.mixed.logits

    @property
    def candidates(self) -> torch.Tensor:
        return self.mixed.candidates

    @property
    def temperature(self) -> torch.Tensor:
        return self.mixed.temperature

    def probs(self) -> torch.Tensor:
        return self.mixed.probs()

    def expected_bytes(self) -> torch.Tensor:
        """Bytes, ``sum_k p_k bytes_k`` (see :meth:`MixedWeight.expected_bytes`)."""
        return self.mixed.expected_bytes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.mixed, "store", None) is not None:  # lazy: candidates as ggml bytes
            return F.linear(x, mix_weight(self.mixed, x.dtype),
                            None if self.bias is None else self.bias.to(x.dtype))
        return _MixLinearFn.apply(x, self.mixed.probs(), self.mixed.candidates, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class MixedQuantEmbedding(nn.Module):
    """An Embedding whose table is a gated mixture of K candidates (K, n_vocab, n_embd).

    ids (...) int64 -> (..., n_embd) in ``dtype`` (the replaced embedding's dtype; default the
    candidates' dtype; follows ``model.to(dtype)``). Only the looked-up rows are mixed.
    ``mixed`` as in :class:`MixedQuantLinear`; pass the same MixedWeight to the tied lm_head.
    """

    def __init__(self, mixed: MixedWeight | torch.Tensor, nbytes: Sequence[int] | None = None,
                 gguf_name: str = "", types: Sequence[str] | None = None,
                 dtype: torch.dtype | None = None, padding_idx: int | None = None):
        super().__init__()
        if not isinstance(mixed, MixedWeight):
            mixed = MixedWeight(mixed, nbytes, gguf_name, types)
        self.mixed = mixed
        self.num_embeddings, self.embedding_dim = mixed.shape
        self.padding_idx = padding_idx
        # A 0-element buffer whose dtype is the output dtype, so that model.to(dtype) moves it.
        self.register_buffer("_out", torch.empty(0, dtype=dtype or mixed.candidates.dtype,
                                                 device=mixed.candidates.device),
                             persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """Output dtype (follows ``model.to(dtype)``)."""
        return self._out.dtype

    @property
    def logits(self) -> nn.Parameter:
        return self.mixed.logits

    def probs(self) -> torch.Tensor:
        return self.mixed.probs()

    def expected_bytes(self) -> torch.Tensor:
        return self.mixed.expected_bytes()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if getattr(self.mixed, "store", None) is not None:  # lazy: the whole table is mixed
            return F.embedding(ids, mix_weight(self.mixed, self.dtype))
        return _MixEmbeddingFn.apply(ids, self.mixed.probs(), self.mixed.candidates, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


# --------------------------------------------------------------------------- installing


def _field(spec, name, default=None):
    if isinstance(spec, Mapping):
        return spec.get(name, default)
    return getattr(spec, name, default)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _freeze_all_but_gates(model: nn.Module, mixed) -> None:
    """Only the gate logits of ``mixed`` (MixedWeights) require grad afterwards."""
    for p in model.parameters():
        p.requires_grad_(False)
    for mw in mixed:
        mw.logits.requires_grad_(True)


def install_gates(model: nn.Module, specs, candidates: Mapping[str, torch.Tensor],
                  bytes_table: Mapping[str, Sequence[int]], *,
                  menus: Mapping[str, Sequence[str]] | None = None, init: str = "uniform",
                  init_bpw: float | None = None, init_strength: float = 2.0,
                  freeze: bool = True, stores: Mapping[str, nn.Module] | None = None
                  ) -> dict[str, MixedWeight]:
    """Replaces the selectable modules of a HF model by gated mixed-quant modules, in place.

    Args:
        model: a transformers model (any nn.Module addressed by module names).
        specs: TensorSpec-like objects or dicts (``voodoo.arch``) with ``gguf_name``,
            ``module_name`` and ``tied_to`` (other module names sharing the tensor, e.g. a tied
            ``lm_head``). Each named module must be an ``nn.Linear`` or ``nn.Embedding``.
        candidates: gguf_name -> (K, n_rows, n_per_row) tensor, HF layout (un-permuted with
            ``adapter.gguf_rows_to_hf``), dequantized, on the model's device; float32 or bf16.
        bytes_table: gguf_name -> K ints, bytes of the tensor as each candidate type.
        menus: optional gguf_name -> K type names (kept on the MixedWeight for reporting).
        init, init_bpw, init_strength: gate initialisation, see :func:`init_gates`.
        freeze: set ``requires_grad=False`` on every parameter except the gate logits.
        stores: gguf_name -> candidates held elsewhere, HF layout (``--lazy``: a
            :class:`voodoo.lazy.QuantizedCandidates` of ggml bytes, mixed whole on each call
            through :func:`mix_weight`); ``candidates`` may then omit those names.

    Returns gguf_name -> MixedWeight (sorted by name).

    Raises ValueError if a module is missing or of another kind, or a candidate shape or count
    does not match the module's weight / ``bytes_table``. Do not call the model's
    ``tie_weights()`` afterwards: the replaced modules have no ``weight`` parameter.
    """
    out: dict[str, MixedWeight] = {}
    for spec in specs:
        name = _field(spec, "gguf_name")
        store = (stores or {}).get(name)
        if store is None and name not in candidates:
            raise ValueError(f"no candidates for selectable tensor {name}")
        cand = (candidates[name] if store is None
                else torch.empty(store.k, 0, 0, device=getattr(store, "device", None)))
        mw = MixedWeight(cand, bytes_table[name], name, None if menus is None else menus[name])
        if store is not None:
            mw.store = store
        modules = [_field(spec, "module_name")] + list(_field(spec, "tied_to", None) or [])
        for mod_name in modules:
            try:
                old = model.get_submodule(mod_name)
            except AttributeError as e:
                raise ValueError(f"{name}: model has no module {mod_name!r}") from e
            if isinstance(old, nn.Embedding):
                new = MixedQuantEmbedding(mw, dtype=old.weight.dtype,
                                          padding_idx=old.padding_idx)
                want = (old.num_embeddings, old.embedding_dim)
            elif isinstance(old, nn.Linear):
                new = MixedQuantLinear(mw, old.bias)
                want = (old.out_features, old.in_features)
            else:
                raise ValueError(f"{name}: module {mod_name!r} is a {type(old).__name__}, "
                                 f"expected nn.Linear or nn.Embedding")
            if tuple(mw.shape) != want:
                raise ValueError(f"{name}: candidates are {tuple(mw.shape)} per type but module "
                                 f"{mod_name!r} has weight {want}")
            _set_submodule(model, mod_name, new)
        out[name] = mw
    out = dict(sorted(out.items()))
    init_gates(out, init, init_bpw, init_strength)
    if freeze:
        _freeze_all_but_gates(model, out.values())
    return out


@torch.no_grad()
def init_gates(mixed: Mapping[str, MixedWeight] | nn.Module, init: str = "uniform",
               init_bpw: float | None = None, strength: float = 2.0) -> None:
    """Sets the gate logits; deterministic (no randomness).

    ``"uniform"``: all logits 0 (p_k = 1/K at any temperature).
    ``"budget"``: a prior toward the budget, ``z_k = -strength * |bpw_k - init_bpw|`` with
    ``bpw_k = 8 * bytes_k / (n_rows * n_per_row)`` (bits per weight) -- so every tensor starts
    near the types whose size matches the budget's bits per weight, the expected size starts
    near the budget and the size penalty does not dominate the first steps, while other types
    keep some mass (at T=1 and strength 2, a type one bit away has e^-2 ~ 0.14 of the
    nearest's weight). ``init_bpw`` is required (:func:`voodoo.budget.budget_bpw`).

    Raises ValueError for an unknown ``init`` or a missing ``init_bpw``.
    """
    if isinstance(mixed, nn.Module):
        mixed = mixed_weights(mixed)
    if init not in GATE_INITS:
        raise ValueError(f"unknown gate init {init!r}; choose one of {GATE_INITS}")
    if init == "budget" and init_bpw is None:
        raise ValueError("gate init 'budget' needs init_bpw (the budget in bits per weight)")
    for mw in mixed.values():
        if init == "uniform":
            mw.logits.zero_()
        else:
            n = mw.shape[0] * mw.shape[1]
            bpw = mw.nbytes.double() * 8.0 / n
            mw.logits.copy_((-strength * (bpw - init_bpw).abs()).float())


# --------------------------------------------------------------------------- model helpers


def mixed_weights(model: nn.Module) -> dict[str, MixedWeight]:
    """gguf_name -> MixedWeight for every gate in ``model``, each once, sorted by name."""
    out = {m.gguf_name: m for m in model.modules() if isinstance(m, MixedWeight)}
    return dict(sorted(out.items()))


def gate_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The gate logits of ``model`` in gguf_name order (the optimizer's parameter order)."""
    return [m.logits for m in mixed_weights(model).values()]


def gate_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """gguf_name -> gate logits (K,) float32, detached CPU copies, sorted by name."""
    return {n: m.logits.detach().float().cpu().clone() for n, m in mixed_weights(model).items()}


@torch.no_grad()
def load_gate_state(model: nn.Module | Mapping[str, MixedWeight],
                    state: Mapping[str, torch.Tensor]) -> None:
    """Loads logits saved by :func:`gate_state` into a model (or a gguf_name -> MixedWeight
    mapping). Raises ValueError if the names or K differ."""
    mws = mixed_weights(model) if isinstance(model, nn.Module) else dict(model)
    if set(mws) != set(state):
        missing, extra = sorted(set(mws) - set(state)), sorted(set(state) - set(mws))
        raise ValueError(f"gate state does not match the model: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    for n, m in mws.items():
        v = torch.as_tensor(state[n])
        if v.shape != m.logits.shape:
            raise ValueError(f"{n}: saved logits have shape {tuple(v.shape)}, gate has "
                             f"{tuple(m.logits.shape)}")
        m.logits.copy_(v.to(m.logits))


@torch.no_grad()
def set_temperature(model: nn.Module, t: float) -> None:
    """Sets every gate's temperature (in place, no recompilation). Raises ValueError if t<=0."""
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"temperature must be positive and finite, got {t}")
    for m in mixed_weights(model).values():
        m.temperature.fill_(t)


def model_expected_bytes(model: nn.Module) -> torch.Tensor:
    """() float32, total expected bytes of all selectable tensors (tied ones counted once);
    differentiable in the gate logits."""
    mws = list(mixed_weights(model).values())
    if not mws:
        raise ValueError("the model has no gates; call install_gates first")
    return torch.stack([m.expected_bytes() for m in mws]).sum()


# ------------------------------------------------------------- gates on any HF parameter


class _MixFn(torch.autograd.Function):
    """``W = sum_k p_k cand[k]``: probs (K,) float32, cand (K, R, C) buffer -> (R, C) in
    ``out_dtype``. Backward: ``dL/dp_k = <cand[k], dL/dW>`` (float32); nothing K-fold is kept
    in the graph (the candidates are a reference)."""

    @staticmethod
    def forward(ctx, probs, cand, out_dtype):
        ctx.save_for_backward(probs, cand)
        return _mix(probs, cand, out_dtype)

    @staticmethod
    def backward(ctx, g):
        probs, cand = ctx.saved_tensors
        gp = _dots(cand, g).to(probs.dtype) if ctx.needs_input_grad[0] else None
        return gp, None, None


def mix_weight(mw: MixedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The gated mixture of ``mw`` as a differentiable ``(n_rows, n_per_row)`` tensor in
    ``dtype`` (GGUF layout, experts stacked as rows)."""
    store = getattr(mw, "store", None)
    if store is not None:  # candidates held elsewhere (e.g. voodoo.lazy.QuantizedCandidates)
        return store.mix_autograd(mw.probs(), dtype)
    return _MixFn.apply(mw.probs(), mw.candidates, dtype)


def _key(name: str) -> str:
    return name.replace(".", "__")


class ParamGates(nn.Module):
    """The gates of a model whose HF parameters are mixtures of GGUF tensors' candidates,
    mapped back through a :class:`voodoo.tensormap.TensorMap`.

    Every HF parameter that a selectable GGUF tensor reads stops being a Parameter: before each
    forward of the model (a forward pre-hook on the root module) it is recomputed from the
    gates -- each GGUF tensor's mixture ``sum_k p_k W_k`` (GGUF layout), its rows placed back
    where the converter took them (inverse row permutation, transpose, split, divided by the
    converter's scale) -- and set as a plain tensor attribute on every module that owned it
    (both modules of a tied embedding). So the HF modules' own forwards run unchanged (scaled
    embeddings, ``.weight`` reads, fused 3-D experts, custom kernels). Elements of a parameter
    that no selectable tensor covers keep their value (a frozen buffer).

    Submodules: ``mixed`` (ModuleDict of :class:`MixedWeight`, one per GGUF tensor) and
    ``base`` (buffers of partly covered parameters).

    ``per_module`` (the lazy student's choice): each parameter is mixed when the first module
    owning it is called (a forward pre-hook on that module; the root hook only starts a new
    step) and kept for the rest of the step, so a checkpointed layer's recomputation reads the
    same tensor. Same weights and gradients; but the mixture's autograd node is created next to
    the layer that uses it, so the backward consumes each ``dL/dW`` (and frees it) as soon as
    that layer is done, instead of holding every weight's gradient to the end of the backward
    (the nodes of weights mixed before the forward have the lowest priority in autograd's
    queue). Needs modules that read their weights inside their own forward."""

    def __init__(self, model: nn.Module, tmap, mixed: Mapping[str, MixedWeight],
                 per_module: bool = False):
        super().__init__()
        self.mixed = nn.ModuleDict({_key(n): mw for n, mw in mixed.items()})
        self.base = nn.Module()
        # [(param name, shape, transpose, dtype, owners, [(gguf, link)], full)]
        self._plan = []
        names: dict[int, str] = {}
        for pname, p, own, t, view, links, full, simple in param_links(model, tmap, mixed,
                                                                       "gate"):
            names[id(p)] = pname
            if not full:
                self.base.register_buffer(_key(pname), view.clone(), persistent=False)
            self._plan.append((pname, tuple(p.shape), t, p.dtype, own,
                               [(e.gguf_name, lk) for e, lk in links], full, simple))
            for mod, attr in own:
                del mod._parameters[attr]
                setattr(mod, attr, p.detach())
        self.per_module = bool(per_module)
        self._step: dict[int, torch.Tensor] = {}   # plan index -> this step's tensor
        self._hook = model.register_forward_pre_hook(self._refresh)
        self._module_hooks = []
        if self.per_module:
            by_mod: dict[int, tuple[nn.Module, list[int]]] = {}
            for i, item in enumerate(self._plan):
                for mod, _ in item[4]:
                    by_mod.setdefault(id(mod), (mod, []))[1].append(i)
            for mod, idx in by_mod.values():
                if mod is model:
                    continue  # the root's own parameters: mixed by _refresh
                self._module_hooks.append(mod.register_forward_pre_hook(
                    lambda m, a, idx=tuple(idx): self._load(idx)))

    def remove(self) -> None:
        """Removes the forward pre-hooks (the model then keeps its last weights)."""
        self._hook.remove()
        for h in self._module_hooks:
            h.remove()

    @torch.no_grad()
    def follow_modules(self, model: nn.Module) -> dict[str, str]:
        """Moves each gate (its candidates, logits and buffers) to the device of the module
        that reads its parameter -- the device of the first tensor found in that module or,
        going up, its parents -- so that after a layer-wise split (``--device_map``) each
        layer's weights are mixed on its own device. Returns gguf_name -> device."""
        names = {id(m): n for n, m in model.named_modules()}
        out = {}
        for pname, shape, t, dtype, owners, links, full, simple in self._plan:
            dev = None
            mod_name = names.get(id(owners[0][0]), "")
            while dev is None:
                mod = model.get_submodule(mod_name) if mod_name else model
                for tns in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
                    dev = tns.device
                    break
                if dev is None and not mod_name:
                    break
                mod_name = mod_name.rpartition(".")[0]
            if dev is None:
                continue
            for g, _ in links:
                mw = self.mixed[_key(g)]
                if mw.logits.device != dev:
                    mw.to(dev)
                out[g] = str(dev)
            if not full:
                b = getattr(self.base, _key(pname))
                setattr(self.base, _key(pname), b.to(dev))
        return out

    def _refresh(self, module, args):
        if not self.per_module:
            self.assemble()
            return
        self._step = {}
        self._gcache: dict[str, torch.Tensor] = {}
        root = [i for i, item in enumerate(self._plan)
                if any(m is module for m, _ in item[4])]
        self._load(root)

    @torch._dynamo.disable
    def _load(self, idx) -> None:
        """``per_module``: mixes the parameters ``idx`` of the plan unless this step has them,
        and sets them on every module owning them (outside ``torch.compile``'s graphs, like
        the lazy mix itself)."""
        for i in idx:
            if i in self._step:
                continue
            pname, shape, t, dtype, owners, links, full, simple = self._plan[i]
            # inside a checkpointed layer, what the mixing saves for its backward is kept as
            # it is: the recomputation finds the step's tensor and mixes nothing, and
            # checkpointing must see the same saved tensors in both passes
            with torch.autograd.graph.saved_tensors_hooks(_same, _same):
                w = self._param(pname, shape, t, dtype, links, full, simple,
                                getattr(self, "_gcache", {}))
            self._step[i] = w
            for mod, attr in owners:
                setattr(mod, attr, w)

    @torch._dynamo.disable
    def assemble(self) -> None:
        """Recomputes every gated HF parameter from the gates and sets it on its modules.

        Runs outside ``torch.compile``'s graphs (the mixing kernels are hand-written or lazy
        ones already): traced, every parameter's mixing was a graph of its own whose guards
        (the parameter's name, the step's cache) differed, so a compiled student hit dynamo's
        recompile limit after a few parameters and spent minutes compiling its first step."""
        cache: dict[str, torch.Tensor] = {}
        for pname, shape, t, dtype, owners, links, full, simple in self._plan:
            w = self._param(pname, shape, t, dtype, links, full, simple, cache)
            for mod, attr in owners:
                setattr(mod, attr, w)

    def _param(self, pname, shape, t, dtype, links, full, simple, cache):
        def mixed(g):
            if g not in cache:
                cache[g] = mix_weight(self.mixed[_key(g)], dtype)
            return cache[g]

        base = None if full else getattr(self.base, _key(pname))
        dev = self.mixed[_key(links[0][0])].logits.device
        return assemble_param(shape, t, links, mixed, base, dtype, dev, simple)


def _same(x):
    return x


def assemble_param(shape, transpose: bool, links, get, base, dtype, device,
                   simple: bool = False) -> torch.Tensor:
    """One HF parameter (``shape``) from GGUF tensors: ``links`` [(gguf_name, Link)] reading it,
    ``get(gguf_name)`` -> that tensor's ``(n_rows, n_per_row)`` values; rows placed where the
    converter took them (inverse of :meth:`voodoo.tensormap.TensorMap.to_gguf`: divided by the
    scale, columns un-permuted, transposed back). ``base``: the parameter's row view, for the
    elements no link covers (None when every element is covered). Differentiable in ``get``'s
    tensors."""
    from .tensormap import _idx, row_view

    if len({lk.transpose for _, lk in links}) > 1:
        # one parameter read both transposed and not (MLA's kv_b_proj: attn_k_b takes its
        # key half per head transposed, attn_v_b its value half as it is): the links of the
        # base's orientation first, then the others over that result in their own orientation
        # (the two groups cover disjoint elements)
        first = [x for x in links if x[1].transpose == transpose]
        other = [x for x in links if x[1].transpose != transpose]
        w = assemble_param(shape, transpose, first, get, base, dtype, device)
        return assemble_param(shape, not transpose, other, get, row_view(w, not transpose),
                              dtype, device)

    def unview(v):
        if len(shape) <= 1:
            return v.reshape(shape)
        if transpose:
            sw = list(shape)
            sw[-1], sw[-2] = sw[-2], sw[-1]
            return v.reshape(sw).transpose(-1, -2)
        return v.reshape(shape)

    if simple:
        return unview(get(links[0][0]))
    if base is None:
        if len(shape) <= 1:
            n_rows, n_cols = 1, (shape[0] if shape else 1)
        elif transpose:
            n_rows, n_cols = int(np.prod(shape[:-2])) * shape[-1], shape[-2]
        else:
            n_rows, n_cols = int(np.prod(shape[:-1])), shape[-1]
        v = torch.zeros(n_rows, n_cols, dtype=dtype, device=device)
    else:
        v = base.to(device=device, dtype=dtype)
    for g, lk in links:
        rows = get(g).to(device=device, dtype=dtype).index_select(0, _idx(lk.g_rows, device))
        if lk.scale is not None:
            rows = rows / torch.as_tensor(lk.scale, dtype=rows.dtype, device=device)[:, None]
        if lk.cols is None:
            v = v.index_copy(0, _idx(lk.p_rows, device), rows)
        else:
            pr = _idx(lk.p_rows, device)[:, None].expand(-1, lk.cols.size)
            pc = _idx(lk.cols, device)[None, :].expand(pr.shape[0], -1)
            v = v.index_put((pr, pc), rows)
    return unview(v)


@torch.no_grad()
def write_gguf_into_params(model: nn.Module, tmap, tensors: Mapping[str, torch.Tensor]) -> None:
    """Overwrites, in place, every HF parameter the map reads with the values of GGUF tensors
    ``tensors`` (gguf_name -> ``(n_rows, n_per_row)``, e.g. dequantized Q8_0 for a Q8_0
    teacher), mapped back through ``tmap``. Raises KeyError for a missing tensor."""
    from .tensormap import row_view
    params = dict(model.named_parameters(remove_duplicate=True))
    for pname, links in tmap.by_param().items():
        p = params[pname]
        t = links[0][1].transpose
        base = row_view(p.detach(), t).clone()
        w = assemble_param(tuple(p.shape), t, [(e.gguf_name, lk) for e, lk in links],
                           lambda g: tensors[g], base, p.dtype, p.device)
        p.copy_(w)


def install_param_gates(model: nn.Module, tmap, candidates: Mapping[str, torch.Tensor],
                        bytes_table: Mapping[str, Sequence[int]], *,
                        menus: Mapping[str, Sequence[str]] | None = None,
                        init: str = "uniform", init_bpw: float | None = None,
                        init_strength: float = 2.0, freeze: bool = True,
                        stores: Mapping[str, nn.Module] | None = None,
                        per_module: bool | None = None
                        ) -> dict[str, MixedWeight]:
    """Gates on any HF parameter: every selectable GGUF tensor of ``tmap`` (a
    :class:`voodoo.tensormap.TensorMap`) gets a :class:`MixedWeight` over its candidates, and
    the parameters it reads are recomputed from the gates before each forward
    (:class:`ParamGates`, attached to the model as ``model.voodoo_gates``).

    Args:
        model: the transformers model the map was derived for (float32 or bf16), in place.
        tmap: its tensor map.
        candidates: gguf_name -> (K, n_rows, n_per_row) dequantized candidates in GGUF layout
            (experts stacked as rows), on the model's device; float32 or bf16. May omit names
            given in ``stores``.
        bytes_table: gguf_name -> K ints, the tensor's bytes as each candidate type.
        menus: gguf_name -> K type names.
        init, init_bpw, init_strength: :func:`init_gates`.
        freeze: only the gate logits require grad afterwards.
        stores: gguf_name -> a module holding the candidates elsewhere (quantized, see
            :mod:`voodoo.lazy`), with ``k``, ``shape`` and ``mix_autograd(probs, dtype)``.
        per_module: :class:`ParamGates`'s; default: on when ``stores`` are given.

    Returns gguf_name -> MixedWeight (sorted by name). Raises ValueError on a missing gate, a
    candidate shape that is not the tensor's ``(n_rows, n_per_row)``, or a map of another model.
    """
    out: dict[str, MixedWeight] = {}
    for e in tmap:
        name = e.gguf_name
        store = (stores or {}).get(name)
        if store is not None:
            cand = torch.empty(store.k, 0, 0, device=getattr(store, "device", None))
        elif name in candidates:
            cand = candidates[name]
            if tuple(cand.shape[1:]) != e.shape:
                raise ValueError(f"{name}: candidates are {tuple(cand.shape[1:])} per type, the "
                                 f"tensor is {e.shape}")
        else:
            raise ValueError(f"no candidates for selectable tensor {name}")
        mw = MixedWeight(cand, bytes_table[name], name, None if menus is None else menus[name])
        if store is not None:
            mw.store = store
        out[name] = mw
    out = dict(sorted(out.items()))
    gates = ParamGates(model, tmap, out, per_module=bool(stores) if per_module is None
                       else per_module)
    model.voodoo_gates = gates
    init_gates(out, init, init_bpw, init_strength)
    if freeze:
        _freeze_all_but_gates(model, out.values())
    with torch.no_grad():
        gates.assemble()
    return out


def param_links(model: nn.Module, tmap, have, what: str):
    """Walks the tensor map's HF parameters for :class:`ParamGates` and
    :class:`voodoo.lazy.QuantizedParams`: yields ``(pname, p, owners, transpose, view, links,
    full, simple)`` where ``owners`` lists the ``(module, attr)`` holding ``p``, ``view`` is
    :func:`voodoo.tensormap.row_view` of it, ``full`` says the links cover every row and
    column, and ``simple`` that one link copies it unchanged. Raises ValueError for a
    parameter the model lacks or a GGUF tensor not in ``have`` (``"no {what} for <name>"``).
    A parameter read both transposed and not (MLA's ``kv_b_proj``) comes with the first
    link's orientation and ``full`` False."""
    from .tensormap import row_view
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for attr, p in list(mod._parameters.items()):
            if p is not None:
                owners.setdefault(id(p), []).append((mod, attr))
    params = dict(model.named_parameters(remove_duplicate=True))
    for pname, links in tmap.by_param().items():
        if pname not in params:
            raise ValueError(f"the tensor map reads {pname!r}, which the model does not have "
                             "(a map derived for another model)")
        for e, _ in links:
            if e.gguf_name not in have:
                raise ValueError(f"no {what} for {e.gguf_name}")
        p = params[pname]
        transposes = {lk.transpose for _, lk in links}
        t = links[0][1].transpose
        view = row_view(p.detach(), t)
        covered = np.zeros(view.shape[0], bool)
        full_cols = True
        for _, lk in links:
            if lk.transpose != t:
                continue  # rows of the other orientation
            covered[lk.p_rows] = True
            if lk.cols is not None and lk.cols.size != view.shape[1]:
                full_cols = False
        # read both transposed and not (assemble_param takes the two orientations in turn):
        # coverage is not worked out across them, the base is kept
        full = bool(covered.all()) and full_cols and len(transposes) == 1
        simple = (len(links) == 1 and full and links[0][1].cols is None and
                  links[0][1].scale is None and
                  np.array_equal(links[0][1].p_rows, np.arange(view.shape[0])) and
                  np.array_equal(links[0][1].g_rows, np.arange(links[0][0].n_rows)))
        yield pname, p, owners[id(p)], t, view, links, full, simple
