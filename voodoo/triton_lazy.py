"""Hand-written Triton kernels for :class:`voodoo.lazy.QuantizedCandidates` on CUDA.

Two kernels, each one launch over a whole tensor and all its K <= 8 candidates:

* :func:`mix`   ``W = sum_k p_k deq(Q_k)`` -- float32, in candidate order exactly as the eager
  loop computes it (``acc = deq_0 * p_0``; ``acc = acc + deq_k * p_k``), cast to the output
  dtype at the end;
* :func:`dots`  ``<deq(Q_k), g>`` for every k -- float32 partial sums per program, written to a
  ``(K, n_programs)`` buffer and summed by torch (deterministic, no atomics).

``deq`` reproduces :func:`voodoo.dequant.dequantize` (libggml's ``dequantize_row_*``) bit for
bit: the same float32 operations in the same order (``(d * sc) * q``, ``d1 * q - m1``, ``m + q *
d``), the fp16 scales widened exactly from their two bytes, sign flips as XOR of the sign bit,
and every kernel launched with ``enable_fp_fusion=False`` so that no ``a * b + c`` becomes an
FMA. The lookup tables (``kvalues_iq4nl``, ``iq3s_grid``) are taken from
:mod:`voodoo.dequant`, which takes them from gguf-py.

A program decodes a tile of ``R`` rows x ``C`` columns of every candidate, aligned to
blocks: ``C = 256`` when the row length is a multiple of 256 (always so when the menu holds a
256-block type), else the largest of 128/64/32 that divides it (32-block types only). Every
type's decoder produces the tile in one common shape, ``(R, C // 16, 16)`` (16 consecutive
weights along the last axis), so the K candidates share one register layout (no layout
conversions between them); the bytes a thread needs along those 16 weights come in one vector
load, the scales once per group of 16 weights, broadcast along the last axis.

Types (:data:`TYPE_CODES`): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
IQ4_XS, IQ3_S, F16, BF16, F32. :func:`supports` says whether a menu can use these kernels; the
caller falls back to Inductor (or eager torch) otherwise, and when Triton does not import.

Checked bit for bit against :func:`voodoo.dequant.dequantize` and libggml's reference bytes in
Triton's CPU interpreter (``tests/test_triton_lazy.py``; ``benchmarks/lazy_candidates.py
check-triton`` with ``TRITON_INTERPRET=1``) and compiled for sm_90 without a GPU (no ``fma`` or
``.ftz`` in the PTX); on an H200 (Triton 3.6.0) ``check-triton --device cuda`` found all 16
types bit-identical to libggml and a K = 6 mix bit-identical to the CPU eager loop
(``benchmarks/results/lazy_candidates/triton/``).
"""

from __future__ import annotations

import os
import threading

import torch

try:
    import triton
    import triton.language as tl
    _HAVE_TRITON = True
    _IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001
    _HAVE_TRITON = False
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

__all__ = ["available", "supports", "mix", "dots", "dequantize", "TYPE_CODES", "MAX_K"]

#: ggml type name -> the kernels' constexpr type code (0 = unused candidate slot).
TYPE_CODES = {
    "Q8_0": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 4, "Q5_1": 5, "IQ4_NL": 6,
    "Q2_K": 7, "Q3_K": 8, "Q4_K": 9, "Q5_K": 10, "Q6_K": 11, "IQ4_XS": 12, "IQ3_S": 13,
    "F16": 14, "BF16": 15, "F32": 16,
}
_BLOCK256 = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S"}
#: how the F16/BF16/F32 bytes are viewed for the kernels (BF16 as int16: widened by a shift)
_FLOAT = {"F16": torch.float16, "BF16": torch.int16, "F32": torch.float32}
#: Most candidates one launch handles.
MAX_K = 8
#: Triton's CPU interpreter (``TRITON_INTERPRET=1``, read at import as triton does): its
#: float32 -> bfloat16 cast truncates, so the mix rounds to bf16 by hand there.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available() -> bool:
    """Whether Triton imported (the kernels still need a CUDA device, or the interpreter)."""
    return _HAVE_TRITON


def supports(types, n_per_row: int | None = None) -> bool:
    """Whether these kernels handle a menu of ggml type names (and row length, if given)."""
    if not _HAVE_TRITON or not 0 < len(types) <= MAX_K:
        return False
    if any(str(t).upper() not in TYPE_CODES for t in types):
        return False
    if n_per_row is not None:
        try:
            _col_tile(types, n_per_row)
        except ValueError:
            return False
    return True


def _col_tile(types, n_per_row: int) -> int:
    if any(str(t).upper() in _BLOCK256 for t in types):
        if n_per_row % 256:
            raise ValueError(f"row length {n_per_row} is not a multiple of 256")
        return 256
    for c in (256, 128, 64, 32):
        if n_per_row % c == 0:
            return c
    raise ValueError(f"row length {n_per_row} is not a multiple of 32")


