"""The candidate cache: (tensor, ggml type) -> quantized rows, written by libggml.

A *candidate* is one whole selectable tensor quantized to one type: ``np.uint8`` of shape
``(n_rows, row_size)``, every byte from libggml's ``ggml_quantize_chunk`` through
:mod:`cython_ggml` (what ``llama-quantize`` calls), in **GGUF layout** (rows as the base F32
GGUF stores them; see ``docs/contracts.md``).

Candidates are content-addressed by a :class:`CandidateKey`: sha256 of the tensor's F32 bytes
(and shape), the type name, sha256 of its imatrix row (or ``"none"``) and the llama.cpp commit.
Each lives in one Arrow IPC file::

    <root>/<TYPE>/<key digest>.arrow
        schema metadata: voodoo.candidate=1, gguf_name, type, n_rows, n_per_row, row_size,
                         weights_sha256, type_name, imatrix_sha256, llama_cpp_commit,
                         data_sha256 (of the rows), meta_sha256 (of the other entries)
        one column "rows": fixed_size_binary(row_size), n_rows entries, one chunk

Reads are memory-mapped and zero-copy (``np.frombuffer`` on the column's data buffer) and are
verified against ``data_sha256``; a truncated or corrupted file is deleted, reported with a
:class:`CorruptCandidateWarning`, and :meth:`CandidateCache.get` returns None so the caller
rebuilds it. Writes are atomic (a temporary file in the same folder, then ``os.replace``), so
several processes (Ray actors on shared storage) may fill one cache.

:func:`precache_local` is the one-process reference path; ``cluster.precache.precache_ray`` does
the same over a Ray cluster and returns the same result. This module imports no Ray.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
import uuid
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np
import pyarrow as pa

from . import rounding as _rounding
from .llamacpp import cache_root, llama_cpp_commit
from .quants import qtype, requires_imatrix

__all__ = [
    "CandidateKey", "CandidateJob", "CandidateCache", "CorruptCandidate",
    "CorruptCandidateWarning", "PrecacheResult", "candidate_key", "weights_sha256",
    "imatrix_sha256", "effective_imatrix", "quantize_candidate", "to_arrow", "from_arrow",
    "plan_precache", "precache_local", "FORMAT_VERSION", "rounding_tag", "hessian_sha",
    "GPTQ_DAMP",
]

log = logging.getLogger(__name__)

#: Version of the on-disk layout; written as ``voodoo.candidate`` in the schema metadata.
FORMAT_VERSION = "1"
_COLUMN = "rows"
_INT_FIELDS = ("n_rows", "n_per_row", "row_size")
_NO_IMATRIX = "none"


class CorruptCandidate(ValueError):
    """A candidate's bytes or metadata do not check out (checksum, shape or key mismatch)."""


class CorruptCandidateWarning(UserWarning):
    """A cached candidate file was unreadable or corrupt and has been deleted."""


# ------------------------------------------------------------------------------------ keys
@dataclass(frozen=True)
class CandidateKey:
    """What a candidate's bytes depend on, and nothing else.

    Attributes:
        weights_sha256: hex sha256 of ``f"f32:{n_rows}x{n_per_row}:"`` followed by the
            tensor's float32 C-order bytes (GGUF layout).
        type_name: ggml type name, upper case (``"Q4_K"``).
        imatrix_sha256: hex sha256 of the float32 imatrix row actually used, or ``"none"``.
        llama_cpp_commit: the llama.cpp commit whose libggml writes the bytes.
        n_rows, n_per_row: the tensor's shape (also folded into ``weights_sha256``).
        rounding: ``"ggml"`` (llama-quantize's own bytes) or
            ``"gptq:<damp>:cd<sweeps>:<sha256 of H>"`` (error-feedback rounding with the input
            Hessian H, then ``sweeps`` of coordinate descent for 32-block types,
            :mod:`voodoo.rounding`); ``cd<sweeps>kd<sweeps>`` for Q4_K, Q5_K and Q6_K when
            :data:`GPTQ_KQUANT_SWEEPS` refines them too.
    """

    weights_sha256: str
    type_name: str
    imatrix_sha256: str
    llama_cpp_commit: str
    n_rows: int
    n_per_row: int
    rounding: str = "ggml"

    @property
    def digest(self) -> str:
        """hex sha256 over all fields: the candidate's file name."""
        fields = [FORMAT_VERSION, self.weights_sha256, self.type_name, self.imatrix_sha256,
                  self.llama_cpp_commit, self.n_rows, self.n_per_row]
        if self.rounding != "ggml":  # llama-quantize's bytes keep their file names
            fields.append(self.rounding)
        s = "|".join(str(v) for v in fields)
        return hashlib.sha256(s.encode()).hexdigest()

    @property
    def row_size(self) -> int:
        """Bytes per quantized row (raises ValueError if n_per_row is not a block multiple)."""
        return qtype(self.type_name).row_nbytes(self.n_per_row)

    def to_meta(self) -> dict[str, str]:
        """The key as string metadata (Arrow schema metadata / JSON). ``rounding`` is left out
        when it is ``"ggml"``, so llama-quantize's candidates keep the metadata (and cache
        files) they had before error-feedback rounding existed."""
        d = {k: str(v) for k, v in asdict(self).items()}
        if self.rounding == "ggml":
            del d["rounding"]
        return d

    @classmethod
    def from_meta(cls, meta: dict) -> "CandidateKey":
        """Inverse of :meth:`to_meta` (extra entries are ignored). Raises KeyError."""
        return cls(weights_sha256=str(meta["weights_sha256"]), type_name=str(meta["type_name"]),
                   imatrix_sha256=str(meta["imatrix_sha256"]),
                   llama_cpp_commit=str(meta["llama_cpp_commit"]),
                   n_rows=int(meta["n_rows"]), n_per_row=int(meta["n_per_row"]),
                   rounding=str(meta.get("rounding", "ggml")))


