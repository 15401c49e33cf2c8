"""ggml dequantization in PyTorch, bit-identical to libggml's ``to_float``, on any device.

:func:`dequantize` turns the raw bytes of a GGUF tensor (rows x row bytes, ``uint8``) into its
float32 weights with the same arithmetic as ``dequantize_row_*`` in llama.cpp's
``ggml/src/ggml-quants.c`` (pinned commit, see :mod:`voodoo.llamacpp`): the fp16 scales are
widened exactly, every product and sum is one float32 operation in the C code's order
(``d * sc * q`` is ``(d * sc) * q``; ``q * d + m`` is a product, rounded, then a sum), and no
multiply-add is fused. PyTorch runs each elementwise operation as its own kernel on the CPU and
on CUDA, so nothing is contracted into an FMA and the result is the same bits on both; the
libggml-base that :mod:`cython_ggml` loads is built for baseline x86-64 (SSE2, no FMA), which
is what the tests compare against bit for bit.

The lookup tables of the i-quants (``iq2xxs_grid``, ``iq1s_grid``, ``ksigns_iq2xs``,
``kvalues_iq4nl`` ...) come from gguf-py's ``gguf.quants`` (llama.cpp's own Python codecs),
never typed in here. Block sizes and bytes per block come from :mod:`voodoo.quants`.

Every type is one vectorised function over all blocks at once ``(n_blocks, type_size) uint8 ->
(n_blocks, block_size) float32``; there is no loop over blocks, and the same code serves the
CPU and CUDA, eagerly or under ``torch.compile`` with :func:`exact_compile_options` (Inductor
then fuses a type into one or a few Triton kernels; without those options Triton contracts
``a*b + c`` into an FMA and the last bit of Q4_1/Q5_1/Q2_K/Q4_K/Q5_K weights can change).
Verified bit for bit against libggml on the CPU (tests/test_dequant.py) and on an H200, eager
and compiled (``benchmarks/lazy_candidates.py check``).
"""

from __future__ import annotations

from typing import Callable

import torch
from gguf import quants as _gq

from .quants import qtype as _qtype

__all__ = ["dequantize", "SUPPORTED_TYPES", "dequantize_blocks"]

QK_K = 256

# ------------------------------------------------------------------------------ tables
_TABLE_CACHE: dict[tuple[str, str], torch.Tensor] = {}


def _grid_numpy(cls) -> "object":
    cls.init_grid()
    return cls.grid.reshape(cls.grid_shape)  # (n_entries, width) float32, integer values


def _table(name: str, device: torch.device) -> torch.Tensor:
    """A lookup table of ggml-quants.c as a float32 tensor on ``device`` (cached).

    ``iq2xxs_grid`` (256, 8), ``iq2xs_grid`` (512, 8), ``iq2s_grid`` (1024, 8),
    ``iq3xxs_grid`` (256, 4), ``iq3s_grid`` (512, 4), ``iq1s_grid`` (2048, 8) with values
    -1/0/1, ``kvalues_iq4nl`` (16,); and as int32 sign-bit masks (bit j set -> 0x80000000,
    else 0) ``ksigns`` (128, 8) from ``ksigns_iq2xs`` and ``bitsigns`` (256, 8) for a raw
    sign byte."""
    key = (name, str(device))
    t = _TABLE_CACHE.get(key)
    if t is None:
        import numpy as np
        if name == "ksigns":
            ks = np.frombuffer(_gq.IQ2_XXS.ksigns, dtype=np.uint8)
            bits = (ks[:, None] >> np.arange(8, dtype=np.uint8)[None, :]) & 1
            arr = np.where(bits == 1, np.int32(-2**31), np.int32(0))
        elif name == "bitsigns":  # any byte -> 8 sign multipliers (IQ2_S, IQ3_S: signs stored raw)
            b = np.arange(256, dtype=np.uint16).astype(np.uint8)
            bits = (b[:, None] >> np.arange(8, dtype=np.uint8)[None, :]) & 1
            arr = np.where(bits == 1, np.int32(-2**31), np.int32(0))
        elif name == "kvalues_iq4nl":
            arr = np.array(_gq.IQ4_NL.kvalues, dtype=np.float32)
        elif name == "kvalues_mxfp4":   # E2M1 values doubled (ggml-common.h kvalues_mxfp4)
            arr = np.array(_gq.MXFP4.kvalues, dtype=np.float32)
        else:
            cls = {"iq2xxs_grid": _gq.IQ2_XXS, "iq2xs_grid": _gq.IQ2_XS, "iq2s_grid": _gq.IQ2_S,
                   "iq3xxs_grid": _gq.IQ3_XXS, "iq3s_grid": _gq.IQ3_S,
                   "iq1s_grid": _gq.IQ1_S}[name]
            arr = _grid_numpy(cls)
        if arr.dtype != np.int32:
            arr = arr.astype(np.float32)
        t = torch.from_numpy(np.ascontiguousarray(arr)).to(device)
        _TABLE_CACHE[key] = t
    return t


