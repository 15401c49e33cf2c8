"""Error-feedback rounding: valid ggml blocks of a type, chosen to minimise the layer's output
error ``tr(E H E^T)`` (``E = W - deq(Q)``, ``H = X^T X`` of the tensor's input) rather than
llama-quantize's per-block weighted error.

llama.cpp dequantizes whatever valid blocks a GGUF holds, so these bytes run unchanged in stock
llama.cpp; they are simply not what ``llama-quantize`` would write (a tensor-type file does not
reproduce them).

Two variants (GPTQ / OBS with the Cholesky factor ``U`` of the dampened ``H^-1 = U^T U``):

- :func:`gptq_blocks` (every type): column groups of the type's block size (32 or 256), left to
  right. The current (already updated) group is quantized by libggml's own quantizer
  (:mod:`cython_ggml`, with an importance vector), dequantized exactly, and its error
  ``E_B`` is pushed onto the columns not yet quantized: ``W_R -= E_B U_BB^-1 U_BR``.
- :func:`gptq_columns` (Q8_0, Q5_1, Q5_0, Q4_1, IQ4_NL, Q4_0): per block, the scale (and min)
  come from libggml's quantizer on the updated block; then the block's 32 columns are rounded
  one by one to the nearest level of that scale, each column's error fed back onto the block's
  later columns, and the block's error onto the later blocks. The block bytes are written here,
  in the exact ``block_*`` layouts of ``ggml-common.h``.

Importance given to libggml per group (``importance``): ``"imatrix"`` (the slice of the
imatrix vector, as llama-quantize) or ``"hessian"`` (``diag((H^-1_BB)^-1)`` of the columns
still free: the weight OBS gives each column of the group).

No Ray, no architecture names. Rows are independent (every row uses the same ``H``), so the
bytes do not depend on any row order (llama.cpp's converter permutes q/k rows: harmless).
"""

from __future__ import annotations

import ctypes

import numpy as np

__all__ = ["inverse_hessian_cholesky", "gptq_blocks", "gptq_columns", "grid_scales",
           "quantize_feedback",
           "proxy_error", "logit_kl", "LogitMap", "fit_logit_map", "validate_rows",
           "refine_columns", "COLUMN_TYPES",
           "GRID_TYPES", "REFINE_TYPES"]

#: kvalues_iq4nl (ggml-common.h)
_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                  dtype=np.float32)

#: type -> (bytes per block, has min, offset of qh or None, offset of qs, kind, q range)
_LAYOUT = {
    "Q8_0": (34, False, None, 2, "i8", (-128, 127)),
    "Q4_0": (18, False, None, 2, "u", (0, 15)),
    "Q4_1": (20, True, None, 4, "u", (0, 15)),
    "Q5_0": (22, False, 2, 6, "u", (0, 31)),
    "Q5_1": (24, True, 4, 8, "u", (0, 31)),
    "IQ4_NL": (18, False, None, 2, "nl", (0, 15)),
}
_OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 0, "Q4_1": 0, "Q5_1": 0}
#: 32-block types whose bytes :func:`gptq_columns` writes itself.
COLUMN_TYPES = tuple(_LAYOUT)
#: The uniform ones among them: :func:`grid_scales` can recover a grid in these.
GRID_TYPES = tuple(n for n in _LAYOUT if _LAYOUT[n][4] != "nl")

#: 256-block k-quants whose quant indices :func:`refine_columns` moves (their sub-block scales
#: and mins stay): type -> (bytes per block, sub-block size, first level, levels). Layouts and
#: dequantization: ``block_q4_K``/``block_q5_K``/``block_q6_K`` (ggml-common.h),
#: ``dequantize_row_q4_K``/``_q5_K``/``_q6_K`` (ggml-quants.c).
_KLAYOUT = {"Q4_K": (144, 32, 0, 16), "Q5_K": (176, 32, 0, 32), "Q6_K": (210, 16, -32, 64)}
#: Every type :func:`refine_columns` refines.
REFINE_TYPES = COLUMN_TYPES + tuple(_KLAYOUT)


def _ggml():
    import cython_ggml  # loads libggml on first use
    return cython_ggml


def solve_triangular(a: np.ndarray, b: np.ndarray, lower: bool = False,
                     trans: str = "N") -> np.ndarray:
    """``scipy.linalg.solve_triangular`` for what this module needs (float64, via torch, so
    that scipy is not a dependency): ``x`` with ``a x = b`` (``trans="T"``: ``a^T x = b``)."""
    import torch
    at = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64))
    upper = not lower
    if trans == "T":
        at, upper = at.T, not upper
    bt = torch.from_numpy(np.ascontiguousarray(b, dtype=np.float64))
    return torch.linalg.solve_triangular(at, bt, upper=upper).numpy()


def inverse_hessian_cholesky(h: np.ndarray, damp: float = 0.01) -> np.ndarray:
    """Upper Cholesky factor ``U`` of ``(H + damp·mean(diag H)·I)^-1`` (``U^T U``), float64.

    Columns with ``H_jj == 0`` (never active) get ``H_jj = 1`` first. Raises
    numpy.linalg.LinAlgError if ``H`` is not positive definite even so."""
    h = np.array(h, dtype=np.float64, copy=True)
    if h.ndim != 2 or h.shape[0] != h.shape[1]:
        raise ValueError(f"H must be square, got shape {h.shape}")
    d = np.diagonal(h).copy()
    dead = d <= 0
    h[dead, dead] = 1.0
    h[np.diag_indices_from(h)] += damp * float(np.mean(np.diagonal(h)))
    lo = np.linalg.cholesky(h)
    eye = np.eye(h.shape[0])
    li = solve_triangular(lo, eye, lower=True)          # L^-1
    hinv = li.T @ li                                     # H^-1
    return np.linalg.cholesky(hinv).T                    # upper U with U^T U = H^-1