def _as_f32_2d(w, what: str = "weights") -> np.ndarray:
    if not isinstance(w, np.ndarray) or w.dtype != np.float32:
        raise TypeError(f"{what} must be a float32 numpy array, got "
                        f"{getattr(w, 'dtype', type(w).__name__)}")
    if w.ndim != 2:
        raise ValueError(f"{what} must be 2-D (n_rows, n_per_row), got shape {w.shape}")
    return np.ascontiguousarray(w)


def weights_sha256(w: np.ndarray) -> str:
    """hex sha256 of a float32 (n_rows, n_per_row) tensor's shape and C-order bytes.

    Raises TypeError (not float32) or ValueError (not 2-D)."""
    w = _as_f32_2d(w)
    h = hashlib.sha256(f"f32:{w.shape[0]}x{w.shape[1]}:".encode())
    h.update(memoryview(w).cast("B"))
    return h.hexdigest()


def imatrix_sha256(row: np.ndarray | None) -> str:
    """hex sha256 of a float32 (n_per_row,) imatrix row's bytes, or ``"none"`` for None.

    Raises TypeError for a non-float32 row."""
    if row is None:
        return _NO_IMATRIX
    if not isinstance(row, np.ndarray) or row.dtype != np.float32 or row.ndim not in (1, 2):
        raise TypeError(f"an imatrix row must be float32 of shape (n_per_row,) or (n_expert, "
                        f"n_per_row), got "
                        f"{getattr(row, 'dtype', type(row).__name__)} "
                        f"{getattr(row, 'shape', '')}")
    h = hashlib.sha256(memoryview(np.ascontiguousarray(row)).cast("B"))
    if row.ndim == 2 and row.shape[0] > 1:  # per-expert vectors: the shape is part of the key
        h.update(f":{row.shape[0]}x{row.shape[1]}".encode())
    return h.hexdigest()


#: llama-quantize ignores (with a warning) an imatrix entry of the wrong size for this tensor
#: only; for every other tensor it is an error (``llama_model_quantize_impl``,
#: ``src/llama-quant.cpp``).
_IMATRIX_SIZE_TOLERANT = frozenset(["token_embd.weight"])