#: ``IQ1S_DELTA`` / ``IQ1M_DELTA`` of ``ggml-common.h`` (both 0.125f), as gguf-py has it.
_IQ1_DELTA = float(_gq.IQ1_S.delta)


# ----------------------------------------------------------------------------- helpers
def _f16(b: torch.Tensor, off: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The little-endian fp16 (or bf16) at byte ``off`` of each block, widened exactly ->
    (nb, 1) f32. Built from the two bytes with integer ops and a same-size bitcast, so that
    ``torch.compile`` can fuse it."""
    return _u16(b, off, 1).to(torch.int16).view(dtype).to(torch.float32)


def _u16(b: torch.Tensor, off: int, n: int) -> torch.Tensor:
    """``n`` little-endian uint16 starting at byte ``off`` -> (nb, n) int32."""
    lo = b[:, off:off + 2 * n:2].to(torch.int32)
    hi = b[:, off + 1:off + 2 * n:2].to(torch.int32)
    return lo | (hi << 8)


def _u32(b: torch.Tensor, off: int, n: int) -> torch.Tensor:
    """``n`` little-endian uint32 starting at byte ``off`` -> (nb, n) int64."""
    w = b[:, off:off + 4 * n].reshape(b.shape[0], n, 4).to(torch.int64)
    return w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)


def _shifts(values, device, dtype=torch.uint8) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _signed(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``y * (sign ? -1.f : 1.f)`` as gcc compiles it: the sign bit flipped (XOR with ``mask``,
    int32 0 or 0x80000000). Equal to the product for every non-NaN ``y``; a NaN's sign flips too,
    as in libggml."""
    return (y.view(torch.int32) ^ mask).view(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(nb, ..., 16) bytes -> (nb, ..., 32): low nibbles then high nibbles (ggml's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_scale_min_k4`` for j = 0..7 of the 12 packed bytes -> (nb, 8) scales, mins (uint8)."""
    lo_d = sc[:, 0:4] & 63
    lo_m = sc[:, 4:8] & 63
    hi_d = (sc[:, 8:12] & 0x0F) | ((sc[:, 0:4] >> 6) << 4)
    hi_m = (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    return torch.cat([lo_d, hi_d], 1), torch.cat([lo_m, hi_m], 1)


# ------------------------------------------------------------------------- the types
# _NAN_ORDER: ``a*b + c`` is written ``c + a*b`` (the same IEEE sum for every input). When both
# terms are NaN, x86's addss returns the first operand's NaN (libggml: the product's) and
# PyTorch's CPU add its second argument's, so this order also gives libggml's NaN payloads.
# ``a*b - c`` with both terms NaN may still carry the other NaN's payload; NaN scales never
# occur in quantized weights, and on CUDA every NaN result is the canonical NaN anyway.
# Each function: b (nb, type_size) uint8 -> (nb, block_size) float32. Comments quote the C line
# it reproduces (dequantize_row_* in ggml-quants.c).

def _q8_0(b):
    d = _f16(b, 0)                                                  # (nb, 1)
    q = b[:, 2:34].view(torch.int8).to(torch.float32)               # (nb, 32)
    return q * d                                                    # x[i].qs[j]*d


def _q4_0(b):
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:18]).to(torch.int8) - 8                     # (nb, 32)
    return q.to(torch.float32) * d                                  # x0*d


def _q4_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:20]).to(torch.float32)
    return m + q * d                  # x0*d + m: product rounded, then sum (no FMA); see _NAN_ORDER