def _check(w, imatrix, h):
    if not isinstance(w, np.ndarray) or w.ndim != 2:
        raise ValueError(f"W must be a 2-D array, got {getattr(w, 'shape', type(w).__name__)}")
    cols = w.shape[1]
    if h.shape != (cols, cols):
        raise ValueError(f"H has shape {h.shape}, W has {cols} columns")
    if imatrix is not None and np.asarray(imatrix).shape != (cols,):
        raise ValueError(f"imatrix has shape {np.asarray(imatrix).shape}, need ({cols},)")


def _importance(mode, imatrix, u_bb, s, e):
    if mode == "imatrix":
        return None if imatrix is None else np.ascontiguousarray(imatrix[s:e], dtype=np.float32)
    if mode == "hessian":
        # the free columns' inverse Hessian restricted to the group is U_BB^T U_BB; OBS weighs
        # the group's error by its inverse
        p = np.linalg.inv(u_bb.T @ u_bb)
        v = np.clip(np.diagonal(p), 1e-30, None)
        return np.ascontiguousarray(v / v.mean(), dtype=np.float32)
    raise ValueError(f"importance must be 'imatrix' or 'hessian', got {mode!r}")


def gptq_blocks(w: np.ndarray, qtype, imatrix: np.ndarray | None, h: np.ndarray, *,
                damp: float = 0.01, importance: str = "imatrix", feedback: bool = True,
                u: np.ndarray | None = None) -> np.ndarray:
    """Valid ``qtype`` rows for ``w`` (rows, cols) float32, by group-wise error feedback.

    Each group of ``block_size`` columns is quantized by libggml (``cython_ggml.quantize``) with
    the importance of ``importance``; its exact dequantized error is pushed onto the later
    columns (``feedback=False``: not pushed, a control that isolates quantizing a group on its
    own). ``u``: a precomputed :func:`inverse_hessian_cholesky` of ``h`` (else computed).

    Returns uint8 (rows, row_size), bytes of whole ggml blocks."""
    g = _ggml()
    _check(w, imatrix, h)
    rows, cols = w.shape
    bs, ts = g.block_size(qtype), g.type_size(qtype)
    if cols % bs:
        raise ValueError(f"{cols} columns is not a multiple of {g.type_name(qtype)}'s block {bs}")
    u = inverse_hessian_cholesky(h, damp) if u is None else u
    wk = np.array(w, dtype=np.float64, copy=True)
    out = np.empty((rows, cols // bs * ts), dtype=np.uint8)
    for k, s in enumerate(range(0, cols, bs)):
        e = s + bs
        u_bb = u[s:e, s:e]
        cur = np.ascontiguousarray(wk[:, s:e], dtype=np.float32)
        q = g.quantize(cur, qtype, imatrix=_importance(importance, imatrix, u_bb, s, e),
                       n_threads=1)
        out[:, k * ts:(k + 1) * ts] = q
        if feedback and e < cols:
            err = wk[:, s:e] - g.dequantize(q, qtype, bs, n_threads=1)
            err = solve_triangular(u_bb, err.T, lower=False, trans="T").T  # E_B U_BB^-1
            wk[:, e:] -= err @ u[s:e, e:]
    return out


def _f16_at(q: np.ndarray, off: int) -> np.ndarray:
    return np.ascontiguousarray(q[:, off:off + 2]).view(np.float16)[:, 0].astype(np.float32)


def gptq_columns(w: np.ndarray, qtype, imatrix: np.ndarray | None, h: np.ndarray, *,
                 damp: float = 0.01, importance: str = "imatrix",
                 u: np.ndarray | None = None, grid: bool = True) -> np.ndarray:
    """Valid ``qtype`` rows (one of :data:`COLUMN_TYPES`) for ``w`` by column-wise error
    feedback: each block's scale (and min) from libggml on the updated block (or, ``grid``,
    the block's own grid where it has one the type holds: :func:`grid_scales`), then its
    columns rounded to the nearest level one by one, errors fed back within and past the block.

    Returns uint8 (rows, row_size) in the type's ``block_*`` layout."""
    g = _ggml()
    name = _column_type(qtype, "gptq_columns writes")
    _check(w, imatrix, h)
    ts, has_min, off_qh, off_qs, kind, (qlo, qhi) = _LAYOUT[name]
    bs = 32
    rows, cols = w.shape
    if cols % bs:
        raise ValueError(f"{cols} columns is not a multiple of 32")
    u = inverse_hessian_cholesky(h, damp) if u is None else u
    wk = np.array(w, dtype=np.float64, copy=True)
    out = np.empty((rows, cols // bs * ts), dtype=np.uint8)
    off = _OFFSET.get(name, 0)
    for k, s in enumerate(range(0, cols, bs)):
        e = s + bs
        u_bb = u[s:e, s:e]
        cur = np.ascontiguousarray(wk[:, s:e], dtype=np.float32)
        ref = g.quantize(cur, qtype, imatrix=_importance(importance, imatrix, u_bb, s, e),
                         n_threads=1)
        d = _f16_at(ref, 0)
        m = _f16_at(ref, 2) if has_min else np.zeros(rows, np.float32)
        head = ref[:, :off_qs]
        if grid and kind != "nl":
            imp = _importance(importance, imatrix, u_bb, s, e)
            d, m, head = grid_scales(cur, name, d, m, head, imp)
        dz = d == 0
        dsafe = np.where(dz, np.float32(1), d)
        nl = d[:, None] * _IQ4NL[None, :] if kind == "nl" else None
        blk = wk[:, s:e]                       # a view: updated in place
        qv = np.empty((rows, bs), dtype=np.int64)
        errs = np.empty((rows, bs))
        for j in range(bs):
            x = blk[:, j]
            if kind == "nl":
                qi = np.abs(x[:, None].astype(np.float32) - nl).argmin(1)
                deq = nl[np.arange(rows), qi]
            else:
                r = np.rint((x.astype(np.float32) - m) / dsafe)
                qi = np.clip(r + off, qlo, qhi).astype(np.int64)
                qi[dz] = off if not has_min else 0
                deq = (qi - off).astype(np.float32) * d + m
            qv[:, j] = qi
            err = (x - deq) / u_bb[j, j]
            errs[:, j] = err
            if j + 1 < bs:
                blk[:, j + 1:] -= err[:, None] * u_bb[j, j + 1:][None, :]
        if e < cols:
            wk[:, e:] -= errs @ u[s:e, e:]
        out[:, k * ts:(k + 1) * ts] = _encode_block(name, head, qv)
    return out


def grid_scales(x: np.ndarray, qtype, d: np.ndarray, m: np.ndarray, head: np.ndarray,
                importance: np.ndarray | None = None):
    """Grid recovery for one 32-block per row: where a row's values ``x`` (float32 (rows, 32))
    sit on a uniform grid that ``qtype`` (a uniform type of :data:`COLUMN_TYPES`: Q8_0, Q4_0,
    Q4_1, Q5_0, Q5_1) can hold exactly, the block's scale (and min) become that grid's.

    A model that was born quantized (quantization-aware training released as floats,
    a GGUF dequantized and quantized again, SmolLM2's Q4_1 weights) has blocks whose values
    are ``d'·q + m'`` with a float16 ``d'``, ``m'``: Q5_1 (or Q5_0 for a symmetric grid) can
    store them without error, but llama.cpp's quantizers pick the scale from the block's range
    (``(max - min) / 31``), which puts most values between levels. The grid step is the
    smallest gap between the block's distinct values; the grid is taken only when every value
    is within 1e-3 steps of it, the indices fit the type, and its importance-weighted error
    under nearest rounding is smaller than that of ``d``/``m`` (the quantizer's own scale):
    otherwise nothing changes, so for weights on no grid (a BF16-born model) the bytes are
    exactly what they were.

    Args: ``d``, ``m`` float32 (rows,) the current scale and min (``m`` zeros without a min);
    ``head`` uint8 (rows, offset of qs) their block bytes; ``importance`` float32 (32,) or None
    (equal weights).
    Returns ``(d, m, head)``, new arrays where a row changed."""
    name = _column_type(qtype, "grid_scales takes")
    _, has_min, _, _, kind, (qlo, qhi) = _LAYOUT[name]
    if kind == "nl":
        raise ValueError("grid_scales takes the uniform types, not IQ4_NL")
    off = _OFFSET.get(name, 0)
    qlo = max(qlo, -127)  # Q8_0: the int8 range llama.cpp's own quantizer writes
    x = np.asarray(x, dtype=np.float32)
    wt = np.ones(x.shape[1], np.float32) if importance is None else \
        np.asarray(importance, np.float32)
    srt = np.sort(x, axis=1)
    gap = np.diff(srt, axis=1)
    span = srt[:, -1] - srt[:, 0]
    gap = np.where(gap > 1e-6 * span[:, None], gap, np.inf)
    g = gap.min(axis=1)
    ok = np.isfinite(g) & (g > 0)
    if not ok.any():
        return d, m, head
    gs = np.where(ok, g, 1.0).astype(np.float16).astype(np.float32)
    ok &= np.isfinite(gs) & (gs > 0)
    if has_min:
        mc = srt[:, 0].astype(np.float16).astype(np.float32)
        ok &= np.isfinite(mc)
    else:
        mc = np.zeros_like(d)
    cand = [(gs, mc)]
    if not has_min:  # a symmetric grid's extreme level may be on either side
        cand.append((-gs, mc))

    def err(dd, mm):
        """Weighted error under nearest rounding, and whether every value is on the grid."""
        t = (x - mm[:, None]) / np.where(dd == 0, np.float32(1), dd)[:, None]
        r = np.rint(t)
        q = np.where(dd[:, None] == 0, off, np.clip(r + off, qlo, qhi))
        deq = (q - off).astype(np.float32) * dd[:, None] + mm[:, None]
        on = (np.abs(t - r) <= 1e-3) & (r + off >= qlo) & (r + off <= qhi)
        return ((x - deq) ** 2 * wt).sum(1), on.all(axis=1)

    best, _ = err(d, m)
    d, m = d.copy(), m.copy()
    head = np.array(head, copy=True)
    for dd, mm in cand:
        e, on = err(dd, mm)
        take = ok & on & (e < best)
        if take.any():
            best = np.where(take, e, best)
            d[take], m[take] = dd[take], mm[take]
            head[take, 0:2] = dd[take].astype(np.float16)[:, None].view(np.uint8)
            if has_min:
                head[take, 2:4] = mm[take].astype(np.float16)[:, None].view(np.uint8)
    return d, m, head


def _column_type(qtype, who: str) -> str:
    """``qtype``'s name; ValueError unless it is one of :data:`COLUMN_TYPES`."""
    name = _ggml().type_name(qtype)
    if name not in _LAYOUT:
        raise ValueError(f"{who} {', '.join(COLUMN_TYPES)}, not {name}")
    return name


def _encode_block(name: str, head: np.ndarray, qv: np.ndarray) -> np.ndarray:
    """One 32-block per row in ``name``'s ``block_*`` layout: ``head`` uint8 (rows, offset of
    qs) holds d (and m) and is copied; ``qv`` int (rows, 32) the quant indices."""
    ts, _, off_qh, off_qs, kind, _ = _LAYOUT[name]
    rows = qv.shape[0]
    blocks = np.zeros((rows, ts), dtype=np.uint8)
    blocks[:, :off_qs] = head[:, :off_qs]
    if kind == "i8":
        blocks[:, 2:34] = qv.astype(np.int8).view(np.uint8)
        return blocks
    lo4 = (qv[:, :16] & 0xF) | ((qv[:, 16:] & 0xF) << 4)
    blocks[:, off_qs:off_qs + 16] = lo4.astype(np.uint8)
    if off_qh is not None:
        bits = ((qv >> 4) & 1).astype(np.uint64) << np.arange(32, dtype=np.uint64)
        qh = bits.sum(1).astype(np.uint32)
        blocks[:, off_qh:off_qh + 4] = qh[:, None].view(np.uint8).reshape(rows, 4)
    return blocks


def _decode_blocks(data: np.ndarray, name: str):
    """(d, m, q) of 32-block rows: d, m float32 (rows, n_blocks) (m = 0 without a min), q int64
    (rows, n_blocks, 32) the quant indices."""
    ts, has_min, off_qh, off_qs, kind, _ = _LAYOUT[name]
    rows = data.shape[0]
    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1, ts)
    d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
    m = (np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
         if has_min else np.zeros_like(d))
    if kind == "i8":
        q = np.ascontiguousarray(b[:, :, 2:34]).view(np.int8).astype(np.int64)
        return d, m, q
    qs = b[:, :, off_qs:off_qs + 16].astype(np.int64)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    if off_qh is not None:
        qh = np.ascontiguousarray(b[:, :, off_qh:off_qh + 4]).view(np.uint32)[..., 0]
        q |= ((qh[..., None].astype(np.int64) >> np.arange(32)) & 1) << 4
    return d, m, q


def _unit_levels(name: str) -> np.ndarray:
    """The value of each quant index per unit of the block scale ``d`` (``deq = d·L[q] + m``),
    ascending in the index."""
    _, _, _, _, kind, (qlo, qhi) = _LAYOUT[name]
    if kind == "nl":
        return _IQ4NL.astype(np.float64)
    idx = np.arange(qlo, qhi + 1, dtype=np.float64)
    return idx - _OFFSET.get(name, 0) if kind == "u" else idx


def _k_scales_mins(s: np.ndarray):
    """The 8 six-bit scales and mins of ``block_q4_K``/``block_q5_K``'s 12 ``scales`` bytes
    (``get_scale_min_k4``, ggml-quants.c): two int64 arrays (..., 8)."""
    s = s.astype(np.int64)
    sc = np.empty(s.shape[:-1] + (8,), np.int64)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _decode_k(data: np.ndarray, name: str):
    """(D, m, q) of k-quant rows, ``deq = D·(q + first level) + m`` per sub-block: D, m float64
    (rows, n_sub) holding the float32 values ggml computes (``d * sc``, ``-dmin * m``), q int64
    (rows, n_sub, sub-block size) the quant indices (from 0)."""
    ts = _KLAYOUT[name][0]
    rows = data.shape[0]
    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1, ts)
    nsb = b.shape[1]

    def f16(off):
        return np.ascontiguousarray(b[..., off:off + 2]).view(np.float16)[..., 0].astype(
            np.float32)
    if name == "Q6_K":
        ql = b[..., :128].astype(np.int64).reshape(rows, nsb, 2, 64)
        qh = b[..., 128:192].astype(np.int64).reshape(rows, nsb, 2, 32)
        lo = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4,
                       ql[..., 32:] >> 4], -2)
        hi = np.stack([(qh >> k) & 3 for k in (0, 2, 4, 6)], -2)
        q = (lo | (hi << 4)).reshape(rows, nsb * 16, 16)
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
        dd = (f16(208)[..., None] * sc).reshape(rows, -1)
        return dd.astype(np.float64), np.zeros(dd.shape), q
    sc, mn = _k_scales_mins(b[..., 4:16])
    qs = b[..., ts - 128:].astype(np.int64).reshape(rows, nsb, 4, 32)
    q = np.stack([qs & 15, qs >> 4], -2)                       # (rows, nsb, 4, 2, 32)
    if name == "Q5_K":
        qh = b[..., 16:48].astype(np.int64)
        bits = (qh[..., None, :] >> np.arange(8)[:, None]) & 1   # (rows, nsb, 8, 32)
        q = q | (bits.reshape(rows, nsb, 4, 2, 32) << 4)
    dd = f16(0)[..., None] * sc.astype(np.float32)
    mm = -(f16(2)[..., None] * mn.astype(np.float32))
    return (dd.reshape(rows, -1).astype(np.float64), mm.reshape(rows, -1).astype(np.float64),
            q.reshape(rows, nsb * 8, 32))