def effective_imatrix(imatrix_row: np.ndarray | None, gguf_name: str | None,
                      n_per_row: int) -> np.ndarray | None:
    """The imatrix llama-quantize would actually pass to ``ggml_quantize_chunk``.

    Rule (``llama_model_quantize_impl`` in llama.cpp ``src/llama-quant.cpp``): an entry is used
    when its size is ``ne[0] * ne[2]`` of the tensor, and then ``ggml_quantize_chunk`` gets
    vector ``i`` (``n_per_row`` values) for the rows of slice ``i`` along ``ne[2]``
    (``llama_tensor_quantize_impl``): one vector for a 2-D tensor, one per expert for stacked
    experts, one per head for MLA's 3-D ``attn_k_b`` / ``attn_v_b`` (llama-imatrix writes
    those as one flat entry of ``ne[0] * ne[2]`` values). Voodoo sees tensors as ``(n_rows,
    n_per_row)`` with the slices stacked as rows, so an entry of ``k * n_per_row`` values, flat
    or ``(k, n_per_row)``, is ``k`` per-slice vectors; the rows must split into ``k`` equal
    slices (checked when quantizing). A wrong-size entry is ignored for ``token_embd.weight``
    (always 2-D, so only ``n_per_row`` fits it) and an error otherwise. (Whether a type *needs*
    one is checked by :func:`cython_ggml.quantize` with ``tensor_name``.)

    Returns:
        float32 (n_per_row,) or (k, n_per_row) (k > 1 per-slice vectors), C-contiguous, or
        None.

    Raises:
        TypeError: the row is not a float32 numpy array.
        ValueError: a size that is not a multiple of ``n_per_row`` (for a tensor other than
            ``token_embd.weight``).
    """
    if imatrix_row is None:
        return None
    if not isinstance(imatrix_row, np.ndarray) or imatrix_row.dtype != np.float32:
        raise TypeError(f"imatrix row for {gguf_name!r} must be float32, got "
                        f"{getattr(imatrix_row, 'dtype', type(imatrix_row).__name__)}")
    row = np.ascontiguousarray(imatrix_row)
    if row.ndim == 2 and row.shape[0] == 1:
        row = row[0]
    if row.size == n_per_row:
        return row.reshape(n_per_row)
    if gguf_name in _IMATRIX_SIZE_TOLERANT:
        log.warning("imatrix row for %s has %d entries, the tensor %d per row: ignored "
                    "(as llama-quantize does)", gguf_name, row.size, n_per_row)
        return None
    if row.ndim <= 2 and n_per_row > 0 and row.size % n_per_row == 0 and \
            (row.ndim == 1 or row.shape[1] == n_per_row):
        return row.reshape(row.size // n_per_row, n_per_row)   # one vector per ne[2] slice
    raise ValueError(f"imatrix entry for {gguf_name!r} has {row.size} entries (shape "
                     f"{row.shape}), not a multiple of the tensor's {n_per_row} weights per "
                     f"row: it is not one vector per row or per ne[2] slice of this tensor "
                     f"(llama-quantize takes only ne[0]*ne[2] values); an imatrix made for "
                     f"another model or another conversion of it?")


#: GPTQ damping (a fraction of mean(diag H) added to diag H), chosen on held-out calibration
#: activations of the rotated SmolLM2 (benchmarks/results/rounding/damp_sweep.md).
GPTQ_DAMP = 0.05

#: Coordinate-descent sweeps after GPTQ's pass (:func:`voodoo.rounding.refine_columns`) for
#: the 32-block types: 4 sweeps lower the held-out output error of Q5_0/Q5_1/IQ4_NL columns by
#: a further 6-11% (benchmarks/results/rounding/cd_sweeps4/) and the KLD end to end
#: (benchmarks/results/vs_stock_auto/cd48/).
GPTQ_SWEEPS = 4

#: The same for the quant indices (then the super-block d) of Q4_K/Q5_K/Q6_K: off. It lowers
#: their held-out output error by 10-18% (benchmarks/results/rounding/cd_kquants_super/) but
#: not the KLD: at six sizes on two models every file was as good or slightly worse
#: (vs_stock_auto/cdk48/, cdk48_large/; vs_stock_rotated/cdk48_IQ4_XS/ 0.0399 against
#: nok48_IQ4_XS/ 0.0397).
GPTQ_KQUANT_SWEEPS = 0


def rounding_tag(hessian: np.ndarray | None, type_name=None, damp: float = GPTQ_DAMP, *,
                 _sha: str | None = None) -> str:
    """The :class:`CandidateKey` ``rounding`` of a ``type_name`` candidate made with
    ``hessian`` (float32 (n_per_row, n_per_row)) or without (``"ggml"``). Float types (F16,
    BF16, F32) have no rounding to improve: always ``"ggml"``. ``_sha``: the Hessian's digest
    (:func:`hessian_sha`), when already known."""
    if hessian is None or (type_name is not None and qtype(type_name).block_size == 1):
        return "ggml"
    cd = f":cd{GPTQ_SWEEPS}" if GPTQ_SWEEPS else ""
    if GPTQ_KQUANT_SWEEPS and type_name is not None and qtype(type_name).name in _K_REFINED:
        cd += f"kd{GPTQ_KQUANT_SWEEPS}"
    if GRID_RECOVERY and type_name is not None and qtype(type_name).name in _rounding.GRID_TYPES:
        cd += ":grid"
    return f"gptq:{damp}{cd}:{_sha or hessian_sha(hessian)}"


#: Grid recovery in the error-feedback rounding of Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1
#: (:func:`voodoo.rounding.grid_scales`): a block whose weights sit on a uniform grid the type
#: holds is stored on that grid (exactly, for a model born quantized); other blocks keep the
#: quantizer's scale, so BF16-born weights get the same bytes as without it. Their tag ends
#: in ``:grid``.
GRID_RECOVERY = True

#: k-quants whose quant indices :data:`GPTQ_KQUANT_SWEEPS` refines; their tag says so when it
#: is on.
_K_REFINED = frozenset(_rounding.REFINE_TYPES) - frozenset(_rounding.COLUMN_TYPES)


def hessian_sha(hessian: np.ndarray) -> str:
    """The first 32 hex digits of the sha256 of ``hessian``'s float32 bytes."""
    h = np.ascontiguousarray(hessian, dtype=np.float32)
    return hashlib.sha256(memoryview(h).cast('B')).hexdigest()[:32]


def candidate_key(weights: np.ndarray, type_name, imatrix_row: np.ndarray | None,
                  commit: str | None = None, *, _weights_sha: str | None = None,
                  rounding: str = "ggml") -> CandidateKey:
    """The cache key of ``weights`` quantized to ``type_name`` with ``imatrix_row``.

    Args:
        weights: float32 (n_rows, n_per_row), GGUF layout.
        type_name: a ggml type (name, id or ``voodoo.quants.QuantType``); must be the type
            actually written (menus from ``voodoo.quants.build_menu`` already are).
        imatrix_row: float32 (n_per_row,) or None. Pass what will be used (see
            :func:`effective_imatrix`).
        commit: llama.cpp commit; default ``voodoo.llamacpp.llama_cpp_commit()``.

    Raises:
        TypeError / ValueError: bad dtype or shape; ValueError for an unknown type.
    """
    w = _as_f32_2d(weights)
    return CandidateKey(
        weights_sha256=_weights_sha or weights_sha256(w),
        type_name=qtype(type_name).name,
        imatrix_sha256=imatrix_sha256(imatrix_row),
        llama_cpp_commit=commit or llama_cpp_commit(),
        n_rows=int(w.shape[0]), n_per_row=int(w.shape[1]), rounding=rounding)


# ---------------------------------------------------------------------------- quantizing
def quantize_candidate(w: np.ndarray, type_name, imatrix_row: np.ndarray | None,
                       gguf_name: str | None, n_threads: int | None = None,
                       hessian: np.ndarray | None = None) -> np.ndarray:
    """Quantizes one tensor to one type exactly as llama-quantize would, or, given the input
    Hessian ``hessian`` (float32 (n_per_row, n_per_row), ``X^T X`` of the tensor's matmul
    input), with error-feedback rounding (:func:`voodoo.rounding.quantize_feedback`, damping
    :data:`GPTQ_DAMP`; then :data:`GPTQ_SWEEPS` sweeps of coordinate descent for 32-block
    types, and :data:`GPTQ_KQUANT_SWEEPS` for Q4_K/Q5_K/Q6_K): valid blocks of the same type
    that llama.cpp dequantizes as any other, but not the bytes llama-quantize writes.

    Args:
        w: float32 (n_rows, n_per_row), GGUF layout (read-only arrays are fine).
        type_name: ggml type to write (no shape fallback is applied here: pass menu types).
        imatrix_row: float32 (n_per_row,) or None; filtered by :func:`effective_imatrix`.
        gguf_name: GGUF tensor name, for llama-quantize's imatrix rules.
        n_threads: libggml threads (default ``$VOODOO_GGML_THREADS`` or all cores); the bytes
            do not depend on it.

    Returns:
        np.uint8 (n_rows, row_size).

    Raises:
        ValueError: n_per_row not a multiple of the type's block (use
            ``voodoo.quants.fallback_type``), NaN/Inf, a type that needs an imatrix given none
            (``tensor_requires_imatrix``), a wrong-length imatrix row.
        TypeError: non-float32 input.
    """
    w = _as_f32_2d(w)
    t = qtype(type_name)
    try:
        if rounding_tag(hessian, t) != "ggml":
            return _quantize_feedback(w, t, imatrix_row, gguf_name, hessian)
        return _quantize(w, t, imatrix_row, gguf_name, n_threads)
    except (ValueError, RuntimeError) as e:
        raise _named_error(e, w, t.name, gguf_name) from e


def _named_error(e: Exception, w: np.ndarray, type_name: str, gguf_name: str | None):
    """libggml's error about one tensor, re-worded to name the tensor and the way out."""
    who = gguf_name or f"a tensor of shape {w.shape}"
    bad = ~np.isfinite(w)
    if bad.any():
        r, c = (int(i) for i in np.argwhere(bad)[0])
        return ValueError(f"{who}: {int(bad.sum())} NaN/Inf weights (first at row {r}, column "
                          f"{c}); no type can quantize them: fix the model's weights (a "
                          f"checkpoint saved after a diverged step?) and convert it again")
    big = float(np.max(np.abs(w))) if w.size else 0.0
    if "validate_row_data" in str(e) and type_name == "F16" and big > 65504.0:
        return ValueError(f"{who}: weights up to {big:g} exceed float16's range (65504), so F16 "
                          f"(llama.cpp's type for its {w.shape[1]}-wide rows) would be inf; "
                          f"use BF16 for it (voodoo.quants.range_safe_menu; '{who}=bf16' in "
                          f"the tensor-type file)")
    return type(e)(f"{who} as {type_name}: {e}")


def _quantize_feedback(w: np.ndarray, t, imatrix_row, gguf_name, hessian) -> np.ndarray:
    from .rounding import quantize_feedback
    im = effective_imatrix(imatrix_row, gguf_name, w.shape[1])
    if im is not None and im.ndim == 2:
        raise ValueError(f"{gguf_name}: error-feedback rounding takes one imatrix vector, not "
                         f"one per slice ({im.shape[0]}: stacked experts or a 3-D tensor such "
                         "as MLA's attn_k_b); quantize it with llama-quantize's rounding "
                         "(plan_precache does)")
    h = np.asarray(hessian, dtype=np.float32)
    if h.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"{gguf_name}: Hessian of shape {h.shape} for rows of {w.shape[1]}")
    if not np.isfinite(w).all():
        raise ValueError("non-finite weights")
    return quantize_feedback(w, t.name, im, h, damp=GPTQ_DAMP, u=_inverse_cholesky(h),
                             sweeps=GPTQ_SWEEPS, kquant_sweeps=GPTQ_KQUANT_SWEEPS,
                             grid=GRID_RECOVERY)