def _q5_bits(qh: torch.Tensor) -> torch.Tensor:
    """The 32 high bits of a Q5_0/Q5_1 block (uint32 ``qh``) in element order -> (nb, 32) uint8."""
    sh = torch.arange(32, device=qh.device, dtype=torch.int64)
    return ((qh >> sh) & 1).to(torch.uint8) << 4                    # bit j -> element j


def _q5_0(b):
    d = _f16(b, 0)
    hi = _q5_bits(_u32(b, 2, 1))
    q = (_nibbles(b[:, 6:22]) | hi).to(torch.int8) - 16
    return q.to(torch.float32) * d                                  # x0*d


def _q5_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    hi = _q5_bits(_u32(b, 4, 1))
    q = (_nibbles(b[:, 8:24]) | hi).to(torch.float32)
    return m + q * d                                                # x0*d + m


def _q2_k(b):
    nb = b.shape[0]
    sc = b[:, 0:16]                                                 # 16 sub-blocks of 16
    qs = b[:, 16:80].reshape(nb, 2, 1, 32)
    d, dmin = _f16(b, 80), _f16(b, 82)
    q = (qs >> _shifts([0, 2, 4, 6], b.device).reshape(1, 1, 4, 1)) & 3  # (nb, 2, 4, 32)
    q = q.reshape(nb, 16, 16).to(torch.float32)
    dl = d * (sc & 0x0F).to(torch.float32)                          # dl = d * (sc & 0xF)
    ml = dmin * (sc >> 4).to(torch.float32)                         # ml = min * (sc >> 4)
    return (dl.unsqueeze(-1) * q - ml.unsqueeze(-1)).reshape(nb, QK_K)   # dl * q - ml


def _q3_k(b):
    nb = b.shape[0]
    hm = b[:, 0:32].reshape(nb, 1, 1, 2, 16)
    qs = b[:, 32:96].reshape(nb, 2, 1, 2, 16)
    s = b[:, 96:108]
    d_all = _f16(b, 108)
    # the 16 6-bit scales (the aux[] shuffle): low/high nibbles of bytes 0..7, 2 bits of 8..11
    lo = torch.cat([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], 1)           # (nb, 16)
    top = s[:, 8:12]
    hb = torch.cat([(top >> 0) & 3, (top >> 2) & 3, (top >> 4) & 3, (top >> 6) & 3], 1)
    scales = (lo | (hb << 4)).to(torch.int8) - 32                   # (nb, 16)
    dl = d_all * scales.to(torch.float32)                           # d_all * (scales[is] - 32)
    j = _shifts([0, 2, 4, 6], b.device).reshape(1, 1, 4, 1, 1)
    q = ((qs >> j) & 3).to(torch.int8)                              # (nb, 2, 4, 2, 16)
    mbit = _shifts([0, 1, 2, 3, 4, 5, 6, 7], b.device).reshape(1, 2, 4, 1, 1)
    h = (hm >> mbit) & 1                                            # hm[l] & m
    q = q - (1 - h.to(torch.int8)) * 4                              # - (hm & m ? 0 : 4)
    q = q.reshape(nb, 16, 16).to(torch.float32)
    return (dl.unsqueeze(-1) * q).reshape(nb, QK_K)                 # dl * q


def _k_scales(b, off):
    sc, m = _scale_min_k4(b[:, off:off + 12])
    d, dmin = _f16(b, 0), _f16(b, 2)
    d1 = d * sc.to(torch.float32)                                   # d1 = d * sc
    m1 = dmin * m.to(torch.float32)                                 # m1 = min * m
    return d1.unsqueeze(-1), m1.unsqueeze(-1)                       # (nb, 8, 1)