# --------------------------------------------------------------------------- tables
_TABLES: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(kvalues_iq4nl float32 (16,), iq3s_grid packed as int32 (512,): value v of entry i in
    byte v) on ``device``, from :mod:`voodoo.dequant`'s tables."""
    key = str(device)
    t = _TABLES.get(key)
    if t is None:
        from .dequant import _table
        kv = _table("kvalues_iq4nl", "cpu").to(torch.float32).contiguous()
        g = _table("iq3s_grid", "cpu")                                  # (512, 4) float32
        gi = g.to(torch.int64)
        assert torch.equal(gi.to(torch.float32), g) and int(gi.min()) >= 0 and int(gi.max()) < 256
        packed = (gi[:, 0] | (gi[:, 1] << 8) | (gi[:, 2] << 16) | (gi[:, 3] << 24))
        packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        t = (kv.to(device), packed.contiguous().to(device))
        _TABLES[key] = t
    return t


# -------------------------------------------------------------------------- kernels
if _HAVE_TRITON:
    @triton.jit
    def _f16(ptr, off, mask):
        """fp16 at byte offsets ``off`` (any shape, int64), widened exactly to float32."""
        lo = tl.load(ptr + off, mask=mask, other=0).to(tl.int32)
        hi = tl.load(ptr + off + 1, mask=mask, other=0).to(tl.int32)
        u = (lo | (hi << 8)).to(tl.int16)
        return u.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _byte(ptr, off, mask):
        return tl.load(ptr + off, mask=mask, other=0).to(tl.int32)

    # Every decoder returns its tile in one common shape, (R, S, 16) float32 with S = C // 16:
    # row r, weight s * 16 + l of the tile. All candidates thus share one register layout (no
    # shuffles between them), scales are (R, S, 1) tensors broadcast along the last axis, and
    # the 16 bytes (or 8) a thread needs along l come in one vector load.
    # Arguments: ptr (uint8 bytes, or the F16/F32 view, BF16 as int16), bo (R, S, 1) int64
    # byte offset of each weight group's block, m3 (R, 1, 1) row mask, s (1, S, 1) and
    # l (1, 1, 16) the group and weight indices.

    @triton.jit
    def _dec_32(T: tl.constexpr, ptr, bo, m3, s, l, kv_ptr):
        """The 32-weight block types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL. Weight h * 16 + l
        of block s >> 1, h = s & 1."""
        h = s & 1
        d = _f16(ptr, bo, m3)
        if T == 1:      # Q8_0: x[i].qs[j] * d
            q = tl.load(ptr + bo + 2 + h * 16 + l, mask=m3, other=0)
            w = q.to(tl.int8, bitcast=True).to(tl.float32) * d
        elif T == 2:    # Q4_0: (q - 8) * d, q = qs[l] >> 4h
            qs = _byte(ptr, bo + 2 + l, m3)
            w = (((qs >> (4 * h)) & 0xF) - 8).to(tl.float32) * d
        elif T == 3:    # Q4_1: q * d + m (product rounded, then the sum)
            m = _f16(ptr, bo + 2, m3)
            qs = _byte(ptr, bo + 4 + l, m3)
            w = m + ((qs >> (4 * h)) & 0xF).to(tl.float32) * d
        elif T == 4:    # Q5_0: ((ql | bit j of qh << 4) - 16) * d, j = h * 16 + l
            qh = (_byte(ptr, bo + 2, m3) | (_byte(ptr, bo + 3, m3) << 8)
                  | (_byte(ptr, bo + 4, m3) << 16) | (_byte(ptr, bo + 5, m3) << 24))
            qs = _byte(ptr, bo + 6 + l, m3)
            q = (((qs >> (4 * h)) & 0xF) | (((qh >> (h * 16 + l)) & 1) << 4)) - 16
            w = q.to(tl.float32) * d
        elif T == 5:    # Q5_1: q * d + m
            m = _f16(ptr, bo + 2, m3)
            qh = (_byte(ptr, bo + 4, m3) | (_byte(ptr, bo + 5, m3) << 8)
                  | (_byte(ptr, bo + 6, m3) << 16) | (_byte(ptr, bo + 7, m3) << 24))
            qs = _byte(ptr, bo + 8 + l, m3)
            q = ((qs >> (4 * h)) & 0xF) | (((qh >> (h * 16 + l)) & 1) << 4)
            w = m + q.to(tl.float32) * d
        else:           # IQ4_NL: d * kvalues_iq4nl[q]
            qs = _byte(ptr, bo + 2 + l, m3)
            w = d * tl.load(kv_ptr + ((qs >> (4 * h)) & 0xF))
        return w

    @triton.jit
    def _scale_min_k4(ptr, so, j, mask):
        """get_scale_min_k4(j, scales at byte ``so``) for sub-block indices ``j`` -> (sc, m)."""
        j4 = j & 3
        b0 = _byte(ptr, so + j4, mask)
        b4 = _byte(ptr, so + 4 + j4, mask)
        b8 = _byte(ptr, so + 8 + j4, mask)
        sc = tl.where(j < 4, b0 & 63, (b8 & 0xF) | ((b0 >> 6) << 4))
        m = tl.where(j < 4, b4 & 63, (b8 >> 4) | ((b4 >> 6) << 4))
        return sc, m

    @triton.jit
    def _dec_256(T: tl.constexpr, ptr, bo, m3, s, l, kv_ptr, g3_ptr):
        """The 256-weight block types, one block per row of the tile (S = 16): weight
        e = s * 16 + l of the block; ``bo`` (R, 1, 1)."""
        if T == 9 or T == 10:
            # Q4_K / Q5_K: sub-block j = e >> 5 = s >> 1; chunk of 64 c = s >> 2 (32 bytes:
            # low nibbles for j even, high for j odd); l32 = (s & 1) * 16 + l
            d = _f16(ptr, bo, m3)
            dmin = _f16(ptr, bo + 2, m3)
            j = s >> 1
            sc, mn = _scale_min_k4(ptr, bo + 4, j, m3)
            d1 = d * sc.to(tl.float32)                                      # d1 = d * sc
            m1 = dmin * mn.to(tl.float32)                                   # m1 = min * m
            l32 = (s & 1) * 16 + l
            if T == 9:
                qs = _byte(ptr, bo + 16 + (s >> 2) * 32 + l32, m3)
                q = (qs >> ((j & 1) * 4)) & 0xF
            else:
                ql = _byte(ptr, bo + 48 + (s >> 2) * 32 + l32, m3)
                qh = _byte(ptr, bo + 16 + l32, m3)
                q = ((ql >> ((j & 1) * 4)) & 0xF) | (((qh >> j) & 1) << 4)
            w = d1 * q.to(tl.float32) - m1                                  # d1 * q - m1
        elif T == 11:
            # Q6_K: e = n * 128 + i * 32 + l32, n = s >> 3, i = (s >> 1) & 3; scale e >> 4 = s
            d = _f16(ptr, bo + 208, m3)
            sc = tl.load(ptr + bo + 192 + s, mask=m3, other=0)
            ds = d * sc.to(tl.int8, bitcast=True).to(tl.float32)            # d * sc[is]
            n = s >> 3
            i = (s >> 1) & 3
            l32 = (s & 1) * 16 + l
            ql = _byte(ptr, bo + n * 64 + (i & 1) * 32 + l32, m3)
            qh = _byte(ptr, bo + 128 + n * 32 + l32, m3)
            q = (((ql >> ((i >> 1) * 4)) & 0xF) | (((qh >> (2 * i)) & 3) << 4)) - 32
            w = ds * q.to(tl.float32)                                       # (d * sc) * q
        elif T == 7:
            # Q2_K: e = n * 128 + j * 32 + l32 (2-bit field j of qs[n * 32 + l32]); scale s
            d = _f16(ptr, bo + 80, m3)
            dmin = _f16(ptr, bo + 82, m3)
            sc = _byte(ptr, bo + s, m3)
            dl = d * (sc & 0xF).to(tl.float32)                              # d * (sc & 0xF)
            ml = dmin * (sc >> 4).to(tl.float32)                            # min * (sc >> 4)
            j = (s >> 1) & 3
            qs = _byte(ptr, bo + 16 + (s >> 3) * 32 + (s & 1) * 16 + l, m3)
            w = dl * ((qs >> (2 * j)) & 3).to(tl.float32) - ml              # dl * q - ml
        elif T == 8:
            # Q3_K: as Q2_K; high bit n * 4 + j of hmask[l32]; 6-bit scale s
            d_all = _f16(ptr, bo + 108, m3)
            lo = (_byte(ptr, bo + 96 + (s & 7), m3) >> ((s >> 3) * 4)) & 0xF
            hb = (_byte(ptr, bo + 104 + (s & 3), m3) >> ((s >> 2) * 2)) & 3
            dl = d_all * ((lo | (hb << 4)) - 32).to(tl.float32)             # d_all * (sc - 32)
            n = s >> 3
            j = (s >> 1) & 3
            l32 = (s & 1) * 16 + l
            qs = _byte(ptr, bo + 32 + n * 32 + l32, m3)
            hm = _byte(ptr, bo + l32, m3)
            q = ((qs >> (2 * j)) & 3) - (1 - ((hm >> (n * 4 + j)) & 1)) * 4
            w = dl * q.to(tl.float32)                                       # dl * q
        elif T == 12:
            # IQ4_XS: sub-block ib = s >> 1 of 32; nibble h = s & 1 of qs[ib * 16 + l]
            d = _f16(ptr, bo, m3)
            ib = s >> 1
            sh = _byte(ptr, bo + 2, m3) | (_byte(ptr, bo + 3, m3) << 8)
            lo = (_byte(ptr, bo + 4 + (ib >> 1), m3) >> ((ib & 1) * 4)) & 0xF
            ls = lo | (((sh >> (2 * ib)) & 3) << 4)
            dl = d * (ls - 32).to(tl.float32)                               # d * (ls - 32)
            qs = _byte(ptr, bo + 8 + ib * 16 + l, m3)
            w = dl * tl.load(kv_ptr + ((qs >> ((s & 1) * 4)) & 0xF))       # dl * kvalues[q]
        else:
            # IQ3_S: sub-block ib = s >> 1 of 32; grid index k = (s & 1) * 4 + (l >> 2) (4
            # weights each), value v = l & 3
            d = _f16(ptr, bo, m3)
            ib = s >> 1
            sv = (_byte(ptr, bo + 106 + (ib >> 1), m3) >> ((ib & 1) * 4)) & 0xF
            db = d * (1 + 2 * sv).to(tl.float32)                            # d * (1 + 2*s)
            k = (s & 1) * 4 + (l >> 2)
            v = l & 3
            qs = _byte(ptr, bo + 2 + ib * 8 + k, m3)
            qh = _byte(ptr, bo + 66 + ib, m3)
            g = tl.load(g3_ptr + (qs | (((qh >> k) & 1) << 8)))              # 4 packed values
            gv = ((g >> (8 * v)) & 0xFF).to(tl.float32)
            sg = _byte(ptr, bo + 74 + ib * 4 + (k >> 1), m3)
            neg = (sg >> ((k & 1) * 4 + v)) & 1
            y = (db * gv).to(tl.int32, bitcast=True) ^ (neg << 31)           # y * (+-1)
            w = y.to(tl.float32, bitcast=True)
        return w

    @triton.jit
    def _decode(T: tl.constexpr, ptr, rb, rows, rmask, pid_c, kv_ptr, g3_ptr,
                R: tl.constexpr, C: tl.constexpr):
        """Tile (R rows from ``rows``, column tile ``pid_c`` of C weights) of candidate type T
        -> (R, C // 16, 16) float32. ``rb``: bytes per row (elements per row for F16/BF16/F32)."""
        S: tl.constexpr = C // 16
        s = tl.arange(0, S)[None, :, None]
        l = tl.arange(0, 16)[None, None, :]
        r3 = rows[:, None, None]
        m3 = rmask[:, None, None]
        if T >= 14:
            cols = pid_c * C + s * 16 + l
            x = tl.load(ptr + r3 * rb + cols, mask=m3, other=0)
            if T == 15:     # BF16 held as int16: the bits are float32's top half, exactly
                w = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
            else:
                w = x.to(tl.float32)
        elif T >= 7:
            if T == 7:
                TS: tl.constexpr = 84
            elif T == 8:
                TS: tl.constexpr = 110
            elif T == 9:
                TS: tl.constexpr = 144
            elif T == 10:
                TS: tl.constexpr = 176
            elif T == 11:
                TS: tl.constexpr = 210
            elif T == 12:
                TS: tl.constexpr = 136
            else:
                TS: tl.constexpr = 110
            w = _dec_256(T, ptr, r3 * rb + pid_c * TS, m3, s, l, kv_ptr, g3_ptr)
        else:
            if T == 1:
                TS: tl.constexpr = 34
            elif T == 3:
                TS: tl.constexpr = 20
            elif T == 4:
                TS: tl.constexpr = 22
            elif T == 5:
                TS: tl.constexpr = 24
            else:
                TS: tl.constexpr = 18
            bo = r3 * rb + pid_c * ((C // 32) * TS) + (s >> 1) * TS
            w = _dec_32(T, ptr, bo, m3, s, l, kv_ptr)
        return w

    @triton.jit
    def _tile_ids(n_rows, n_groups, R: tl.constexpr, EVEN_ROWS: tl.constexpr):
        """Program -> (pid, its first column tile's group, its rows, their mask)."""
        pid = tl.program_id(0)
        pid_g = (pid % n_groups).to(tl.int64)
        pid_r = (pid // n_groups).to(tl.int64)
        rows = pid_r * R + tl.arange(0, R).to(tl.int64)
        if EVEN_ROWS:   # every tile is full: an all-true mask, folded away by the compiler
            rmask = tl.full([R], 1, tl.int1)
        else:
            rmask = rows < n_rows
        return pid.to(tl.int64), pid_g, rows, rmask

    @triton.jit
    def _term(T: tl.constexpr, Q, RB, rows, rmask, pid_c, kv_ptr, g3_ptr, p_ptr, k: tl.constexpr,
              R: tl.constexpr, C: tl.constexpr):
        """``deq_k * p_k`` of one tile (a rounded product: the kernels never contract)."""
        return _decode(T, Q, RB, rows, rmask, pid_c, kv_ptr, g3_ptr, R, C) * tl.load(p_ptr + k)

    @triton.jit
    def _mix_kernel(out_ptr, p_ptr, Q0, Q1, Q2, Q3, Q4, Q5, Q6, Q7,
                    RB0, RB1, RB2, RB3, RB4, RB5, RB6, RB7, kv_ptr, g3_ptr,
                    n_rows, n_per_row, n_groups,
                    T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr,
                    T4: tl.constexpr, T5: tl.constexpr, T6: tl.constexpr, T7: tl.constexpr,
                    R: tl.constexpr, C: tl.constexpr, CT: tl.constexpr,
                    BF16_OUT: tl.constexpr, EVEN_ROWS: tl.constexpr):
        """Each program: R rows x CT column tiles of C weights, one tile after the other."""
        pid, pid_g, rows, rmask = _tile_ids(n_rows, n_groups, R, EVEN_ROWS)
        for i in range(CT):
            pid_c = pid_g * CT + i
            # the eager loop: acc = deq_0 * p_0; acc = acc + deq_k * p_k (fp fusion off: no FMA)
            acc = _term(T0, Q0, RB0, rows, rmask, pid_c, kv_ptr, g3_ptr, p_ptr, 0, R, C)
            if T1 != 0:
                acc = acc + _term(T1, Q1, RB1, rows, rmask, pid_c, kv_ptr, g3_ptr, p_ptr, 1,
                                  R, C)
            if T2 != 0:
                acc = acc + _term(T2, Q2, RB2, rows, rmask, pid_c, kv_ptr, g3_ptr, p_ptr, 2,
                                  R, C)
            if T3 != 0:
                acc = acc + _term(T3, Q3, RB3, rows, rmask, pid_c, kv_ptr, g3_ptr, p_ptr, 3,
                                  R, C)
            if T4 != 0:
                acc = acc + _term(T4, Q4, RB4, rows, rmask, pid_c, kv_ptr, g3_ptr, p_ptr, 4,
                                  R, C)
            if T5 != 0:
                acc = acc + _term(T5, Q5, RB5, rows, rmask, pid_c, kv_ptr, g3_ptr, p_ptr, 5,
                                  R, C)
            if T6 != 0:
                acc = acc + _term(T6, Q6, RB6, rows, rmask, pid_c, kv_ptr, g3_ptr, p_ptr, 6,
                                  R, C)
            if T7 != 0:
                acc = acc + _term(T7, Q7, RB7, rows, rmask, pid_c, kv_ptr, g3_ptr, p_ptr, 7,
                                  R, C)
            cols = pid_c * C + tl.arange(0, C // 16)[None, :, None] * 16 \
                + tl.arange(0, 16)[None, None, :]
            if BF16_OUT:    # out_ptr is int16: round to nearest even by hand, NaN -> 0x7FC0 (c10)
                # (the interpreter only: it truncates in .to(tl.bfloat16); CUDA's cvt.rn does
                # round to nearest even in one instruction)
                bits = acc.to(tl.int32, bitcast=True)
                r = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
                nan = (bits & 0x7FFFFFFF) > 0x7F800000
                o = tl.where(nan, 0x7FC0, r).to(tl.int16)
            else:
                o = acc.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None, None] * n_per_row + cols, o,
                     mask=rmask[:, None, None])

    @triton.jit
    def _total(a):
        return tl.sum(tl.sum(tl.sum(a, axis=2), axis=1), axis=0)

    @triton.jit
    def _dot_acc(acc, T: tl.constexpr, Q, RB, rows, rmask, pid_c, kv_ptr, g3_ptr, g,
                 R: tl.constexpr, C: tl.constexpr):
        w = _decode(T, Q, RB, rows, rmask, pid_c, kv_ptr, g3_ptr, R, C)
        return acc + w * g

    @triton.jit
    def _dots_kernel(part_ptr, g_ptr, Q0, Q1, Q2, Q3, Q4, Q5, Q6, Q7,
                     RB0, RB1, RB2, RB3, RB4, RB5, RB6, RB7, kv_ptr, g3_ptr,
                     n_rows, n_per_row, n_groups, n_programs,
                     T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr,
                     T4: tl.constexpr, T5: tl.constexpr, T6: tl.constexpr, T7: tl.constexpr,
                     R: tl.constexpr, C: tl.constexpr, CT: tl.constexpr,
                     EVEN_ROWS: tl.constexpr):
        """Each program: per candidate, elementwise float32 sums of deq * g over its CT column
        tiles, reduced once at the end to one partial sum. Rows past the end load zero bytes
        (finite zero weights) and g = 0, so they add nothing."""
        pid, pid_g, rows, rmask = _tile_ids(n_rows, n_groups, R, EVEN_ROWS)
        S: tl.constexpr = C // 16
        a0 = tl.zeros([R, S, 16], tl.float32)
        a1 = tl.zeros([R, S, 16], tl.float32)
        a2 = tl.zeros([R, S, 16], tl.float32)
        a3 = tl.zeros([R, S, 16], tl.float32)
        a4 = tl.zeros([R, S, 16], tl.float32)
        a5 = tl.zeros([R, S, 16], tl.float32)
        a6 = tl.zeros([R, S, 16], tl.float32)
        a7 = tl.zeros([R, S, 16], tl.float32)
        for i in range(CT):
            pid_c = pid_g * CT + i
            cols = pid_c * C + tl.arange(0, S)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
            g = tl.load(g_ptr + rows[:, None, None] * n_per_row + cols,
                        mask=rmask[:, None, None], other=0).to(tl.float32)
            a0 = _dot_acc(a0, T0, Q0, RB0, rows, rmask, pid_c, kv_ptr, g3_ptr, g, R, C)
            if T1 != 0:
                a1 = _dot_acc(a1, T1, Q1, RB1, rows, rmask, pid_c, kv_ptr, g3_ptr, g, R, C)
            if T2 != 0:
                a2 = _dot_acc(a2, T2, Q2, RB2, rows, rmask, pid_c, kv_ptr, g3_ptr, g, R, C)
            if T3 != 0:
                a3 = _dot_acc(a3, T3, Q3, RB3, rows, rmask, pid_c, kv_ptr, g3_ptr, g, R, C)
            if T4 != 0:
                a4 = _dot_acc(a4, T4, Q4, RB4, rows, rmask, pid_c, kv_ptr, g3_ptr, g, R, C)
            if T5 != 0:
                a5 = _dot_acc(a5, T5, Q5, RB5, rows, rmask, pid_c, kv_ptr, g3_ptr, g, R, C)
            if T6 != 0:
                a6 = _dot_acc(a6, T6, Q6, RB6, rows, rmask, pid_c, kv_ptr, g3_ptr, g, R, C)
            if T7 != 0:
                a7 = _dot_acc(a7, T7, Q7, RB7, rows, rmask, pid_c, kv_ptr, g3_ptr, g, R, C)
        tl.store(part_ptr + pid, _total(a0))
        if T1 != 0:
            tl.store(part_ptr + n_programs + pid, _total(a1))
        if T2 != 0:
            tl.store(part_ptr + 2 * n_programs + pid, _total(a2))
        if T3 != 0:
            tl.store(part_ptr + 3 * n_programs + pid, _total(a3))
        if T4 != 0:
            tl.store(part_ptr + 4 * n_programs + pid, _total(a4))
        if T5 != 0:
            tl.store(part_ptr + 5 * n_programs + pid, _total(a5))
        if T6 != 0:
            tl.store(part_ptr + 6 * n_programs + pid, _total(a6))
        if T7 != 0:
            tl.store(part_ptr + 7 * n_programs + pid, _total(a7))


# ------------------------------------------------------------------------- launchers
def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v else default


def _config(c: int, kind: str) -> tuple[int, int]:
    """(rows per program's tile, num_warps) for column tiles of ``c`` weights: 2048 weights a
    tile (16 a thread), 4 warps, for ``mix`` and ``dots`` alike. Compiled for sm_90 (without a
    GPU) for the 6-type menu: mix 72 / dots 80 registers a thread, about 2.4 / 2.8 warp
    instructions an output weight (all six candidates); 4096-weight tiles save ~6% of the
    instructions for 96 / 127 registers. ``VOODOO_TRITON_ROWS`` / ``VOODOO_TRITON_WARPS``
    override (powers of two; for tuning on a GPU)."""
    per_tile = 2048
    r = _env_int("VOODOO_TRITON_ROWS", max(1, per_tile // c))
    w = _env_int("VOODOO_TRITON_WARPS", 4)
    if r < 1 or r & (r - 1) or w < 1 or w & (w - 1):
        raise ValueError(f"VOODOO_TRITON_ROWS={r} / VOODOO_TRITON_WARPS={w}: powers of two")
    return r, w


#: A program walks over up to this many column tiles (fewer when that would leave fewer than
#: :data:`MIN_PROGRAMS` programs); ``VOODOO_TRITON_CT`` overrides. 1 by default: compiled for
#: sm_90, a loop over 2 or 4 tiles kept loop-invariant per-weight addresses live (6-type menu:
#: mix 96-128, dots ~240 registers instead of 72 / 80) for no fewer instructions a weight.
MAX_CT = 1
MIN_PROGRAMS = 2048


def _args(blocks, types, n_per_row):
    """Pointer, row-stride and type-code arguments for the 8 candidate slots."""
    from .quants import qtype
    k = len(types)
    if not supports(types):
        raise ValueError(f"the Triton kernels do not handle the menu {list(types)}")
    ptrs, rbs, codes = [], [], []
    for b, t in zip(blocks, types):
        t = str(t).upper()
        if not b.is_contiguous():
            b = b.contiguous()
        if t in _FLOAT:
            b = b.reshape(-1).view(_FLOAT[t])
            rbs.append(n_per_row)                           # elements a row
        else:
            rbs.append(qtype(t).row_nbytes(n_per_row))      # bytes a row
        ptrs.append(b)
        codes.append(TYPE_CODES[t])
    ptrs += [ptrs[0]] * (MAX_K - k)
    rbs += [0] * (MAX_K - k)
    codes += [0] * (MAX_K - k)
    return ptrs, rbs, codes


def _launch_shape(types, n_rows, n_per_row, kind):
    """(C, R, num_warps, CT, n_groups, n_programs): column tile, rows a tile, warps, column
    tiles a program, column-tile groups a row tile, programs."""
    c = _col_tile(types, n_per_row)
    r, warps = _config(c, kind)
    n_col_tiles = n_per_row // c
    n_row_tiles = triton.cdiv(n_rows, r)
    ct = _env_int("VOODOO_TRITON_CT", 0)
    if ct <= 0 or n_col_tiles % ct:
        ct = 1
        while (ct * 2 <= MAX_CT and n_col_tiles % (ct * 2) == 0
               and n_row_tiles * n_col_tiles // (ct * 2) >= MIN_PROGRAMS):
            ct *= 2
    n_groups = n_col_tiles // ct
    return c, r, warps, ct, n_groups, n_row_tiles * n_groups


def _n_rows(blocks, types, n_per_row: int) -> int:
    """Rows of the candidates; raises TypeError (not uint8) or ValueError (a byte count that is
    not the same whole number of rows for every candidate: the kernels read without bounds)."""
    from .quants import qtype
    n_rows = None
    for b, t in zip(blocks, types):
        if b.dtype != torch.uint8:
            raise TypeError(f"candidate bytes must be uint8, got {b.dtype}")
        rb = qtype(t).row_nbytes(n_per_row)
        if b.numel() % rb or (n_rows is not None and b.numel() // rb != n_rows):
            raise ValueError(f"{t}: {b.numel()} bytes are not {n_rows or 'whole'} rows of "
                             f"{n_per_row} weights ({rb} bytes each)")
        n_rows = b.numel() // rb
    return n_rows


def _rows(blocks, types, n_rows: int, n_per_row: int):
    """Each candidate as ``(n_rows, row_bytes)`` (also for zero rows, where -1 cannot be
    inferred)."""
    from .quants import qtype
    return [b.reshape(n_rows, qtype(t).row_nbytes(n_per_row)) for b, t in zip(blocks, types)]


def mix(probs: torch.Tensor, blocks, types, n_per_row: int,
        out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``sum_k probs[k] * deq(blocks[k])``, one launch.

    Args:
        probs: ``(K,)`` float32 on the blocks' device.
        blocks: K uint8 tensors ``(n_rows, row_bytes_k)`` (contiguous).
        types: K ggml type names, :func:`supports`-ed.
        n_per_row: weights per row.
        out_dtype: dtype of the result (float32, bfloat16 or float16).

    Returns:
        ``(n_rows, n_per_row)`` tensor of ``out_dtype``: the eager loop's float32 arithmetic
        (``acc = deq_0 * p_0``, ``acc = acc + deq_k * p_k``) bit for bit, then cast (to bf16
        with round to nearest even, as torch casts; a NaN is CUDA's canonical 0x7FFF on the GPU
        and torch's CPU 0x7FC0 in the interpreter).

    Raises:
        TypeError: a candidate that is not uint8.
        ValueError: ``probs`` not ``(K,)`` float32 on the blocks' device, a menu
            :func:`supports` refuses, byte counts that are not the same whole number of rows, or a
            bad ``VOODOO_TRITON_ROWS``/``VOODOO_TRITON_WARPS``.
    """
    n_rows = _n_rows(blocks, types, n_per_row)
    if probs.dtype != torch.float32 or probs.shape != (len(types),):
        raise ValueError(f"probs must be ({len(types)},) float32, got {tuple(probs.shape)} "
                         f"{probs.dtype}")
    dev = blocks[0].device
    if probs.device != dev:
        raise ValueError(f"probs are on {probs.device}, the candidates on {dev}")
    out = torch.empty((n_rows, n_per_row), dtype=out_dtype, device=dev)
    blocks = _rows(blocks, types, n_rows, n_per_row)
    bf16 = out_dtype == torch.bfloat16 and _INTERPRET
    # whole row tiles in one launch without row masks, the last partial tile in another
    for r0, r1, even in _row_parts(types, n_rows, n_per_row, "mix"):
        c, r, warps, ct, n_groups, n_programs = _launch_shape(types, r1 - r0, n_per_row, "mix")
        ptrs, rbs, codes = _args([b[r0:r1] for b in blocks], types, n_per_row)
        kv, g3 = _tables(dev)
        o = out[r0:r1]
        with _on(dev):
            _mix_kernel[(n_programs,)](o.view(torch.int16) if bf16 else o, probs.contiguous(),
                                       *ptrs, *rbs, kv, g3, r1 - r0, n_per_row, n_groups,
                                       *codes, R=r, C=c, CT=ct, BF16_OUT=bf16, EVEN_ROWS=even,
                                       num_warps=warps, enable_fp_fusion=False)
    return out


def _row_parts(types, n_rows, n_per_row, kind):
    """``(r0, r1, even)``: rows ``r0:r1`` that are whole row tiles (even) and the rest."""
    if n_rows == 0:
        return []
    r = _config(_col_tile(types, n_per_row), kind)[0]
    n_even = n_rows - n_rows % r
    parts = [(0, n_even, True)] if n_even else []
    if n_even < n_rows:
        parts.append((n_even, n_rows, False))
    return parts


def dots(g: torch.Tensor, blocks, types, n_per_row: int) -> torch.Tensor:
    """``<deq(blocks[k]), g>`` for every k -> ``(K,)`` float32 (float32 partial sums, one per
    program, summed by torch in a fixed order). ``g``: ``(n_rows, n_per_row)``, float32,
    bfloat16 or float16, on the blocks' device. Raises as :func:`mix` does, and ValueError for
    a ``g`` of another shape."""
    n_rows = _n_rows(blocks, types, n_per_row)
    if tuple(g.shape) != (n_rows, n_per_row):
        raise ValueError(f"g has shape {tuple(g.shape)}, expected {(n_rows, n_per_row)}")
    dev = blocks[0].device
    if g.device != dev:
        raise ValueError(f"g is on {g.device}, the candidates on {dev}")
    k = len(types)
    blocks = _rows(blocks, types, n_rows, n_per_row)
    g = g.contiguous()
    parts = []
    for r0, r1, even in _row_parts(types, n_rows, n_per_row, "dots"):
        c, r, warps, ct, n_groups, n_programs = _launch_shape(types, r1 - r0, n_per_row, "dots")
        ptrs, rbs, codes = _args([b[r0:r1] for b in blocks], types, n_per_row)
        kv, g3 = _tables(dev)
        part = torch.empty((MAX_K, n_programs), dtype=torch.float32, device=dev)
        with _on(dev):
            _dots_kernel[(n_programs,)](part, g[r0:r1], *ptrs, *rbs, kv, g3,
                                        r1 - r0, n_per_row, n_groups, n_programs, *codes,
                                        R=r, C=c, CT=ct, EVEN_ROWS=even, num_warps=warps,
                                        enable_fp_fusion=False)
        parts.append(part[:k])
    if not parts:
        return torch.zeros(k, dtype=torch.float32, device=dev)
    return torch.cat(parts, 1).sum(1)


def dequantize(blocks: torch.Tensor, qtype: str, n_per_row: int) -> torch.Tensor:
    """One candidate decoded by the kernels (a K = 1 mix with p = 1: ``x * 1.0`` is ``x``):
    ``(n_rows, n_per_row)`` float32, for checks against :func:`voodoo.dequant.dequantize`."""
    from .quants import qtype as _qt
    t = _qt(qtype)
    b = blocks.reshape(-1, t.row_nbytes(n_per_row))
    one = torch.ones(1, dtype=torch.float32, device=b.device)
    return mix(one, [b], [t.name], n_per_row, torch.float32)


#: One launch (and so one first-call compile) at a time in a process: autograd runs a backward
#: thread per GPU under ``--device_map``, and Triton's compilation is not thread-safe
#: (triton-lang/triton#5933). Launches are asynchronous, so the lock is held only briefly.
_LAUNCH_LOCK = threading.RLock()


class _on:
    """``torch.cuda.device(dev)`` for a CUDA device (Triton launches on the current one);
    nothing otherwise (the interpreter); and :data:`_LAUNCH_LOCK` held meanwhile."""

    def __init__(self, dev):
        self.ctx = torch.cuda.device(dev) if torch.device(dev).type == "cuda" else None

    def __enter__(self):
        _LAUNCH_LOCK.acquire()
        if self.ctx is not None:
            try:
                self.ctx.__enter__()
            except BaseException:
                _LAUNCH_LOCK.release()
                raise

    def __exit__(self, *a):
        try:
            if self.ctx is not None:
                self.ctx.__exit__(*a)
        finally:
            _LAUNCH_LOCK.release()