_U_CACHE: dict[str, np.ndarray] = {}


def _inverse_cholesky(h: np.ndarray) -> np.ndarray:
    """:func:`voodoo.rounding.inverse_hessian_cholesky` of ``h`` at :data:`GPTQ_DAMP`, kept for
    the last few Hessians (every type of a tensor, and tensors sharing an input, reuse it)."""
    from .rounding import inverse_hessian_cholesky
    k = hashlib.sha256(memoryview(np.ascontiguousarray(h)).cast("B")).hexdigest()
    if k not in _U_CACHE:
        if len(_U_CACHE) >= 4:
            _U_CACHE.pop(next(iter(_U_CACHE)))
        _U_CACHE[k] = inverse_hessian_cholesky(np.asarray(h, dtype=np.float64), damp=GPTQ_DAMP)
    return _U_CACHE[k]


def _quantize(w: np.ndarray, t, imatrix_row, gguf_name, n_threads) -> np.ndarray:
    import cython_ggml  # loads libggml on first use

    im = effective_imatrix(imatrix_row, gguf_name, w.shape[1])
    if im is not None and im.ndim == 2:
        # a 3-D tensor (stacked experts, MLA's per-head attn_k_b/attn_v_b): llama-quantize
        # quantizes the rows of ne[2] slice e with imatrix vector e
        # (``llama_tensor_quantize_impl``'s imatrix_for_row, src/llama-quant.cpp)
        n_exp = im.shape[0]
        if w.shape[0] % n_exp:
            raise ValueError(f"{gguf_name}: {w.shape[0]} rows do not split into the "
                             f"{n_exp} slices its imatrix entry has vectors for")
        per = w.shape[0] // n_exp
        return np.concatenate([cython_ggml.quantize(
            np.ascontiguousarray(w[e * per:(e + 1) * per]), t.name,
            imatrix=np.ascontiguousarray(im[e]), n_threads=n_threads, tensor_name=gguf_name)
            for e in range(n_exp)])
    return cython_ggml.quantize(w, t.name, imatrix=im, n_threads=n_threads,
                                tensor_name=gguf_name)