def _q4_k(b):
    nb = b.shape[0]
    d1, m1 = _k_scales(b, 4)
    qs = b[:, 16:144].reshape(nb, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], 2).reshape(nb, 8, 32).to(torch.float32)
    return (d1 * q - m1).reshape(nb, QK_K)                          # d1 * q - m1


def _q5_k(b):
    nb = b.shape[0]
    d1, m1 = _k_scales(b, 4)
    qh = b[:, 16:48].reshape(nb, 1, 32)
    ql = b[:, 48:176].reshape(nb, 4, 1, 32)
    q = torch.cat([ql & 0x0F, ql >> 4], 2).reshape(nb, 8, 32)
    hbit = (qh >> _shifts(list(range(8)), b.device).reshape(1, 8, 1)) & 1  # qh[l] & u ? 16 : 0
    q = (q | (hbit << 4)).to(torch.float32)
    return (d1 * q - m1).reshape(nb, QK_K)                          # d1 * q - m1


def _q6_k(b):
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 2, 32)                          # [n][half][l]
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    sc = b[:, 192:208].view(torch.int8).to(torch.float32)           # (nb, 16)
    d = _f16(b, 208)
    lo = torch.cat([ql & 0x0F, ql >> 4], 2)                         # (nb, 2, 4, 32): q1,q2,q3,q4
    sh = _shifts([0, 2, 4, 6], b.device).reshape(1, 1, 4, 1)
    hi = (qh >> sh) & 3                                             # (nb, 2, 4, 32)
    q = (lo | (hi << 4)).to(torch.int8) - 32
    q = q.reshape(nb, 16, 16).to(torch.float32)                     # element e -> scale e // 16
    ds = d * sc                                                     # d * sc[is]
    return (ds.unsqueeze(-1) * q).reshape(nb, QK_K)                 # (d * sc) * q


def _iq2_xxs(b):
    nb = b.shape[0]
    dev = b.device
    d = _f16(b, 0)
    w = _u32(b, 2, 16).reshape(nb, 8, 2)                            # aux32[0], aux32[1] per 32
    idx = b[:, 2:66].reshape(nb, 8, 8)[:, :, 0:4].to(torch.int64)   # aux8[l] = bytes of aux32[0]
    s = (w[..., 1] >> 28).to(torch.float32)                         # (nb, 8)
    db = d * (0.5 + s) * 0.25                                       # d * (0.5f + s) * 0.25f
    sidx = (w[..., 1:2] >> _shifts([0, 7, 14, 21], dev, torch.int64)) & 127  # (nb, 8, 4)
    grid = _table("iq2xxs_grid", dev)[idx]                          # (nb, 8, 4, 8)
    sign = _table("ksigns", dev)[sidx]                              # (nb, 8, 4, 8)
    y = _signed(db.reshape(nb, 8, 1, 1) * grid, sign)              # db * grid[j] * (+-1)
    return y.reshape(nb, QK_K)


def _iq2_xs(b):
    nb = b.shape[0]
    dev = b.device
    d = _f16(b, 0)
    qs = _u16(b, 2, 32).reshape(nb, 8, 4)
    sc = b[:, 66:74]
    s = torch.stack([sc & 0x0F, sc >> 4], -1).to(torch.float32)     # (nb, 8, 2)
    db = d.unsqueeze(-1) * (0.5 + s) * 0.25                         # d * (0.5f + s) * 0.25f
    db = db.repeat_interleave(2, dim=2)                             # l -> db[l/2]  (nb, 8, 4)
    grid = _table("iq2xs_grid", dev)[(qs & 511).to(torch.int64)]
    sign = _table("ksigns", dev)[(qs >> 9).to(torch.int64)]
    return _signed(db.unsqueeze(-1) * grid, sign).reshape(nb, QK_K)