def _encode_k(data: np.ndarray, name: str, q: np.ndarray) -> np.ndarray:
    """``data`` (k-quant rows) with its quant indices replaced by ``q`` (rows, n_sub, sub-block
    size); scales, mins and super-block scales are copied."""
    ts = _KLAYOUT[name][0]
    rows = data.shape[0]
    b = np.array(data, dtype=np.uint8).reshape(rows, -1, ts)
    nsb = b.shape[1]
    if name == "Q6_K":
        q = q.reshape(rows, nsb, 2, 4, 32)
        ql = np.concatenate([(q[..., 0, :] & 15) | ((q[..., 2, :] & 15) << 4),
                             (q[..., 1, :] & 15) | ((q[..., 3, :] & 15) << 4)], -1)
        qh = sum(((q[..., k, :] >> 4) & 3) << (2 * k) for k in range(4))
        b[..., :128] = ql.reshape(rows, nsb, 128)
        b[..., 128:192] = qh.reshape(rows, nsb, 64)
        return b.reshape(data.shape)
    q = q.reshape(rows, nsb, 4, 2, 32)
    b[..., ts - 128:] = ((q[..., 0, :] & 15) | ((q[..., 1, :] & 15) << 4)).reshape(rows, nsb, 128)
    if name == "Q5_K":
        hb = ((q >> 4) & 1).reshape(rows, nsb, 8, 32) << np.arange(8)[:, None]
        b[..., 16:48] = hb.sum(-2)
    return b.reshape(data.shape)