# ------------------------------------------------------------------------------ Arrow I/O
def _data_sha256(data: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(data)).cast("B")).hexdigest()


def _meta_sha256(meta: dict) -> str:
    items = sorted((str(k), str(v)) for k, v in meta.items() if k != "meta_sha256")
    return hashlib.sha256(repr(items).encode()).hexdigest()


def to_arrow(data: np.ndarray, meta: dict) -> pa.Table:
    """Wraps quantized rows in a one-column Arrow table without copying them.

    Args:
        data: np.uint8 (n_rows, row_size), C-contiguous (copied once if not).
        meta: string-able metadata; usually ``key.to_meta() | {"gguf_name": ...}``. ``type``,
            ``n_rows``, ``row_size``, ``data_sha256`` and ``voodoo.candidate`` are filled in
            (``data_sha256`` is computed unless given), and ``meta_sha256`` (sha256 over all
            the other entries) is added last.

    Returns:
        ``pa.Table`` with column ``rows`` of ``fixed_size_binary(row_size)`` and the metadata
        on its schema (all values str).

    Raises:
        TypeError: data is not uint8 2-D.
    """
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
        raise TypeError(f"candidate data must be np.uint8 (n_rows, row_size), got "
                        f"{getattr(data, 'dtype', type(data).__name__)} "
                        f"{getattr(data, 'shape', '')}")
    data = np.ascontiguousarray(data)
    n_rows, row_size = data.shape
    m = {str(k): str(v) for k, v in meta.items()}
    m.setdefault("type", m.get("type_name", ""))
    m.update({"voodoo.candidate": FORMAT_VERSION, "n_rows": str(n_rows),
              "row_size": str(row_size)})
    m.setdefault("data_sha256", _data_sha256(data))
    m.pop("meta_sha256", None)
    m["meta_sha256"] = _meta_sha256(m)
    arr = pa.FixedSizeBinaryArray.from_buffers(pa.binary(row_size), n_rows,
                                               [None, pa.py_buffer(data)])
    schema = pa.schema([pa.field(_COLUMN, pa.binary(row_size), nullable=False)], metadata=m)
    return pa.Table.from_arrays([arr], schema=schema)


def from_arrow(table: pa.Table, verify: bool = True) -> tuple[np.ndarray, dict]:
    """Inverse of :func:`to_arrow`: the rows as np.uint8 (n_rows, row_size) and the metadata.

    The array is a read-only view of the table's buffer when the column has one chunk (copy
    before writing to it). Integer fields (``n_rows``, ``n_per_row``, ``row_size``) come back
    as int, the rest as str.

    Raises:
        CorruptCandidate: missing column or metadata, metadata not matching its
            ``meta_sha256``, shape disagreeing with the metadata, or
            (``verify=True``) bytes whose sha256 differs from ``data_sha256``.
    """
    raw = table.schema.metadata or {}
    meta: dict = {k.decode(): v.decode() for k, v in raw.items()}
    if meta.get("voodoo.candidate") != FORMAT_VERSION or _COLUMN not in table.column_names:
        raise CorruptCandidate(f"not a voodoo candidate table (format "
                               f"{meta.get('voodoo.candidate')!r}, columns {table.column_names})")
    if meta.get("meta_sha256") != _meta_sha256(meta):
        raise CorruptCandidate("candidate metadata does not match its meta_sha256")
    try:
        for k in _INT_FIELDS:
            if k in meta:
                meta[k] = int(meta[k])
        n_rows, row_size = meta["n_rows"], meta["row_size"]
    except (KeyError, ValueError) as e:
        raise CorruptCandidate(f"bad candidate metadata: {e!r}") from None
    col = table.column(_COLUMN)
    if not pa.types.is_fixed_size_binary(col.type) or col.type.byte_width != row_size \
            or len(col) != n_rows or col.null_count:
        raise CorruptCandidate(f"candidate column is {col.type} x {len(col)}, metadata says "
                               f"{n_rows} rows of {row_size} bytes")
    chunk = col.chunks[0] if col.num_chunks == 1 else col.combine_chunks()
    buf = chunk.buffers()[1]
    start = chunk.offset * row_size
    if buf is None or buf.size < start + n_rows * row_size:
        raise CorruptCandidate("candidate data buffer is shorter than its metadata says")
    data = np.frombuffer(buf, dtype=np.uint8, count=n_rows * row_size,
                         offset=start).reshape(n_rows, row_size)
    if verify:
        got = _data_sha256(data)
        if got != meta.get("data_sha256"):
            raise CorruptCandidate(f"candidate data sha256 {got[:12]}... differs from the "
                                   f"recorded {str(meta.get('data_sha256'))[:12]}...")
    return data, meta