def _iq2_s(b):
    nb = b.shape[0]
    dev = b.device
    d = _f16(b, 0)
    qs = b[:, 2:34].reshape(nb, 8, 4).to(torch.int64)
    signs = b[:, 34:66].reshape(nb, 8, 4).to(torch.int64)
    qh = b[:, 66:74].to(torch.int64).reshape(nb, 8, 1)
    sc = b[:, 74:82]
    hi = (qh >> _shifts([0, 2, 4, 6], dev, torch.int64)) & 3        # (qh << (8-2l)) & 0x300
    idx = qs | (hi << 8)
    s = torch.stack([sc & 0x0F, sc >> 4], -1).to(torch.float32)
    db = (d.unsqueeze(-1) * (0.5 + s) * 0.25).repeat_interleave(2, dim=2)
    grid = _table("iq2s_grid", dev)[idx]
    sign = _table("bitsigns", dev)[signs]
    return _signed(db.unsqueeze(-1) * grid, sign).reshape(nb, QK_K)


def _iq3_xxs(b):
    nb = b.shape[0]
    dev = b.device
    d = _f16(b, 0)
    qs = b[:, 2:66].reshape(nb, 8, 8).to(torch.int64)               # 8 grid indices per 32
    aux = _u32(b, 66, 8)                                            # (nb, 8)
    db = d * (0.5 + (aux >> 28).to(torch.float32)) * 0.5            # d * (0.5f + s) * 0.5f
    sidx = (aux.unsqueeze(-1) >> _shifts([0, 7, 14, 21], dev, torch.int64)) & 127  # (nb, 8, 4)
    grid = _table("iq3xxs_grid", dev)[qs].reshape(nb, 8, 4, 8)      # grid1 | grid2 per l
    sign = _table("ksigns", dev)[sidx]
    return _signed(db.reshape(nb, 8, 1, 1) * grid, sign).reshape(nb, QK_K)


def _iq3_s(b):
    nb = b.shape[0]
    dev = b.device
    d = _f16(b, 0)
    qs = b[:, 2:66].reshape(nb, 8, 8).to(torch.int64)
    qh = b[:, 66:74].to(torch.int64).reshape(nb, 8, 1)
    signs = b[:, 74:106].reshape(nb, 8, 4).to(torch.int64)
    sc = b[:, 106:110]
    hbit = (qh >> torch.arange(8, device=dev, dtype=torch.int64)) & 1   # bit k of qh[ib32]
    idx = qs | (hbit << 8)
    s = torch.stack([sc & 0x0F, sc >> 4], -1).reshape(nb, 8).to(torch.int32)
    db = d * (1 + 2 * s).to(torch.float32)                          # d * (1 + 2*(sc & 0xf))
    grid = _table("iq3s_grid", dev)[idx].reshape(nb, 8, 4, 8)
    sign = _table("bitsigns", dev)[signs]
    return _signed(db.reshape(nb, 8, 1, 1) * grid, sign).reshape(nb, QK_K)


def _iq1_s(b):
    nb = b.shape[0]
    dev = b.device
    d = _f16(b, 0)
    qs = b[:, 2:34].reshape(nb, 8, 4).to(torch.int64)
    qh = _u16(b, 34, 8).to(torch.int64)                             # (nb, 8)
    dl = d * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)           # d * (2*((qh>>12)&7) + 1)
    delta = torch.where((qh & 0x8000) != 0, -_IQ1_DELTA, _IQ1_DELTA).to(torch.float32)
    hi = (qh.unsqueeze(-1) >> _shifts([0, 3, 6, 9], dev, torch.int64)) & 7
    grid = _table("iq1s_grid", dev)[qs | (hi << 8)]                 # (nb, 8, 4, 8)
    v = grid + delta.reshape(nb, 8, 1, 1)                           # grid[j] + delta
    return (dl.reshape(nb, 8, 1, 1) * v).reshape(nb, QK_K)          # dl * (grid[j] + delta)