def _refine_k(w, data, name, hd, sweeps, scales=True):
    _, bs, first, levels = _KLAYOUT[name]
    rows = w.shape[0]
    dd, mm, q = _decode_k(data, name)
    lv = np.arange(first, first + levels, dtype=np.float64)
    lvp = np.concatenate([lv[:1], lv, lv[-1:]])
    w64 = np.asarray(w, dtype=np.float64)
    qo = np.empty_like(q)
    for r0 in range(0, rows, _REFINE_CHUNK):
        r1 = min(rows, r0 + _REFINE_CHUNK)
        qo[r0:r1] = _refine_chunk(w64[r0:r1], q[r0:r1], dd[r0:r1], mm[r0:r1], hd, lvp, True,
                                  sweeps, False, bs)[0]
    out = _encode_k(data, name, qo)
    return _refit_k_super(w64, out, name, hd) if scales and sweeps > 0 else out


def _refit_k_super(w64, data, name, hd):
    """Moves each super-block's float16 ``d`` (and ``dmin``) of k-quant rows to its
    least-squares value under ``hd`` with the quant indices and sub-block scales fixed, where
    that lowers ``tr(E hd E^T)`` (the sign of ``d``/``dmin`` is kept)."""
    ts, bs, first, _ = _KLAYOUT[name]
    rows, cols = w64.shape
    b = np.array(data, dtype=np.uint8).reshape(rows, -1, ts)
    nsb = b.shape[1]
    dd, mm, q = _decode_k(data, name)
    lvq = (q + first).reshape(rows, nsb, 256 // bs, bs).astype(np.float64)
    if name == "Q6_K":
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float64)
        params = [(208, sc[..., None] * lvq)]
    else:
        sc, mn = _k_scales_mins(b[..., 4:16])
        params = [(0, sc[..., None].astype(np.float64) * lvq),
                  (2, -np.broadcast_to(mn[..., None].astype(np.float64), lvq.shape))]
    deq = (dd.reshape(rows, nsb, -1)[..., None] * lvq
           + mm.reshape(rows, nsb, -1)[..., None]).reshape(rows, cols)
    e = w64 - deq
    g = e @ hd                                                     # (rows, cols)
    for k in range(nsb):
        s0, s1 = 256 * k, 256 * k + 256
        hbb = hd[s0:s1, s0:s1]
        for off, x in params:
            xk = x[:, k].reshape(rows, 256)
            cur = np.ascontiguousarray(b[:, k, off:off + 2]).view(np.float16)[:, 0]
            c64 = cur.astype(np.float64)
            num = (xk * g[:, s0:s1]).sum(1)
            den = (xk * (xk @ hbb)).sum(1)
            new = (c64 + np.divide(num, den, out=np.zeros(rows), where=den > 0)).astype(
                np.float16)
            step = new.astype(np.float64) - c64
            df = -2.0 * step * num + step * step * den
            acc = (df < 0) & np.isfinite(new) & (np.sign(new) == np.sign(cur)) & (step != 0)
            if not acc.any():
                continue
            dx = np.where(acc[:, None], step[:, None] * xk, 0.0)
            g -= dx @ hd[s0:s1]
            cur = np.where(acc, new, cur)
            b[:, k, off:off + 2] = cur.astype(np.float16)[:, None].view(np.uint8)
    return b.reshape(data.shape)