# ---------------------------------------------------------------------------------- cache
class CandidateCache:
    """Arrow IPC files of candidates under ``root``, one per key (see module docstring).

    Args:
        root: folder (created on first write); default ``voodoo.llamacpp.cache_root() /
            "candidates"`` (``$VOODOO_CACHE``). Use shared storage for multi-node runs that
            let actors write.
    """

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else cache_root() / "candidates"

    def __repr__(self) -> str:
        return f"CandidateCache({str(self.root)!r})"

    def path(self, key: CandidateKey) -> Path:
        """``<root>/<TYPE>/<key.digest>.arrow``."""
        return self.root / key.type_name / f"{key.digest}.arrow"

    def __contains__(self, key: CandidateKey) -> bool:
        """Whether a file exists for ``key`` (not verified; :meth:`get` verifies)."""
        return self.path(key).is_file()

    def get(self, key: CandidateKey) -> np.ndarray | None:
        """The candidate's rows, or None when absent or corrupt.

        Returns:
            np.uint8 (n_rows, row_size), read-only and memory-mapped from the file (zero-copy;
            stays valid after the file is replaced or deleted).

        A file that cannot be parsed, whose metadata disagrees with ``key``, or whose bytes do
        not match the recorded sha256 is deleted and reported (``CorruptCandidateWarning`` and
        a ``[voodoo] warning`` line under the CLI); None is returned so the caller rebuilds it.
        """
        p = self.path(key)
        try:
            st = os.stat(p)
        except FileNotFoundError:
            return None
        try:
            with pa.memory_map(str(p), "r") as src:
                table = pa.ipc.open_file(src).read_all()
            data, meta = from_arrow(table, verify=True)
            # through from_meta: fields added later take their defaults (a file written before
            # ``rounding`` existed holds llama-quantize's bytes, rounding "ggml")
            want, got = key.to_meta(), CandidateKey.from_meta(meta).to_meta()
            bad = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
            if bad:
                raise CorruptCandidate(f"metadata differs from the key: {bad}")
            if data.shape != (key.n_rows, key.row_size):
                raise CorruptCandidate(f"shape {data.shape} != {(key.n_rows, key.row_size)}")
        except (CorruptCandidate, pa.ArrowException, OSError, ValueError, KeyError,
                IndexError) as e:
            self._discard(p, st, e)
            return None
        return data

    def _discard(self, p: Path, st: os.stat_result, err: Exception) -> None:
        msg = f"corrupt candidate {p} ({type(err).__name__}: {err}); deleted, will be rebuilt"
        try:
            now = os.stat(p)
            # Another writer may have replaced the file since we read it: keep theirs.
            if (now.st_ino, now.st_mtime_ns, now.st_size) == (st.st_ino, st.st_mtime_ns,
                                                               st.st_size):
                os.unlink(p)
        except FileNotFoundError:
            pass
        # one report: the CLI prints warnings as a "[voodoo] warning:" line (a log line as
        # well printed every file twice)
        warnings.warn(msg, CorruptCandidateWarning, stacklevel=3)

    def put(self, key: CandidateKey, data: np.ndarray, gguf_name: str = "",
            extra: dict | None = None) -> Path:
        """Writes a candidate atomically and returns its path.

        Args:
            key: its key.
            data: np.uint8 (key.n_rows, key.row_size).
            gguf_name: recorded in the metadata (informational; the key does not use it).
            extra: more string metadata to record (e.g. who built it).

        Raises:
            ValueError: data's shape disagrees with the key.
            OSError: the file cannot be written (the temporary file is removed).
        """
        if getattr(data, "shape", None) != (key.n_rows, key.row_size):
            raise ValueError(f"data of shape {getattr(data, 'shape', None)} does not fit "
                             f"{key.type_name} candidate ({key.n_rows}, {key.row_size})")
        meta = {**(extra or {}), **key.to_meta(), "gguf_name": gguf_name,
                "type": key.type_name}
        table = to_arrow(data, meta)
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.parent / f".{p.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with pa.OSFile(str(tmp), "wb") as sink:
                with pa.ipc.new_file(sink, table.schema) as w:
                    w.write_table(table)
            os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return p


# ------------------------------------------------------------------------------- precache
class CandidateJob(NamedTuple):
    """One (tensor, type) to have in the cache.

    Attributes:
        gguf_name: GGUF tensor name.
        weights: float32 (n_rows, n_per_row), GGUF layout (from the base F32 GGUF).
        type_name: ggml type to write.
        imatrix_row: float32 (n_per_row,) or None.
        hessian: float32 (n_per_row, n_per_row) input Hessian for error-feedback rounding, or
            None (llama-quantize's bytes).
    """

    gguf_name: str
    weights: np.ndarray
    type_name: str
    imatrix_row: np.ndarray | None
    hessian: np.ndarray | None = None