def _iq1_m(b):
    nb = b.shape[0]
    dev = b.device
    qs = b[:, 0:32].reshape(nb, 8, 4).to(torch.int64)
    qh = b[:, 32:48].reshape(nb, 8, 2).to(torch.int64)
    sc = _u16(b, 48, 4)                                             # (nb, 4) int32
    u = ((sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00)
         | (sc[:, 3] & 0xF000))
    d = u.to(torch.int16).reshape(nb, 1).view(torch.float16).to(torch.float32)   # (nb, 1)
    s = sc.reshape(nb, 4, 1) >> torch.tensor([0, 3, 6, 9], device=dev, dtype=torch.int32)
    s = (s & 7).reshape(nb, 8, 2)                                   # [ib][dl1, dl2]
    dl = d.unsqueeze(-1) * (2 * s + 1).to(torch.float32)            # d * (2*s + 1)
    hq = (qh.unsqueeze(-1) >> torch.tensor([0, 4], device=dev, dtype=torch.int64))  # (nb,8,2,2)
    idx = qs | ((hq & 7) << 8).reshape(nb, 8, 4)
    delta = torch.where((hq & 0x08) != 0, -_IQ1_DELTA, _IQ1_DELTA).to(torch.float32)
    grid = _table("iq1s_grid", dev)[idx].reshape(nb, 8, 2, 2, 8)
    v = grid + delta.reshape(nb, 8, 2, 2, 1)
    return (dl.reshape(nb, 8, 2, 1, 1) * v).reshape(nb, QK_K)       # dl * (grid[j] + delta[l])


def _iq4_nl(b):
    d = _f16(b, 0)
    kv = _table("kvalues_iq4nl", b.device)[_nibbles(b[:, 2:18]).to(torch.int64)]
    return d * kv                                                   # d * kvalues_iq4nl[q]


def _mxfp4(b):
    e = b[:, 0:1].to(torch.int32)                                   # E8M0 exponent (nb, 1)
    # ggml_e8m0_to_fp32_half (ggml-impl.h): 2^(e-128) as float bits; subnormal for e < 2
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e),
                       (e - 1) << 23)
    d = bits.view(torch.float32)
    kv = _table("kvalues_mxfp4", b.device)[_nibbles(b[:, 1:17]).to(torch.int64)]
    return kv * d                                                   # kvalues_mxfp4[q] * d


def _iq4_xs(b):
    nb = b.shape[0]
    dev = b.device
    d = _f16(b, 0)
    sh = _u16(b, 2, 1)                                              # scales_h (nb, 1)
    sl = b[:, 4:8]
    lo = torch.stack([sl & 0x0F, sl >> 4], -1).reshape(nb, 8).to(torch.int32)
    hi = (sh >> torch.arange(0, 16, 2, device=dev, dtype=torch.int32)) & 3
    ls = lo | (hi << 4)
    dl = d * (ls - 32).to(torch.float32)                            # d * (ls - 32)
    qs = b[:, 8:136].reshape(nb, 8, 16)
    kv = _table("kvalues_iq4nl", dev)[_nibbles(qs).to(torch.int64)]  # (nb, 8, 32)
    return (dl.unsqueeze(-1) * kv).reshape(nb, QK_K)                # dl * kvalues_iq4nl[q]


def _float_blocks(b, dtype):
    """F32/F16/BF16 "blocks" (one element each): a bitcast, widened exactly. Eagerly a plain
    dtype view of the bytes (fast); under ``torch.compile`` the same bits built with integer
    ops and a same-size bitcast, which Inductor can fuse."""
    if not torch.compiler.is_compiling() and b.is_contiguous():
        return b.view(dtype).to(torch.float32, copy=True)
    if dtype == torch.float32:
        return _u32(b, 0, 1).to(torch.int32).view(torch.float32)
    return _f16(b, 0, dtype)


def _f16_blocks(b):
    return _float_blocks(b, torch.float16)


def _bf16_blocks(b):
    return _float_blocks(b, torch.bfloat16)


def _f32_blocks(b):
    return _float_blocks(b, torch.float32)


_IMPL: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": _f32_blocks, "F16": _f16_blocks, "BF16": _bf16_blocks,
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    "IQ2_XXS": _iq2_xxs, "IQ2_XS": _iq2_xs, "IQ2_S": _iq2_s, "IQ3_XXS": _iq3_xxs,
    "IQ3_S": _iq3_s, "IQ1_S": _iq1_s, "IQ1_M": _iq1_m, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
    "MXFP4": _mxfp4,
}

#: ggml type names :func:`dequantize` handles.
SUPPORTED_TYPES: tuple[str, ...] = tuple(_IMPL)


