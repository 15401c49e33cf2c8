"""Candidates kept as their ggml bytes ("lazy"): mixed and differentiated tile by tile.

A gated tensor has K candidates, one per ggml type of its menu. The eager path holds them as a
dense ``(K, *shape)`` float tensor (K x 2 or 4 bytes per weight); :class:`QuantizedCandidates`
holds the very bytes the candidate cache and the exported GGUF hold (``bpw / 8`` bytes per
weight per candidate) and computes what the gates need from them:

* ``mix(p)``   ``W = sum_k p_k deq(Q_k)``  -- the gated weight of the forward;
* ``dots(g)``  ``<deq(Q_k), g>`` for every k -- ``dL/dp_k`` given ``g = dL/dW``;

each one row tile at a time, so at most one tile of K dequantized candidates exists at once.
``deq`` is :func:`voodoo.dequant.dequantize`, bit-identical to libggml's ``to_float``: the
weights mixed here are exactly the weights llama.cpp will run. On CUDA, ``mix`` and ``dots``
run the hand-written Triton kernels of :mod:`voodoo.triton_lazy` (one launch over the whole
tensor and all K candidates) when they handle the menu (:func:`voodoo.triton_lazy.supports`)
and Triton imports; otherwise, or with ``VOODOO_LAZY_KERNEL=inductor``, each tile's
dequantize-and-mix (dequantize-and-dot) is one ``torch.compile``'d kernel under Inductor options
that keep those bits (no FMA contraction, no flush to zero; checked on an H200 for every type,
``benchmarks/results/lazy_candidates/``). On the CPU the same torch ops run eagerly.
:meth:`QuantizedCandidates.narrow` cuts a tensor-parallel rank's shard (its bytes only).

:class:`LazyMix` is the autograd function over ``mix``/``dots`` (probabilities in, gated weight
out); the gates' own parametrisation (softmax, temperature, ...) stays outside.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import torch

from .dequant import compile_recompile_limit, dequantize, exact_compile_options, warm_tables
from .quants import qtype

__all__ = ["QuantizedCandidates", "LazyMix", "lazy_mix", "QuantizedParams", "predict_memory",
           "format_memory", "plan_memory", "host_memory_capacity", "cgroup_headroom",
           "MemoryPlanError", "DEFAULT_TILE_ELEMENTS",
           "DEFAULT_COMPILED_TILE_ELEMENTS", "lazy_kernel_choice", "LAZY_KERNEL_ENV"]

#: Weights per tile (rows x n_per_row, rounded to whole rows) on the eager path: ~4 Mi weights
#: keeps the float32 temporaries of one candidate's dequantization at a few tens of MiB.
DEFAULT_TILE_ELEMENTS = 1 << 22
#: The same for the compiled path, whose fused kernels keep no per-weight temporaries (only
#: the tile's output): fewer, larger tiles, as each tile costs a guard check and a launch.
DEFAULT_COMPILED_TILE_ELEMENTS = 1 << 26


class QuantizedCandidates(torch.nn.Module):
    """K candidates of one GGUF tensor, held as ggml bytes.

    Args:
        blocks: K uint8 tensors (or numpy arrays, e.g. ``CandidateCache.get``'s), candidate k
            as ``(n_rows, row_bytes_k)`` (or any shape with that many bytes) where
            ``n_rows = prod(shape[:-1])`` and ``row_bytes_k`` is the row size of ``types[k]``
            for ``shape[-1]`` weights (``QuantType.row_nbytes``).
        types: K ggml type names (``"Q8_0"``, ``"IQ2_XXS"``, ``"F16"`` ...), each one
            :func:`voodoo.dequant.dequantize` supports.
        shape: the tensor's shape in GGUF numpy order: ``(n_rows, n_per_row)`` or
            ``(n_expert, n_rows, n_per_row)``; the last dimension is the quantized one.
        tile_elements: weights per tile (rounded down to whole rows, at least one row);
            default :data:`DEFAULT_TILE_ELEMENTS` eager, :data:`DEFAULT_COMPILED_TILE_ELEMENTS`
            compiled.
        compile: run ``mix``/``dots`` as fused kernels: on CUDA the Triton kernels of
            :mod:`voodoo.triton_lazy` where they handle the menu (``VOODOO_LAZY_KERNEL``,
            :func:`lazy_kernel_choice`), else each tile's dequantize-and-mix (and
            dequantize-and-dot) as one ``torch.compile``'d kernel (Inductor options of
            :func:`voodoo.dequant.exact_compile_options`: no FMA contraction, no flush to
            zero, so the dequantized weights stay libggml's bits). ``None`` (default): on CUDA
            only; the CPU runs the eager torch ops.

    Raises:
        ValueError: K == 0, ``len(blocks) != len(types)``, an unsupported type, a row length
            that is not a multiple of a type's block size, or a byte count that does not match.
        TypeError: a candidate that is not uint8.

    The byte buffers are registered buffers (``q0 .. q{K-1}``): ``.to(device)`` moves them and
    ``nbytes`` counts them.
    """

    def __init__(self, blocks: Sequence[torch.Tensor], types: Sequence[str],
                 shape: Sequence[int], tile_elements: int | None = None,
                 compile: bool | None = None):
        super().__init__()
        if len(blocks) == 0 or len(blocks) != len(types):
            raise ValueError(f"need one type per candidate and at least one candidate; got "
                             f"{len(blocks)} byte tensors and {len(types)} types")
        self.shape = tuple(int(s) for s in shape)
        if len(self.shape) < 2:
            raise ValueError(f"shape {self.shape} must be (n_rows, n_per_row) or "
                             f"(n_expert, n_rows, n_per_row)")
        self.n_per_row = self.shape[-1]
        self.n_rows = math.prod(self.shape[:-1])
        self.types = tuple(qtype(t).name for t in types)
        for k, (b, t) in enumerate(zip(blocks, self.types)):
            if not isinstance(b, torch.Tensor):
                b = torch.as_tensor(b)
            if b.dtype != torch.uint8:
                raise TypeError(f"candidate {k} ({t}) must be the raw bytes as torch.uint8, "
                                f"got {b.dtype}")
            row_bytes = qtype(t).row_nbytes(self.n_per_row)  # raises for a bad row length
            if b.numel() != self.n_rows * row_bytes:
                raise ValueError(f"candidate {k} ({t}) has {b.numel()} bytes; shape "
                                 f"{self.shape} as {t} needs {self.n_rows} rows x {row_bytes} "
                                 f"bytes = {self.n_rows * row_bytes}")
            self.register_buffer(f"q{k}", b.detach().reshape(self.n_rows, row_bytes).contiguous(),
                                 persistent=False)
        self.compile = compile
        self.tile_elements = tile_elements

    # ------------------------------------------------------------------ properties
    @property
    def k(self) -> int:
        """Number of candidates K."""
        return len(self.types)

    def blocks(self, k: int) -> torch.Tensor:
        """Candidate ``k``'s bytes, ``(n_rows, row_bytes_k)`` uint8."""
        return getattr(self, f"q{k}")

    @property
    def nbytes(self) -> int:
        """Bytes held on the device: the K candidates' ggml bytes."""
        return sum(self.blocks(k).numel() for k in range(self.k))

    @property
    def device(self) -> torch.device:
        return self.q0.device

    @property
    def shape2d(self) -> tuple[int, int]:
        """``(n_rows, n_per_row)``: the tensor as rows (experts stacked as rows), the layout
        :class:`voodoo.gates.MixedWeight` works in."""
        return (self.n_rows, self.n_per_row)

    @torch._dynamo.disable
    def mix_autograd(self, probs: torch.Tensor, dtype: torch.dtype = torch.float32
                     ) -> torch.Tensor:
        """Differentiable ``sum_k probs[k] deq(Q_k)`` as ``shape2d`` in ``dtype`` (the store
        interface :func:`voodoo.gates.mix_weight` calls): ``probs`` ``(K,)`` float32 on the
        buffers' device; ``dL/dprobs`` recomputed tile by tile in the backward (:class:`LazyMix`).
        Runs outside ``torch.compile``'s graph (its tiles are compiled kernels of their own)."""
        return lazy_mix(self, probs, dtype).reshape(self.shape2d)

    def dense_nbytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes the eager path's dense ``(K, *shape)`` tensor of ``dtype`` would hold."""
        return self.k * self.n_rows * self.n_per_row * dtype.itemsize

    @property
    def tile_rows(self) -> int:
        """Rows per tile (depends on the device when no ``tile_elements`` was given)."""
        te = self.tile_elements
        if te is None:
            te = DEFAULT_COMPILED_TILE_ELEMENTS if self._compiled() else DEFAULT_TILE_ELEMENTS
        return max(1, int(te) // self.n_per_row)

    def _tiles(self):
        for r0 in range(0, self.n_rows, self.tile_rows):
            yield r0, min(self.n_rows, r0 + self.tile_rows)

    def _compiled(self) -> bool:
        return self.device.type == "cuda" if self.compile is None else bool(self.compile)

    def _tile_blocks(self, r0: int, r1: int) -> list[torch.Tensor]:
        return [self.blocks(k)[r0:r1] for k in range(self.k)]

    def _deq(self, k: int, r0: int, r1: int) -> torch.Tensor:
        return dequantize(self.blocks(k)[r0:r1], self.types[k], self.n_per_row)  # (r, n) f32

    # ------------------------------------------------------------------- the maths
    def dense(self, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Candidate ``k`` dequantized: ``shape`` tensor of ``dtype`` on the buffers' device
        (float32: libggml's ``to_float`` bits exactly). With K = 1 this is how a quantized
        (e.g. Q8_0) teacher weight is rebuilt on the fly. On the Triton path this is the
        mix kernel over candidate ``k`` alone with ``p = 1`` (``x * 1.0 == x`` bit for bit)."""
        if self._compiled():
            tk = _triton_kernels(self, torch.float32, types=self.types[k:k + 1])
            if tk is not None:
                one = torch.ones(1, dtype=torch.float32, device=self.device)
                return tk.mix(one, [self.blocks(k)], self.types[k:k + 1], self.n_per_row,
                              dtype).reshape(self.shape)
            warm_tables(self.types[k:k + 1], self.device)
            fn = _compiled_fn("dense")
            with torch._dynamo.config.patch(**compile_recompile_limit()):
                w = fn(self.blocks(k), self.types[k], self.n_per_row, dtype)
        else:
            w = dequantize(self.blocks(k), self.types[k], self.n_per_row).to(dtype)
        return w.reshape(self.shape)

    def mix(self, probs: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W = sum_k probs[k] * deq(Q_k)``, computed tile by tile (on the Triton path, one
        launch over the whole tensor; the same float32 arithmetic, bit for bit).

        Args:
            probs: ``(K,)`` float32 (or float64) mixing weights, on the buffers' device.
            dtype: dtype of the returned ``W``.

        Returns:
            ``shape`` tensor of ``dtype``. Accumulates in float32 (float64 if ``probs`` is
            float64), in candidate order; equal to the dense ``probs @ cand.reshape(K, -1)``
            within float32 rounding, and exactly for one-hot ``probs``.

        Raises:
            ValueError: ``probs`` is not ``(K,)``, or ``VOODOO_LAZY_KERNEL`` is neither
                ``triton`` nor ``inductor`` (compiled path only).
        """
        probs = self._check_probs(probs)
        acc_dtype = torch.float64 if probs.dtype == torch.float64 else torch.float32
        p = probs.to(acc_dtype)
        if self._compiled():
            tk = _triton_kernels(self, acc_dtype)
            if tk is not None:  # one hand-written Triton launch over the whole tensor
                return tk.mix(p, [self.blocks(k) for k in range(self.k)], self.types,
                              self.n_per_row, dtype).reshape(self.shape)
            warm_tables(self.types, self.device)
            fn = _compiled_fn("mix")
            tiles = list(self._tiles())
            with torch._dynamo.config.patch(**compile_recompile_limit()):
                if len(tiles) == 1:  # the fused kernel writes W itself
                    return fn(p, self._tile_blocks(0, self.n_rows), self.types, self.n_per_row,
                              dtype).reshape(self.shape)
                out = torch.empty((self.n_rows, self.n_per_row), dtype=dtype, device=self.device)
                for r0, r1 in tiles:
                    out[r0:r1] = fn(p, self._tile_blocks(r0, r1), self.types, self.n_per_row,
                                    dtype)
            return out.reshape(self.shape)
        out = torch.empty((self.n_rows, self.n_per_row), dtype=dtype, device=self.device)
        for r0, r1 in self._tiles():
            acc = self._deq(0, r0, r1).to(acc_dtype) * p[0]                # (r, n_per_row)
            for k in range(1, self.k):
                acc.add_(self._deq(k, r0, r1).to(acc_dtype) * p[k])
            out[r0:r1] = acc
        return out.reshape(self.shape)

    def dots(self, g: torch.Tensor) -> torch.Tensor:
        """``<deq(Q_k), g>`` for every k, tile by tile: ``dL/dp_k`` when ``g = dL/dW``.

        Args:
            g: tensor of ``shape`` (any float dtype), on the buffers' device.

        Returns:
            ``(K,)`` float32 (float64 if ``g`` is float64); each tile's partial sums are
            accumulated in float32 (float64). On the Triton path the partial sums are per
            program (a few thousand weights each) and summed by torch: equal to the tile
            order's result within float32 rounding.

        Raises:
            ValueError: ``g`` does not have ``shape``, or a bad ``VOODOO_LAZY_KERNEL``
                (compiled path only).
        """
        if tuple(g.shape) != self.shape:
            raise ValueError(f"g has shape {tuple(g.shape)}, the candidates {self.shape}")
        acc_dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
        g2 = g.reshape(self.n_rows, self.n_per_row)
        out = torch.zeros(self.k, dtype=acc_dtype, device=self.device)
        if self._compiled():
            tk = _triton_kernels(self, acc_dtype)
            if tk is not None:
                return tk.dots(g2, [self.blocks(k) for k in range(self.k)], self.types,
                               self.n_per_row)
            warm_tables(self.types, self.device)
            fn = _compiled_fn("dots")
            with torch._dynamo.config.patch(**compile_recompile_limit()):
                for r0, r1 in self._tiles():
                    out += fn(g2[r0:r1], self._tile_blocks(r0, r1), self.types, self.n_per_row,
                              acc_dtype)
            return out
        for r0, r1 in self._tiles():
            gt = g2[r0:r1].to(acc_dtype).reshape(-1)                        # (r * n,)
            for k in range(self.k):
                out[k] += torch.dot(self._deq(k, r0, r1).to(acc_dtype).reshape(-1), gt)
        return out

    def _check_probs(self, probs: torch.Tensor) -> torch.Tensor:
        if probs.shape != (self.k,):
            raise ValueError(f"probs has shape {tuple(probs.shape)}; expected ({self.k},), one "
                             f"per candidate ({', '.join(self.types)})")
        return probs

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedCandidates":
        """The candidates of the sub-tensor ``W.narrow(dim, start, length)``: a tensor-parallel
        rank's shard, holding a copy of only that shard's bytes.

        ``dim`` counts in ``shape`` (GGUF numpy order). Along the last (quantized) dimension,
        ``start`` and ``length`` must be multiples of every candidate type's block size, since
        a block cannot be split. Raises ValueError otherwise or for an out-of-range slice."""
        nd = len(self.shape)
        d = dim % nd
        if start < 0 or length <= 0 or start + length > self.shape[d]:
            raise ValueError(f"narrow({dim}, {start}, {length}) is out of range for shape "
                             f"{self.shape}")
        shape = list(self.shape)
        shape[d] = length
        out = []
        for k, t in enumerate(self.types):
            q = qtype(t)
            b = self.blocks(k).reshape(*self.shape[:-1], -1)        # (..., row_bytes)
            if d == nd - 1:
                if start % q.block_size or length % q.block_size:
                    raise ValueError(
                        f"cannot cut {t} rows at weights {start}..{start + length}: not a "
                        f"multiple of its block size {q.block_size}; shard along another "
                        f"dimension or at block boundaries")
                b = b.narrow(d, start // q.block_size * q.type_size,
                             length // q.block_size * q.type_size)
            else:
                b = b.narrow(d, start, length)
            out.append(b.clone(memory_format=torch.contiguous_format))
        return QuantizedCandidates(out, self.types, shape, self.tile_elements, self.compile)

    def take_rows(self, index) -> "QuantizedCandidates":
        """The candidates with their rows (``shape2d``'s) in the order ``index`` (e.g. GGUF
        rows put back in HF order): a copy of those rows' bytes, shape ``(len(index),
        n_per_row)``. Rows are quantized independently, so this is exact."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.device)
        out = [self.blocks(k).index_select(0, idx) for k in range(self.k)]
        return QuantizedCandidates(out, self.types, (int(idx.numel()), self.n_per_row),
                                   self.tile_elements, self.compile)

    def extra_repr(self) -> str:
        return (f"shape={self.shape}, types={list(self.types)}, "
                f"nbytes={self.nbytes}, tile_rows={self.tile_rows}")


def _mix_tile(p, tiles, types, n_per_row, out_dtype):
    """One row tile of ``sum_k p[k] deq(Q_k)`` (the eager loop's arithmetic, fused)."""
    acc = dequantize(tiles[0], types[0], n_per_row).to(p.dtype) * p[0]
    for k in range(1, len(tiles)):
        acc = acc + dequantize(tiles[k], types[k], n_per_row).to(p.dtype) * p[k]
    return acc.to(out_dtype)


def _dots_tile(g, tiles, types, n_per_row, acc_dtype):
    """One row tile of ``<deq(Q_k), g>`` for every k -> (K,)."""
    g = g.to(acc_dtype)
    return torch.stack([(dequantize(t, ty, n_per_row).to(acc_dtype) * g).sum()
                        for t, ty in zip(tiles, types)])


def _dense_full(blocks, qtype_name, n_per_row, dtype):
    return dequantize(blocks, qtype_name, n_per_row).to(dtype)


_COMPILED: dict[str, object] = {}

#: ``VOODOO_LAZY_KERNEL``: which kernels the compiled (CUDA) path of ``mix``/``dots`` runs:
#: ``triton`` (default; the hand-written kernels of :mod:`voodoo.triton_lazy` where they handle
#: the menu, else Inductor) or ``inductor`` (always the ``torch.compile``'d tiles).
LAZY_KERNEL_ENV = "VOODOO_LAZY_KERNEL"


def lazy_kernel_choice() -> str:
    """``VOODOO_LAZY_KERNEL`` (read at each call, so a benchmark can switch): ``"triton"`` or
    ``"inductor"``. Raises ValueError for anything else."""
    v = os.environ.get(LAZY_KERNEL_ENV, "triton").strip().lower() or "triton"
    if v not in ("triton", "inductor"):
        raise ValueError(f"{LAZY_KERNEL_ENV}={v!r}: expected 'triton' or 'inductor' "
                         f"(unset it for the default, triton)")
    return v


def _triton_kernels(cands: "QuantizedCandidates", acc_dtype: torch.dtype, types=None):
    """:mod:`voodoo.triton_lazy` when it should run this call, else None (-> Inductor): CUDA
    buffers (or CPU ones under ``TRITON_INTERPRET=1``, for tests), float32 accumulation, a
    menu and row length the kernels handle, Triton importable, not switched off."""
    if acc_dtype != torch.float32 or lazy_kernel_choice() != "triton":
        return None
    dev = cands.device.type
    if not (dev == "cuda" or (dev == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")):
        return None
    try:
        from . import triton_lazy
    except Exception:  # noqa: BLE001 - any import failure: fall back
        return None
    types = cands.types if types is None else types
    return triton_lazy if triton_lazy.supports(types, cands.n_per_row) else None


def _compiled_fn(kind: str):
    fn = _COMPILED.get(kind)
    if fn is None:
        fn = torch.compile({"mix": _mix_tile, "dots": _dots_tile, "dense": _dense_full}[kind],
                           dynamic=False,
                           options=exact_compile_options())
        _COMPILED[kind] = fn
    return fn


class LazyMix(torch.autograd.Function):
    """``W = sum_k p_k deq(Q_k)`` with ``dL/dp_k = <dL/dW, deq(Q_k)>``; no gradient to the bytes.

    ``LazyMix.apply(cands, probs, dtype)``: ``probs`` ``(K,)`` float32/float64 -> ``W`` of
    ``cands.shape`` and ``dtype``. Nothing but ``probs`` is saved for the backward: the
    dequantized candidates are recomputed tile by tile there."""

    @staticmethod
    def forward(ctx, cands: QuantizedCandidates, probs: torch.Tensor, dtype: torch.dtype):
        ctx.cands = cands
        ctx.probs_dtype = probs.dtype
        return cands.mix(probs, dtype)

    @staticmethod
    def backward(ctx, grad_w: torch.Tensor):
        return None, ctx.cands.dots(grad_w).to(ctx.probs_dtype), None


def lazy_mix(cands: QuantizedCandidates, probs: torch.Tensor,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Differentiable :meth:`QuantizedCandidates.mix` (see :class:`LazyMix`)."""
    return LazyMix.apply(cands, probs, dtype)


# ------------------------------------------------------------ frozen quantized weights
class QuantizedParams(torch.nn.Module):
    """Frozen HF parameters held as ggml bytes and dequantized on the fly, one module call at a
    time: the ``--teacher_quant Q8_0`` teacher with ``--lazy``.

    Every HF parameter that a GGUF tensor of ``tmap`` reads stops being a Parameter. Each module
    that owns one gets a forward pre-hook that rebuilds it from the bytes (:meth:`
    QuantizedCandidates.dense` of a K = 1 store: libggml's ``to_float`` bits, then the tensor
    map's inverse placement, :func:`voodoo.gates.assemble_param`, in the parameter's dtype) and
    a forward hook that drops it again, so at most one module's dequantized weights exist at a
    time (a tied embedding is rebuilt for each of its two modules). Between calls the attribute
    is a one-element tensor expanded to the parameter's shape (shape, dtype and device queries
    still work). The values are exactly those :func:`voodoo.gates.write_gguf_into_params`
    writes from the same bytes dequantized by libggml (the dense Q8_0 teacher).

    No gradient reaches the bytes (the weights are rebuilt under ``no_grad``): for a teacher
    run under ``no_grad``, not for a Fisher pass that needs weight gradients. The modules must
    read their weights inside their own ``forward`` (true of ``nn.Linear``/``nn.Embedding``
    and of transformers' fused expert modules).

    Attach with ``model.voodoo_quantized = QuantizedParams(model, tmap, stores)`` so that
    ``model.to(device)`` moves the bytes. ``stores``: gguf_name -> a K = 1
    :class:`QuantizedCandidates` of the tensor's 2-D shape. ``nbytes``: bytes held.
    """

    def __init__(self, model: torch.nn.Module, tmap, stores):
        super().__init__()
        from .gates import _key, param_links
        self.stores = torch.nn.ModuleDict({_key(n): s for n, s in stores.items()})
        self.base = torch.nn.Module()
        self._entries: list[list] = []  # [pname, shape, transpose, dtype, links, full, simple]
        self._by_module: dict[int, tuple[torch.nn.Module, list[tuple[str, int]]]] = {}
        for pname, p, own, t, view, links, full, simple in param_links(
                model, tmap, stores, "quantized bytes"):
            if not full:
                self.base.register_buffer(_key(pname), view.clone(), persistent=False)
            i = len(self._entries)
            self._entries.append([pname, tuple(p.shape), t, p.dtype,
                                  [(e.gguf_name, lk) for e, lk in links], full, simple])
            for mod, attr in own:
                del mod._parameters[attr]
                setattr(mod, attr, self._placeholder(i, p.device))
                self._by_module.setdefault(id(mod), (mod, []))[1].append((attr, i))
        self._hooks = []
        for mod, _ in self._by_module.values():
            self._hooks.append(mod.register_forward_pre_hook(self._load))
            self._hooks.append(mod.register_forward_hook(self._drop))

    @property
    def nbytes(self) -> int:
        """Bytes of ggml data held."""
        return sum(s.nbytes for s in self.stores.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.stores.values())).device

    def _placeholder(self, i: int, device) -> torch.Tensor:
        _, shape, _, dtype, *_ = self._entries[i]
        return torch.zeros((), dtype=dtype, device=device).expand(shape)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) / .half(): the rebuilt weights follow (the bytes stay uint8)
        super()._apply(fn, recurse)
        for e in self._entries:
            e[3] = fn(torch.empty(0, dtype=e[3])).dtype
        return self

    @torch.no_grad()
    def weight(self, i: int, device=None) -> torch.Tensor:
        """Entry ``i``'s HF parameter rebuilt from the bytes (on ``device``, default the
        bytes')."""
        from .gates import _key, assemble_param
        pname, shape, t, dtype, links, full, simple = self._entries[i]
        dev = self.device

        def get(g):
            st = self.stores[_key(g)]
            return st.dense(0, dtype if simple else torch.float32).reshape(st.shape2d)

        base = None if full else getattr(self.base, _key(pname))
        w = assemble_param(shape, t, links, get, base, dtype, dev, simple)
        return w if device is None else w.to(device)

    def _load(self, module, args):
        dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        for attr, i in self._by_module[id(module)][1]:
            setattr(module, attr, self.weight(i, dev))

    def _drop(self, module, args, output):
        for attr, i in self._by_module[id(module)][1]:
            setattr(module, attr, self._placeholder(i, getattr(module, attr).device))

    def dense_params(self) -> dict[str, torch.Tensor]:
        """HF parameter name -> its rebuilt tensor (all at once: for checks, not training)."""
        return {e[0]: self.weight(i) for i, e in enumerate(self._entries)}


# ------------------------------------------------------------------ memory prediction
def predict_memory(shapes, menus, *, n_params: int, n_layers: int, hidden: int,
                   intermediate: int, vocab: int, tokens: int, lazy: bool,
                   dtype: torch.dtype = torch.bfloat16, teacher_quant: str = "BF16",
                   checkpointing: bool = False, chunked_loss: bool = True) -> dict[str, int]:
    """Device bytes a gate-training step needs, predicted before anything is loaded.

    Args:
        shapes: gguf_name -> ``(n_rows, n_per_row)`` of every selectable tensor.
        menus: gguf_name -> its K ggml type names.
        n_params: the model's parameter count; n_layers, hidden, intermediate, vocab: its
            decoder's sizes; tokens: tokens a step (batch x seq_len).
        lazy: candidates as ggml bytes (``--lazy``) or dense ``dtype`` tensors (eager).
        dtype: the student's (and eager candidates') dtype.
        teacher_quant: ``"BF16"``/``"F32"`` (a dense copy) or ``"Q8_0"`` (8.5 bits a weight).
        checkpointing: per-decoder-layer gradient checkpointing.
        chunked_loss: the distillation loss is computed chunk by chunk when the logits exceed
            :data:`voodoo.train.DISTILL_CHUNK_ELEMENTS` (as :func:`voodoo.train.distill_losses`
            does since 2026-12-01; False: the whole-tensor float32 loss measured before).

    Returns:
        bytes by part: ``candidates`` (exact: llama.cpp's row sizes lazily, K x elements x
        itemsize eagerly), ``student`` (the mixed weights, one dtype copy), ``teacher``,
        ``activations`` (estimate), ``logits`` (estimate: 28 bytes a logit for the student's
        and teacher's logits and the distillation loss's float32 temporaries), ``total``.

    The activation estimate is ``tokens x itemsize x (8 hidden + 5 intermediate)`` a layer kept
    for the backward (a Llama-style layer under SDPA attention), or with checkpointing
    ``tokens x hidden x itemsize`` a layer plus one layer in full. Calibrated on an H200
    (``benchmarks/results/lazy_student/``, K = 6, 8192 tokens, bf16), whole steps with the
    chunked distillation loss and a lazy student mixing per module: 3.2B shape predicted
    82.8 GiB eager / 59.1 lazy, measured 82.1 / 58.6; 14B shape checkpointed, lazy, Q8_0
    teacher: predicted 106.3, measured 106.6. (Before the chunked loss, ``chunked_loss=False``:
    3.2B 103.3 / 79.6 predicted, 104.8 / 81.3 measured; 14B with a bf16 teacher 143, out of
    the H200's 139.8.) Estimates, not bounds: allocator slack and the backward's temporaries
    come on top."""
    from .quants import tensor_nbytes
    isz = dtype.itemsize
    if lazy:
        cand = sum(tensor_nbytes(t, r, c) for n, (r, c) in shapes.items() for t in menus[n])
    else:
        cand = sum(len(menus[n]) * r * c * isz for n, (r, c) in shapes.items())
    student = n_params * isz
    teacher = {"BF16": 2 * n_params, "F32": 4 * n_params,
               "Q8_0": n_params * 34 // 32}[teacher_quant.upper()]
    layer_full = tokens * isz * (8 * hidden + 5 * intermediate)
    act = (n_layers * tokens * hidden * isz + layer_full) if checkpointing \
        else n_layers * layer_full
    # bf16 (float32 on CPUs) student and teacher logits; float32 log-softmaxes of both, the
    # teacher's probabilities, the KL/CE terms and the gradient back to the logits
    logits = tokens * vocab * (isz + isz + 6 * 4)
    from .train import DISTILL_CHUNK_ELEMENTS
    if chunked_loss and tokens * vocab > DISTILL_CHUNK_ELEMENTS:
        # bf16 student and teacher logits and the logits' gradient, and about two float32
        # copies of one chunk (H200: 6.2 GiB at 8192 x 128256 measured, 6.9 predicted)
        logits = tokens * vocab * (isz + isz + 2) + 2 * 4 * DISTILL_CHUNK_ELEMENTS
    out = {"candidates": int(cand), "student": int(student), "teacher": int(teacher),
           "activations": int(act), "logits": int(logits)}
    out["total"] = sum(out.values())
    return out


def format_memory(pred: dict[str, int], measured_peak: int | None = None) -> str:
    """One line of :func:`predict_memory`'s parts in GiB (and the measured peak if given)."""
    gib = 2 ** 30
    s = ", ".join(f"{k} {v / gib:.1f}" for k, v in pred.items() if k != "total")
    line = f"predicted device memory: {pred['total'] / gib:.1f} GiB ({s})"
    if measured_peak is not None:
        line += f"; measured peak {measured_peak / gib:.1f} GiB"
    return line


def host_memory_capacity() -> int | None:
    """Bytes a CPU run may use: the kernel's ``MemAvailable`` (``/proc/meminfo``), or less
    where a memory cgroup (a container, a Slurm job, ``systemd-run -p MemoryMax=``) leaves
    less room (:func:`cgroup_headroom`), plus what this process holds already (its resident
    set: the loaded model the student is built from). None where that cannot be read (not
    Linux)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable:"))
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    room = cgroup_headroom()
    return min(avail, room if room is not None else avail) + rss


def cgroup_headroom(proc_cgroup: str = "/proc/self/cgroup",
                    root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroups still allow: the smallest ``limit - usage`` over
    its cgroup and the cgroups above it (v2: ``memory.max``/``memory.current``; v1:
    ``memory.limit_in_bytes``/``memory.usage_in_bytes``). None when no limit is set or the
    files cannot be read."""
    from pathlib import Path
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    places = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, path = parts
        if ctrls == "":   # v2
            for base in (Path(root), Path(root) / "unified"):
                places.append((base, path, "memory.max", "memory.current"))
        elif "memory" in ctrls.split(","):   # v1
            places.append((Path(root) / "memory", path, "memory.limit_in_bytes",
                           "memory.usage_in_bytes"))
    best = None
    for base, path, lim_name, use_name in places:
        p = Path(path.lstrip("/"))
        for q in (p, *p.parents):
            d = base / q
            try:
                lim = d.joinpath(lim_name).read_text().strip()
                use = int(d.joinpath(use_name).read_text().strip())
            except (OSError, ValueError):
                continue
            if lim == "max" or not lim.isdigit() or int(lim) >= 1 << 60:
                continue
            room = max(0, int(lim) - use)
            best = room if best is None else min(best, room)
    return best


class MemoryPlanError(ValueError):
    """The run cannot fit the device with any single-device setting (raised before loading)."""


#: Flag sets tried, cheapest first, when the run as asked does not fit (what ``plan_memory``
#: suggests): each entry is (flags, lazy, checkpointing, lazy Q8_0 teacher).
_FIXES = (
    (("--lazy",), True, False, False),
    (("--gradient_checkpointing",), False, True, False),
    (("--lazy", "--gradient_checkpointing"), True, True, False),
    (("--lazy", "--teacher_quant Q8_0"), True, False, True),
    (("--lazy", "--gradient_checkpointing", "--teacher_quant Q8_0"), True, True, True),
)


def plan_memory(predict, capacity: int, *, lazy: bool, checkpointing: bool,
                q8_teacher: bool, auto_lazy: bool = True, where: str = "the device",
                split: str | None = None) -> tuple[bool, dict[str, int], str | None]:
    """Decides, before anything is loaded, whether a gate-training run fits ``capacity`` bytes.

    Args:
        predict: ``predict(lazy, checkpointing, q8_teacher) -> dict`` (:func:`predict_memory`
            for the run with those settings; ``q8_teacher``: the teacher held as Q8_0 bytes,
            which only ``--lazy`` does).
        capacity: bytes free on the device (e.g. ``torch.cuda.mem_get_info()[0]``; any number
            in tests).
        lazy, checkpointing, q8_teacher: the run as asked.
        auto_lazy: switch to ``--lazy`` when the eager candidates do not fit and lazy ones do.
        where: the device, for the messages.
        split: what else to do when nothing fits (default: split the model over GPUs).

    Returns:
        ``(lazy, prediction, note)``: the ``lazy`` to use, its prediction, and a one-line note
        when ``--lazy`` was chosen automatically (else None).

    Raises:
        MemoryPlanError: nothing fits as asked (nor with ``--lazy`` alone when ``auto_lazy``);
        the message names the predicted size, the capacity and the flags that would fit, or,
        when no single-device setting fits, ``--device_map`` and ``voodoo tp``.
    """
    gib = 2 ** 30
    pred = predict(lazy, checkpointing, q8_teacher)
    if pred["total"] <= capacity:
        return lazy, pred, None
    if not lazy and auto_lazy:
        pl = predict(True, checkpointing, q8_teacher)
        if pl["total"] <= capacity:
            return True, pl, (f"note: the eager candidates would need {pred['total'] / gib:.1f}"
                              f" GiB but {where} has {capacity / gib:.1f} GiB free; using "
                              f"--lazy (candidates as ggml bytes, {pl['total'] / gib:.1f} GiB)")
    fits = []
    for flags, lz, ck, q8 in _FIXES:
        lz, ck, q8 = lz or lazy, ck or checkpointing, q8 or q8_teacher
        if (lz, ck, q8) == (lazy, checkpointing, q8_teacher):
            continue
        p = predict(lz, ck, q8)
        if p["total"] <= capacity:
            need = [f for f in flags if not ((f == "--lazy" and lazy) or
                                             (f == "--gradient_checkpointing" and checkpointing)
                                             or (f.startswith("--teacher") and q8_teacher))]
            fits.append(f"{' '.join(need)} ({p['total'] / gib:.1f} GiB)")
            break
    split = split or ("or split the model over several GPUs: --device_map cuda:0,cuda:1 "
                      "(layer-wise, --ray) or `voodoo tp` (tensor parallel)")
    msg = (f"this run is predicted to need {pred['total'] / gib:.1f} GiB on {where} "
           f"({', '.join(f'{k} {v / gib:.1f}' for k, v in pred.items() if k != 'total')}) "
           f"but {capacity / gib:.1f} GiB are free; ")
    if fits:
        msg += f"it would fit with {fits[0]}, {split}"
    else:
        best = predict(True, True, True)
        msg += (f"even --lazy --gradient_checkpointing --teacher_quant Q8_0 needs "
                f"{best['total'] / gib:.1f} GiB: {split}, or fewer tokens a step "
                f"(--seq_len/--batch_size)")
    raise MemoryPlanError(msg)