def refine_columns(w: np.ndarray, data: np.ndarray, qtype, h: np.ndarray, *,
                   damp: float = 0.01, sweeps: int = 4, scales: bool = True) -> np.ndarray:
    """Coordinate descent on ``tr(E H_d E^T)`` from valid 32-block rows ``data`` of ``w``.

    ``H_d = H + damp·mean(diag H)·I`` (the matrix :func:`gptq_columns` minimises through its
    Cholesky factor). Each sweep visits every weight once, left to right, and moves its quant
    index one level up or down where that lowers the objective exactly (the gradient
    ``G = E H_d`` is kept current); after a block's columns, the block's scale ``d`` (and min
    ``m``) is moved to its least-squares value under ``H_d``, rounded to float16, where that
    lowers it too (``scales``). Stops after ``sweeps`` sweeps or one without a move. The
    objective never increases, so the result is never worse than ``data`` on the ``H`` it is
    given (QuantEase-style refinement of GPTQ's greedy one-pass rounding).

    The k-quants Q4_K, Q5_K and Q6_K (256-blocks of 32- or 16-wide sub-blocks with 6- or
    8-bit scales under a float16 super-block scale) are refined in their quant indices; the
    sub-block scale and min bytes stay as ``data`` has them, and after the sweeps each
    super-block's float16 ``d`` (and ``dmin``) moves to its least-squares value where that
    lowers the objective (``scales``; its sign is kept).

    Args: ``w`` float32 (rows, cols); ``data`` uint8 (rows, row_size), one of
    :data:`REFINE_TYPES`; ``h`` (cols, cols) ``X^T X``.
    Returns uint8 (rows, row_size), the same layout (only quant indices, d and m change).
    Raises ValueError for another type or mismatched shapes."""
    name = _ggml().type_name(qtype)
    if name not in REFINE_TYPES:
        raise ValueError(f"refine_columns refines {', '.join(REFINE_TYPES)}, not {name}")
    _check(w, None, h)
    rows, cols = w.shape
    if name in _KLAYOUT:
        ts, bs = _KLAYOUT[name][0], 256
    else:
        ts, has_min, _, off_qs, kind, (qlo, qhi) = _LAYOUT[name]
        bs = 32
    if cols % bs or data.shape != (rows, cols // bs * ts):
        raise ValueError(f"{name} rows of shape {data.shape} do not hold a {w.shape} tensor")
    hd = np.array(h, dtype=np.float64, copy=True)
    dg = np.diagonal(hd).copy()
    dead = dg <= 0
    hd[dead, dead] = 1.0
    hd[np.diag_indices_from(hd)] += damp * float(np.mean(np.diagonal(hd)))
    if name in _KLAYOUT:
        return _refine_k(w, data, name, hd, sweeps, scales)
    d, m, q = _decode_blocks(data, name)
    lv = _unit_levels(name)
    lvp = np.concatenate([lv[:1], lv, lv[-1:]])        # index + 1; a step off the end moves 0
    q = q - qlo if kind == "i8" else q                  # index into lv
    nb = cols // 32
    w64 = np.asarray(w, dtype=np.float64)
    out = np.empty((rows, nb * ts), dtype=np.uint8)
    # rows are independent (tr(E H E^T) sums over rows): chunks keep the work in cache
    for r0 in range(0, rows, _REFINE_CHUNK):
        r1 = min(rows, r0 + _REFINE_CHUNK)
        qc, dc, mc = _refine_chunk(w64[r0:r1], q[r0:r1], d[r0:r1].astype(np.float64),
                                   m[r0:r1].astype(np.float64), hd, lvp, has_min, sweeps,
                                   scales)
        qc = qc + (qlo if kind == "i8" else 0)
        head = np.zeros((r1 - r0, off_qs), dtype=np.uint8)
        for b in range(nb):
            head[:, 0:2] = dc[:, b].astype(np.float16)[:, None].view(np.uint8)
            if has_min:
                head[:, 2:4] = mc[:, b].astype(np.float16)[:, None].view(np.uint8)
            out[r0:r1, b * ts:(b + 1) * ts] = _encode_block(name, head, qc[:, b])
    return out


_REFINE_CHUNK = 2048


def _refine_chunk(w, q, d, m, hd, lvp, has_min, sweeps, scales, bs=32):
    """:func:`refine_columns` on some rows: float64 ``w`` (r, cols), ``q`` (r, nb, bs) indices
    into ``lvp[1:-1]``, ``d``/``m`` (r, nb), one per block of ``bs`` columns. Works
    column-major (a column's values are contiguous). Returns (q, d, m) of the same shapes."""
    r, cols = w.shape
    nb = cols // bs
    qT = np.ascontiguousarray(q.reshape(r, cols).T)                 # (cols, r)
    dT, mT = np.ascontiguousarray(d.T), np.ascontiguousarray(m.T)   # (nb, r)
    eT = np.ascontiguousarray(w.T) - (np.repeat(dT, bs, 0) * lvp[qT + 1] + np.repeat(mT, bs, 0))
    gT = hd @ eT                                                    # (E H_d)^T
    for _ in range(max(0, sweeps)):
        moved = 0
        for b in range(nb):
            s0, s1 = bs * b, bs * b + bs
            deT = np.zeros((bs, r))
            db = dT[b]
            for j in range(bs):
                c = s0 + j
                qi, gc, hcc = qT[c], gT[c], hd[c, c]
                cur = lvp[qi + 1]
                du = db * (lvp[qi + 2] - cur)                       # change of deq, one up
                dd = db * (lvp[qi] - cur)                           # one down
                fu = du * (du * hcc - 2.0 * gc)
                fd = dd * (dd * hcc - 2.0 * gc)
                up = (fu < fd) & (fu < 0)
                dn = ~up & (fd < 0)
                if not (up.any() or dn.any()):
                    continue
                moved += int(up.sum() + dn.sum())
                delta = np.where(up, du, np.where(dn, dd, 0.0))
                qi += up.astype(qi.dtype) - dn.astype(qi.dtype)     # in place: qT[c]
                eT[c] -= delta
                deT[j] -= delta
                gT[s0:s1] -= hd[s0:s1, c][:, None] * delta[None, :]
            if scales:
                hbb = hd[s0:s1, s0:s1]
                for which in ("d", "m") if has_min else ("d",):
                    x = lvp[qT[s0:s1] + 1] if which == "d" else np.ones((bs, r))
                    gb = gT[s0:s1]
                    num = (x * gb).sum(0)
                    den = (x * (hbb @ x)).sum(0)
                    cur = dT[b] if which == "d" else mT[b]
                    new = cur + np.divide(num, den, out=np.zeros(r), where=den > 0)
                    new = new.astype(np.float16).astype(np.float64)
                    step = np.where(np.isfinite(new), new - cur, 0.0)
                    dx = step[None, :] * x                          # change of deq
                    hdx = hbb @ dx
                    df = -2.0 * (dx * gb).sum(0) + (dx * hdx).sum(0)
                    acc = (df < 0) & (step != 0)
                    if not acc.any():
                        continue
                    dx[:, ~acc] = 0.0
                    hdx[:, ~acc] = 0.0
                    cur[acc] = new[acc]                             # in place: dT[b] / mT[b]
                    eT[s0:s1] -= dx
                    deT -= dx
                    gT[s0:s1] -= hdx
            if deT.any():
                gT[:s0] += hd[:s0, s0:s1] @ deT
                gT[s1:] += hd[s1:, s0:s1] @ deT
        if moved == 0:
            break
    return qT.T.reshape(r, nb, bs), np.ascontiguousarray(dT.T), np.ascontiguousarray(mT.T)


def quantize_feedback(w: np.ndarray, qtype, imatrix: np.ndarray | None, h: np.ndarray, *,
                      method: str = "auto", damp: float = 0.01, importance: str = "imatrix",
                      u: np.ndarray | None = None, sweeps: int = 0,
                      kquant_sweeps: int = 0, grid: bool = True) -> np.ndarray:
    """Error-feedback bytes of ``w`` as ``qtype``: ``method="columns"`` (:func:`gptq_columns`,
    32-block types of :data:`COLUMN_TYPES`), ``"blocks"`` (:func:`gptq_blocks`, every type) or
    ``"auto"`` (columns where possible). ``sweeps`` > 0: the columns' bytes are then refined
    by :func:`refine_columns` (that many sweeps, the same ``damp``); ``kquant_sweeps`` > 0:
    the blocks' bytes of the k-quants in :data:`REFINE_TYPES` likewise; no effect on other
    types. ``grid``: the columns' grid recovery (:func:`grid_scales`)."""
    name = _ggml().type_name(qtype)
    if method == "auto":
        method = "columns" if name in _LAYOUT else "blocks"
    w = np.ascontiguousarray(w, dtype=np.float32)
    if method == "columns":
        q = gptq_columns(w, name, imatrix, h, damp=damp, importance=importance, u=u,
                         grid=grid)
        return refine_columns(w, q, name, h, damp=damp, sweeps=sweeps) if sweeps > 0 else q
    if method == "blocks":
        q = gptq_blocks(w, name, imatrix, h, damp=damp, importance=importance, u=u)
        if kquant_sweeps > 0 and name in _KLAYOUT:
            q = refine_columns(w, q, name, h, damp=damp, sweeps=kquant_sweeps)
        return q
    raise ValueError(f"method must be auto, columns or blocks, got {method!r}")


def proxy_error(w: np.ndarray, deq: np.ndarray, h: np.ndarray) -> float:
    """``tr(E H E^T)`` with ``E = w - deq`` (float64)."""
    e = np.asarray(w, dtype=np.float64) - np.asarray(deq, dtype=np.float64)
    return float(np.einsum("ij,ij->", e @ np.asarray(h, dtype=np.float64), e))


class LogitMap:
    """The elementwise map from an output head's matmul ``z = x w^T`` to the model's logits:
    ``L = scale * z``, or with a final softcap ``L = softcap * tanh(scale * z / softcap)``
    (Gemma 2's ``final_logit_softcapping``, a ``logit_scale`` or ``logits_scaling``: whatever
    the model's forward does, measured by :func:`fit_logit_map`, not read from a config).

    ``scale``: float; ``softcap``: float or None. Calling it on a float tensor ``z`` returns
    ``(L, dL/dz)``, both shaped like ``z``."""

    def __init__(self, scale: float = 1.0, softcap: float | None = None):
        self.scale, self.softcap = float(scale), (None if softcap is None else float(softcap))

    def __call__(self, z):
        import torch
        if self.softcap is None:
            return z * self.scale, torch.full_like(z, self.scale)
        t = torch.tanh(z * (self.scale / self.softcap))
        return self.softcap * t, self.scale * (1 - t * t)

    @property
    def identity(self) -> bool:
        return self.softcap is None and self.scale == 1.0

    def to_dict(self) -> dict:
        return {"scale": self.scale, "softcap": self.softcap}

    def __repr__(self):
        return f"LogitMap(scale={self.scale:g}, softcap={self.softcap})"


def fit_logit_map(z, logits, tol: float = 1e-3) -> LogitMap | None:
    """Which :class:`LogitMap` turns a head's matmul outputs into the model's logits.

    Args: ``z``, ``logits``: float arrays or tensors of the same shape (any, e.g. (n_tokens,
    n_vocab)): the head module's output and the model's logits for the same tokens. Returns
    the identity, a scale (least squares), or a scale and softcap (a search over the cap in
    log space, the scale by least squares on ``softcap * atanh(L / softcap)`` over the logits
    below 0.9 of the cap), the first whose
    largest residual is within ``tol`` of ``max |L|``; None when none fits (a bias, a
    non-elementwise step: :func:`logit_kl` then models the logits as the matmul's)."""
    z = np.asarray(z, dtype=np.float64).reshape(-1)
    L = np.asarray(logits, dtype=np.float64).reshape(-1)
    if z.shape != L.shape or z.size == 0:
        raise ValueError(f"fit_logit_map: z and logits differ in shape ({z.shape}, {L.shape})")
    top = float(np.abs(L).max())
    if top == 0.0:
        return None
    zz = float(z @ z)
    if zz == 0.0:
        return None

    def ok(pred):
        return float(np.abs(pred - L).max()) <= tol * top
    if ok(z):
        return LogitMap()
    s = float(z @ L) / zz
    if ok(s * z):
        return LogitMap(scale=s)
    def fit(lc):
        c = float(np.exp(lc))
        k = np.abs(L) < 0.9 * c  # saturated logits say nothing of the scale
        if k.sum() < 2 or float(z[k] @ z[k]) == 0.0:
            return np.inf, c, 1.0
        s = float(z[k] @ (c * np.arctanh(L[k] / c))) / float(z[k] @ z[k])  # s*z for the cap
        return float(np.abs(c * np.tanh(s * z / c) - L).max()), c, s
    grid = np.log(np.geomspace(top * (1 + 1e-6), top * 1e3, 200))
    errs = [fit(lc)[0] for lc in grid]
    i = int(np.argmin(errs))
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    for _ in range(60):  # golden-section refinement of log(cap) around the grid's best
        a, b = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
        if fit(a)[0] < fit(b)[0]:
            hi = b
        else:
            lo = a
    err, c, s = fit(0.5 * (lo + hi))
    if err <= tol * top:
        return LogitMap(scale=s, softcap=c)
    return None


def logit_kl(w: np.ndarray, deq, x: np.ndarray, chunk: int = 512,
             logit_map: LogitMap | None = None):
    """The second-order KL (nats/token) of an output head's error alone: the mean over tokens of
    ``1/2 * (sum_v p_v e_v^2 - (sum_v p_v e_v)^2)``, with logits ``L = f(z)``, ``z = x w^T``,
    ``p`` their softmax and ``e = f'(z) * (x deq^T - z)`` the logit error (the softmax's
    Fisher, exact to second order in the error). ``f`` is ``logit_map`` (a final scale or
    softcap, :func:`fit_logit_map`; None: the identity).

    Args: ``w``: (n_vocab, n_per_row) float32, the head's weights; ``deq``: a candidate's
    dequantized weights of the same shape, or a list of them (scored in one pass over the
    tokens, sharing ``p``); ``x``: (n_tokens, n_per_row) float32, the head's inputs (final
    hidden states). Returns a float, or a list of floats for a list. Memory: the arrays are
    used in place, plus ``chunk x n_vocab`` floats per candidate. Unlike :func:`proxy_error`
    it weighs each vocabulary row by how likely its token is, which is what the KL sees of the
    head."""
    import warnings

    import torch
    one = not isinstance(deq, (list, tuple))
    deqs = [deq] if one else list(deq)
    fmap = None if logit_map is None or logit_map.identity else logit_map

    def t(a):
        a = np.asarray(a, dtype=np.float32)
        with warnings.catch_warnings():  # read-only memory maps: only read here
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.ascontiguousarray(a))
    wt, xt = t(w), t(x)
    dts = [t(d) for d in deqs]
    totals = [0.0] * len(dts)
    for i in range(0, xt.shape[0], chunk):
        xb = xt[i:i + chunk]
        z = xb @ wt.T
        if fmap is None:
            p, g = torch.softmax(z, dim=-1), None
        else:
            lg, g = fmap(z)
            p = torch.softmax(lg, dim=-1)
        for k, dt in enumerate(dts):
            e = xb @ dt.T - z
            if g is not None:
                e = e * g
            pe = (p * e).sum(-1, dtype=torch.float64)
            totals[k] += float((0.5 * ((p * e * e).sum(-1, dtype=torch.float64) - pe * pe)).sum())
    out = [v / max(1, xt.shape[0]) for v in totals]
    return out[0] if one else out


def validate_rows(data: np.ndarray, qtype) -> bool:
    """libggml's ``ggml_validate_row_data`` (what llama.cpp runs on a GGUF's tensors when it
    loads them with validation, and llama-quantize on what it writes) over all of ``data``."""
    g = _ggml()
    lib = ctypes.CDLL(g.library_path())
    f = lib.ggml_validate_row_data
    f.restype = ctypes.c_bool
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    a = np.ascontiguousarray(data, dtype=np.uint8)
    return bool(f(g.type_id(qtype), a.ctypes.data, a.nbytes))