def dequantize_blocks(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """Dequantizes whole blocks: ``(n_blocks, type_size) uint8 -> (n_blocks, block_size) float32``.

    For F32/F16/BF16 a "block" is one element. Raises ValueError for an unsupported type."""
    t = _qtype(qtype)
    fn = _IMPL.get(t.name)
    if fn is None:
        raise ValueError(f"no torch dequantization for {t.name}; supported: "
                         f"{', '.join(SUPPORTED_TYPES)}")
    return fn(blocks)


def dequantize(blocks: torch.Tensor, qtype: str, n_per_row: int) -> torch.Tensor:
    """Dequantizes a GGUF tensor's bytes exactly as libggml's ``to_float`` does.

    Args:
        blocks: ``uint8``, either ``(n_rows, row_bytes)`` or flat ``(n_rows * row_bytes,)`` (any
            leading shape whose element count is a whole number of rows), on any device.
        qtype: ggml type name (``"Q4_K"``, ``"IQ2_XXS"``, ``"F16"`` ...), any case, or a
            ``gguf.GGMLQuantizationType`` / :class:`voodoo.quants.QuantType`.
        n_per_row: weights per row; a multiple of the type's block size.

    Returns:
        ``(n_rows, n_per_row)`` float32 on ``blocks.device``, bit-identical to
        ``cython_ggml.dequantize(bytes, qtype, n_per_row)``.

    Raises:
        TypeError: ``blocks`` is not uint8.
        ValueError: unsupported type, ``n_per_row`` not a multiple of the block size, or a byte
            count that is not a whole number of rows.
    """
    if blocks.dtype != torch.uint8:
        raise TypeError(f"dequantize wants the raw bytes as torch.uint8, got {blocks.dtype}")
    t = _qtype(qtype)
    row_bytes = t.row_nbytes(n_per_row)  # raises for a bad n_per_row
    n = blocks.numel()
    if n % row_bytes:
        raise ValueError(f"{n} bytes are not a whole number of {t.name} rows of {n_per_row} "
                         f"weights ({row_bytes} bytes each)")
    n_rows = n // row_bytes
    b = blocks.reshape(-1, t.type_size)
    if not b.is_contiguous():
        b = b.contiguous()
    return dequantize_blocks(b, t.name).reshape(n_rows, n_per_row)


# ------------------------------------------------------------------ torch.compile, exactly
def exact_compile_options() -> dict:
    """Inductor options under which compiled dequantization stays bit-identical to libggml:
    no multiply-add contraction in the generated Triton kernels (``emulate_precision_casts``
    turns Triton's ``enable_fp_fusion`` off) and no flush of subnormals to zero
    (``eager_numerics.disable_ftz``). Only the options this PyTorch knows are returned;
    ``benchmarks/lazy_candidates.py check --compile`` verifies the result on a GPU."""
    import torch._inductor.config as c
    opts = {}
    if hasattr(c, "emulate_precision_casts"):
        opts["emulate_precision_casts"] = True
    if hasattr(getattr(c, "eager_numerics", None), "disable_ftz"):
        opts["eager_numerics.disable_ftz"] = True
    return opts


_WARM: set[tuple[str, str]] = set()


def warm_tables(types, device) -> None:
    """Builds the lookup tables ``types`` need on ``device`` (eagerly, once per type and
    device), so that compiled code finds them as constants."""
    for t in types:
        key = (str(t), str(device))
        if key in _WARM:
            continue
        q = _qtype(t)
        dequantize(torch.zeros(q.type_size, dtype=torch.uint8, device=device), q.name,
                   q.block_size)
        _WARM.add(key)


def compile_recompile_limit() -> dict:
    """``torch._dynamo.config`` patch that allows one compiled graph per (menu, tile shape)."""
    import torch._dynamo.config as dc
    key = "recompile_limit" if hasattr(dc, "recompile_limit") else "cache_size_limit"
    out = {key: max(256, getattr(dc, key))}
    if hasattr(dc, "accumulated_recompile_limit"):
        out["accumulated_recompile_limit"] = max(4096, dc.accumulated_recompile_limit)
    return out