class PrecacheResult(dict):
    """``{(gguf_name, type_name): CandidateKey}`` for every job, plus counts.

    Attributes:
        hits: jobs already in the cache (verified).
        misses: jobs quantized by this call.
        stats: more numbers (``seconds``; the Ray layer adds ``retries``, ``actor_deaths``,
            ``nodes`` = {node id: tasks}, ``workers``).
    """

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.hits = 0
        self.misses = 0
        self.stats: dict = {}

    def summary(self) -> str:
        """``"N candidates[ (M with error-feedback bytes)]: H cached, Q quantized in S s"``."""
        fb = sum(1 for k in self.values() if getattr(k, "rounding", "ggml") != "ggml")
        what = f" ({fb} with error-feedback bytes)" if fb else ""
        return (f"{len(self)} candidates{what}: {self.hits} cached, {self.misses} quantized "
                f"in {self.stats.get('seconds', 0.0):.1f} s")


def plan_precache(jobs: Iterable, cache: CandidateCache, verify: bool = True
                  ) -> tuple[PrecacheResult, list[tuple[CandidateJob, CandidateKey]]]:
    """Keys every job and splits the cached ones from those still to quantize.

    Args:
        jobs: iterable of :class:`CandidateJob` or 4-tuples
            ``(gguf_name, weights f32 (n_rows, n_per_row), type_name, imatrix_row | None)``.
        cache: where to look.
        verify: check cached files' checksums (reads them; a corrupt file is deleted and
            counted as a miss). False trusts any existing file.

    Returns:
        (result with every job's key and ``hits`` set, list of (job, key) to quantize,
        duplicates removed, in job order).

    Raises:
        TypeError / ValueError: bad weights, type or imatrix row (see :func:`candidate_key`,
        :func:`effective_imatrix`), a row length the type's block does not divide, or a type
        that needs an imatrix given none; raised before anything is quantized.
    """
    result = PrecacheResult()
    todo: list[tuple[CandidateJob, CandidateKey]] = []
    seen: set[CandidateKey] = set()
    wsha: dict[int, tuple[np.ndarray, str]] = {}  # id(weights) -> (weights, sha): hash once
    htag: dict[int, tuple[np.ndarray, str]] = {}  # id(hessian) -> (hessian, its sha)
    for j in jobs:
        j = CandidateJob(*j)
        w = _as_f32_2d(j.weights, f"weights of {j.gguf_name}")
        if id(j.weights) not in wsha:
            wsha[id(j.weights)] = (j.weights, weights_sha256(w))
        t = qtype(j.type_name).name
        im = effective_imatrix(j.imatrix_row, j.gguf_name, w.shape[1])
        if j.hessian is not None and id(j.hessian) not in htag:
            htag[id(j.hessian)] = (j.hessian, hessian_sha(j.hessian))
        # per-slice imatrix vectors (stacked experts, MLA's 3-D attn_k_b/attn_v_b): error
        # feedback takes one vector, so such a tensor keeps llama-quantize's rounding
        rnd = "ggml" if j.hessian is None or (im is not None and im.ndim == 2) \
            else rounding_tag(j.hessian, t, _sha=htag[id(j.hessian)][1])
        key = candidate_key(w, t, im, _weights_sha=wsha[id(j.weights)][1], rounding=rnd)
        key.row_size  # raises ValueError now for a type the row length does not fit
        if im is None and requires_imatrix(t, j.gguf_name):
            raise ValueError(f"{t} needs an importance matrix row for {j.gguf_name!r} "
                             "(llama-quantize's tensor_requires_imatrix rule, or libggml's "
                             "ggml_quantize_requires_imatrix) and the imatrix has none; take "
                             f"{t} out of that tensor's menu or give an imatrix that covers it")
        result[(j.gguf_name, t)] = key
        if key in seen:
            continue
        seen.add(key)
        cached = (cache.get(key) is not None) if verify else (key in cache)
        if cached:
            result.hits += 1
        else:
            todo.append((CandidateJob(j.gguf_name, j.weights, t, im,
                                      None if rnd == "ggml" else j.hessian), key))
    result.misses = len(todo)
    return result, todo


def _quantize_label(todo) -> str:
    """The progress bar's name for a batch of candidates to quantize: ``"quantize"``, or
    ``"quantize (error-feedback)"`` when any of them is error-feedback rounded (the slow kind:
    GPTQ with coordinate-descent sweeps, seconds to minutes a tensor on a CPU)."""
    return "quantize (error-feedback)" if any(k.rounding != "ggml" for _, k in todo) \
        else "quantize"


