"""GPU kernels for the gate mixture (Triton), with pure-PyTorch fallbacks.

The two memory-bound operations of a gated Linear on a GPU:

* ``mix(probs, cand)``: ``W = sum_k p_k cand[k]`` -- reads the K candidates once, writes W;
* ``dots(cand, g)``: ``<cand[k], g>`` for every k -- reads the K candidates and ``g`` once.

Both accumulate in float32. cuBLAS runs ``probs @ cand`` at about 1.1 TB/s on an H200 and the
GEMV form of ``dots`` at 0.3-2 TB/s (it is slow for very wide matrices such as a 128k-vocab
head); these kernels stream at close to the card's bandwidth. Used for bf16/fp16 candidates on
CUDA when Triton is importable; everything else goes through PyTorch.
"""

from __future__ import annotations

import torch

try:  # pragma: no cover - only on GPU machines
    import triton
    import triton.language as tl
    _HAVE_TRITON = True
except Exception:  # noqa: BLE001
    _HAVE_TRITON = False

__all__ = ["available", "mix", "dots"]

_BLOCK = 4096


def available(t: torch.Tensor) -> bool:
    """Whether the Triton path applies to candidates ``t``."""
    return _HAVE_TRITON and t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and \
        t.is_contiguous()


if _HAVE_TRITON:  # pragma: no cover
    @triton.jit
    def _mix_kernel(cand_ptr, p_ptr, out_ptr, n, K: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < n
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in tl.static_range(K):
            pk = tl.load(p_ptr + k)
            x = tl.load(cand_ptr + k * n + offs, mask=mask, other=0.0)
            acc += pk * x.to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dots_kernel(cand_ptr, g_ptr, out_ptr, n, K: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        for k in tl.static_range(K):
            x = tl.load(cand_ptr + k * n + offs, mask=mask, other=0.0)
            tl.atomic_add(out_ptr + k, tl.sum(x.to(tl.float32) * g, axis=0))


def mix(probs: torch.Tensor, cand: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``sum_k probs[k] * cand[k]``: probs (K,), cand (K, R, C) -> (R, C) in ``out_dtype``,
    float32 accumulation."""
    k, r, c = cand.shape
    if not available(cand):
        w = probs.to(cand.dtype).unsqueeze(0) @ cand.reshape(k, r * c)
        return w.reshape(r, c).to(out_dtype)
    out = torch.empty((r, c), dtype=out_dtype, device=cand.device)
    n = r * c
    # Triton launches on the current device: pin it to the candidates' (layer-wise sharding
    # puts layers on several GPUs)
    with torch.cuda.device(cand.device):
        _mix_kernel[(triton.cdiv(n, _BLOCK),)](cand, probs.to(cand.device).float().contiguous(),
                                               out, n, K=k, BLOCK=_BLOCK, num_warps=8)
    return out


def dots(cand: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``<cand[k], g>`` for each k: cand (K, R, C), g (R, C) -> (K,) float32."""
    k = cand.shape[0]
    if not available(cand):
        # batched over rows: (R, K, C) @ (R, C, 1); far faster than one wide GEMV on GPUs
        return torch.bmm(cand.permute(1, 0, 2), g.to(cand.dtype).unsqueeze(-1)).sum(0) \
            .reshape(k).float()
    out = torch.zeros(k, dtype=torch.float32, device=cand.device)
    n = g.numel()
    with torch.cuda.device(cand.device):
        _dots_kernel[(triton.cdiv(n, _BLOCK),)](cand, g.to(cand.device).contiguous(), out, n,
                                                K=k, BLOCK=_BLOCK, num_warps=8)
    return out