#: libggml's quantizer, nanoseconds a weight, by type (576 x 1536 float32 weights with an
#: imatrix, 2 AVX2 cores, 2026-12-07). Only the quantize progress bar reads them, for its ETA;
#: only their ratios matter, and a type not listed counts as 300.
QUANTIZE_NS = {"F32": 2, "F16": 5, "BF16": 2, "Q8_0": 10, "MXFP4": 10, "Q5_0": 30,
               "Q4_0": 60, "Q3_K": 50, "Q6_K": 65, "Q4_1": 170, "Q5_1": 200, "Q2_K": 180,
               "Q5_K": 200, "Q4_K": 240, "IQ4_XS": 280, "IQ4_NL": 420, "IQ3_S": 800,
               "IQ3_XXS": 810, "IQ2_XXS": 1850, "IQ2_XS": 4800, "IQ2_S": 7200,
               "IQ1_M": 14000, "IQ1_S": 15000}
#: error-feedback rounding, nanoseconds a weight per column of its row (the Hessian updates
#: are row x column work; same machine): the 32-block types' columns and coordinate-descent
#: sweeps (``COLUMN``: about 4 us a weight on 576-wide rows), the other types' blocks
EF_NS_PER_COLUMN = {"COLUMN": 8.0, "BLOCKS": 0.25}


def job_cost(job, key) -> float:
    """Estimated cost of quantizing one candidate, in nanoseconds at the speed of
    :data:`QUANTIZE_NS` (so a progress bar's ETA holds when one candidate takes 1,000 times
    another: an IQ1_S against a Q8_0, a 49152-row embedding's error-feedback bytes against a
    small tensor's). ``job``: a :class:`CandidateJob`; ``key``: its :class:`CandidateKey`."""
    w = job.weights
    n = int(np.prod(w.shape)) if hasattr(w, "shape") else 0
    cols = int(w.shape[-1]) if hasattr(w, "shape") and len(w.shape) else 1
    ns = QUANTIZE_NS.get(str(key.type_name).upper(), 300) * n
    if key.rounding != "ggml":
        kind = "COLUMN" if str(key.type_name).upper() in _rounding.COLUMN_TYPES else "BLOCKS"
        ns += EF_NS_PER_COLUMN[kind] * n * cols
    return max(1.0, ns)


class _QuantizeBar:
    """A tqdm bar over candidates to quantize, advanced by each one's :func:`job_cost` so its
    percentage and ETA follow the time spent; the postfix counts candidates (``done/all``)
    and names the last one."""

    def __init__(self, todo, desc: str):
        from tqdm import tqdm
        self.costs = [job_cost(j, k) for j, k in todo]
        self.n, self.done_n = len(todo), 0
        scale = 100.0 / sum(self.costs)
        self.costs = [c * scale for c in self.costs]
        self.bar = tqdm(total=100.0, desc=desc, file=sys.stderr, dynamic_ncols=True,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| "
                                   "[{elapsed}<{remaining}{postfix}]")
        self.bar.set_postfix_str(f"0/{self.n}", refresh=False)

    def done(self, i: int, what: str = "") -> None:
        """Candidate ``i`` (its index in ``todo``) is finished (or given up)."""
        self.done_n += 1
        self.bar.set_postfix_str(f"{self.done_n}/{self.n} {what}".rstrip(), refresh=False)
        self.bar.update(min(self.costs[i], self.bar.total - self.bar.n))

    def close(self) -> None:
        self.bar.close()


def _progress(todo, desc: str, enabled: bool):
    """A :class:`_QuantizeBar` over ``todo`` (``[(CandidateJob, CandidateKey)]``), or None
    when ``enabled`` is false, ``todo`` is empty or tqdm is missing."""
    if not enabled or not todo:
        return None
    try:
        return _QuantizeBar(todo, desc)
    except ImportError:  # pragma: no cover
        return None


def precache_local(jobs: Iterable, cache: CandidateCache, progress: bool = True,
                   n_threads: int | None = None, verify: bool = True) -> PrecacheResult:
    """Quantizes, in this process, every job not already cached; the reference path.

    Args:
        jobs: see :func:`plan_precache`.
        cache: the :class:`CandidateCache` to fill.
        progress: show a tqdm bar (with ETA) over the candidates to quantize, and print a
            one-line summary to stderr.
        n_threads: libggml threads per tensor (default all cores).
        verify: see :func:`plan_precache`.

    Returns:
        :class:`PrecacheResult`: ``{(gguf_name, type_name): CandidateKey}``; ``.hits`` /
        ``.misses`` count the cached and the newly quantized candidates.

    Raises:
        ValueError / TypeError: from :func:`plan_precache` or :func:`quantize_candidate`;
        candidates written before the error stay cached.
    """
    t0 = time.perf_counter()
    result, todo = plan_precache(jobs, cache, verify=verify)
    bar = _progress(todo, _quantize_label(todo), progress)
    try:
        for i, (job, key) in enumerate(todo):
            data = quantize_candidate(job.weights, key.type_name, job.imatrix_row,
                                      job.gguf_name, n_threads=n_threads, hessian=job.hessian)
            cache.put(key, data, job.gguf_name)
            if bar is not None:
                bar.done(i, f"{job.gguf_name} {key.type_name}")
    finally:
        if bar is not None:
            bar.close()
    result.stats["seconds"] = time.perf_counter() - t0
    log.info("precache_local: %s", result.summary())
    if progress:
        # written, not print()ed: in a Ray Train worker print() is patched to log each line and
        # echo it, so it reached the driver twice
        sys.stderr.write(f"[voodoo precache] {result.summary()}\n")
        sys.stderr.flush()
    return result
