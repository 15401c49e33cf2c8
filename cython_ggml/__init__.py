"""llama.cpp-exact quantization from Python: a Cython bridge over libggml-base.

Every byte returned by :func:`quantize` is written by libggml-base's own
``ggml_quantize_chunk`` (the function ``llama-quantize`` calls), and every value returned by
:func:`dequantize` comes from the type's ``to_float`` in ``ggml_get_type_traits``.

The library is found, in order, at ``$VOODOO_GGML_LIB`` (a path to ``libggml-base.so``) or in
Voodoo's build cache (``$VOODOO_CACHE``, default ``~/.cache/voodoo``), where
``voodoo bootstrap`` (or ``python -m voodoo.llamacpp``) builds it from the pinned llama.cpp.

Types are given as ggml type ids: an ``int``, a ``gguf.GGMLQuantizationType`` or a name such
as ``"Q4_K"`` / ``"iq2_xxs"``.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = [
    "GGMLLibraryNotFound", "library_path", "quantize", "dequantize", "type_id", "type_name",
    "block_size", "type_size", "row_size", "requires_imatrix", "requires_imatrix_ggml",
    "IMATRIX_REQUIRED_TYPES", "check_abi",
]


class GGMLLibraryNotFound(ImportError):
    """libggml-base could not be found or loaded."""


def _cache_root() -> str:
    return os.path.expanduser(os.environ.get("VOODOO_CACHE", "~/.cache/voodoo"))


def _find_library() -> str:
    env = os.environ.get("VOODOO_GGML_LIB")
    if env:
        if not os.path.isfile(env):
            raise GGMLLibraryNotFound(
                f"VOODOO_GGML_LIB={env!r} does not exist; point it at a libggml-base.so, "
                "or unset it to use Voodoo's own build (run `voodoo bootstrap`).")
        return env
    hits = sorted(glob.glob(os.path.join(_cache_root(), "llama.cpp", "*", "lib", "libggml-base.so")),
                  key=os.path.getmtime, reverse=True)
    pinned = os.environ.get("VOODOO_LLAMA_CPP_COMMIT")
    if pinned:
        hits = [h for h in hits if os.sep + pinned + os.sep in h] or hits
    if not hits:
        raise GGMLLibraryNotFound(
            "libggml-base.so was not found. Build it with `voodoo bootstrap --lib-only` "
            "(about 20 s), or set VOODOO_GGML_LIB=/path/to/libggml-base.so.")
    return hits[0]


_lib_path = _find_library()
try:
    _lib = ctypes.CDLL(_lib_path, mode=ctypes.RTLD_GLOBAL)
except OSError as e:  # pragma: no cover - depends on the host
    raise GGMLLibraryNotFound(f"could not load {_lib_path}: {e}") from e

from . import _ggml  # noqa: E402  (symbols resolve against the library loaded above)


def _check_build() -> str | None:
    """Why the compiled ``_ggml`` may not match this package's ``_ggml.pyx``, or None: it was
    built from another checkout whose ``_ggml.pyx`` differs (a ``ray job submit
    --working-dir`` copy carries no compiled files: the node's install provides them), or it
    is older than the ``_ggml.pyx`` beside it (sources updated, e.g. by ``git pull``, without
    rebuilding)."""
    here = os.path.dirname(os.path.abspath(__file__))
    built = os.path.dirname(os.path.abspath(_ggml.__file__))
    pyx, so_pyx = os.path.join(here, "_ggml.pyx"), os.path.join(built, "_ggml.pyx")
    try:
        if built != here:
            if not (os.path.isfile(pyx) and os.path.isfile(so_pyx)):
                return None
            with open(pyx, "rb") as a, open(so_pyx, "rb") as b:
                if a.read() == b.read():
                    return None
            return (f"cython_ggml's compiled extension {_ggml.__file__} was built from another "
                    f"checkout ({built}) whose _ggml.pyx differs from this one's ({here}); "
                    "install this checkout (`pip install -e .`) or keep both at one commit")
        if os.path.getmtime(_ggml.__file__) < os.path.getmtime(pyx):
            return (f"cython_ggml's compiled extension {_ggml.__file__} is older than "
                    f"{pyx}; rebuild it: `pip install -e .` (or `python setup.py build_ext "
                    "--inplace`) in the checkout")
    except OSError:
        return None
    return None


_stale = _check_build()
if _stale:
    import warnings
    warnings.warn(_stale, stacklevel=2)


def library_path() -> str:
    """Path of the libggml-base shared library this process uses."""
    return _lib_path


# ---------------------------------------------------------------------------------- types
#: GGML_TYPE_COUNT in ``ggml/include/ggml.h`` of the pinned llama.cpp commit; ids at or past
#: it must never reach libggml (its lookups are unchecked arrays).
GGML_TYPE_COUNT = 43
_NAMES: dict[str, int] = {}
for _t in range(GGML_TYPE_COUNT):
    try:
        _n = _ggml.type_name(_t)
    except Exception:  # pragma: no cover
        _n = None
    if _n and _n.upper() not in _NAMES and "DEPRECATED" not in _n.upper():
        _NAMES[_n.upper()] = _t
_N_TYPES = max(_NAMES.values()) + 1


def type_id(qtype) -> int:
    """ggml type id of ``qtype`` (int, ``gguf.GGMLQuantizationType`` or name).

    Raises TypeError for other objects and ValueError for an unknown name or id."""
    if isinstance(qtype, str):
        key = qtype.strip().upper()
        if key not in _NAMES:
            raise ValueError(f"unknown ggml type {qtype!r}; known: {', '.join(sorted(_NAMES))}")
        return _NAMES[key]
    try:
        t = int(qtype)
    except (TypeError, ValueError):
        raise TypeError(f"a ggml type must be an int, a GGMLQuantizationType or a name, "
                        f"not {type(qtype).__name__}") from None
    if t not in _NAMES.values():
        raise ValueError(f"unknown ggml type id {t}")
    return t


def type_name(qtype) -> str:
    """Upper-case ggml type name, e.g. ``"IQ2_XXS"``."""
    return _ggml.type_name(type_id(qtype)).upper()


def block_size(qtype) -> int:
    """Weights per block (``ggml_blck_size``): 256 for K and most IQ types, 32 for Q8_0 ..."""
    return int(_ggml.blck_size(type_id(qtype)))


def type_size(qtype) -> int:
    """Bytes per block (``ggml_type_size``)."""
    return int(_ggml.type_size(type_id(qtype)))


def row_size(qtype, n_per_row: int) -> int:
    """Bytes of one row of ``n_per_row`` weights (``ggml_row_size``). Raises ValueError when
    ``n_per_row`` is not a multiple of the block size."""
    t = type_id(qtype)
    bs = int(_ggml.blck_size(t))
    if n_per_row % bs:
        raise ValueError(f"n_per_row={n_per_row} is not a multiple of {type_name(t)}'s block "
                         f"size {bs}")
    return int(_ggml.row_size(t, n_per_row))


#: llama-quantize's rule (``tensor_requires_imatrix`` in ``src/llama-quant.cpp``): these
#: types need an importance matrix, except for ``token_embd.weight``,
#: ``per_layer_token_embd.weight`` and ``output.weight``. Stricter than libggml's own
#: ``ggml_quantize_requires_imatrix`` (IQ2_XXS, IQ2_XS, IQ1_S).
IMATRIX_REQUIRED_TYPES = frozenset(["IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "IQ1_S"])
_IMATRIX_EXEMPT_NAMES = frozenset(["token_embd.weight", "per_layer_token_embd.weight",
                                   "output.weight"])


def requires_imatrix(qtype, tensor_name: str | None = None) -> bool:
    """Whether llama-quantize refuses to write ``qtype`` for ``tensor_name`` without an
    imatrix (``tensor_requires_imatrix`` in llama.cpp ``src/llama-quant.cpp``; the Q2_K_S
    file-type special case does not apply to per-tensor types)."""
    if tensor_name in _IMATRIX_EXEMPT_NAMES:
        return bool(_ggml.requires_imatrix_ggml(type_id(qtype)))
    return type_name(qtype) in IMATRIX_REQUIRED_TYPES or bool(
        _ggml.requires_imatrix_ggml(type_id(qtype)))


def requires_imatrix_ggml(qtype) -> bool:
    """libggml's ``ggml_quantize_requires_imatrix`` (without an imatrix it would abort)."""
    return bool(_ggml.requires_imatrix_ggml(type_id(qtype)))


def check_abi() -> None:
    """Checks that the loaded library agrees with the declarations compiled into the
    extension (``struct ggml_type_traits`` layout, block and type sizes).

    Raises RuntimeError naming the first disagreement."""
    for name, t in _NAMES.items():
        tr = _ggml.traits(t)
        if tr["type_name"] is None or tr["type_name"].upper() != name:
            raise RuntimeError(f"{_lib_path}: ggml_type_traits layout differs for {name} "
                               f"(type_name={tr['type_name']!r}); rebuild cython_ggml")
        if tr["blck_size"] != _ggml.blck_size(t) or tr["type_size"] != _ggml.type_size(t):
            raise RuntimeError(f"{_lib_path}: ggml_type_traits layout differs for {name}; "
                               "rebuild cython_ggml against this library")


# ------------------------------------------------------------------------------- threads
def _n_threads(n_threads: int | None, n_rows: int) -> int:
    if n_threads is None:
        n_threads = int(os.environ.get("VOODOO_GGML_THREADS", 0)) or (os.cpu_count() or 1)
    if n_threads < 1:
        raise ValueError(f"n_threads must be >= 1, got {n_threads}")
    return max(1, min(n_threads, n_rows))


_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def _pool(n: int) -> ThreadPoolExecutor:
    with _pool_lock:
        if n not in _pools:
            _pools[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="ggml")
        return _pools[n]


def _split(n_rows: int, n: int) -> list[tuple[int, int]]:
    step = -(-n_rows // n)
    return [(a, min(a + step, n_rows)) for a in range(0, n_rows, step)]


def _run(fn, n_rows: int, n: int) -> None:
    if n == 1:
        fn(0, n_rows)
        return
    futs = [_pool(n).submit(fn, a, b) for a, b in _split(n_rows, n)]
    for f in futs:
        f.result()


# ---------------------------------------------------------------------- quantize / dequantize
def _describe(x) -> str:
    return f"shape {tuple(getattr(x, 'shape', ()))}, dtype {getattr(x, 'dtype', type(x).__name__)}"


def quantize(x: np.ndarray, qtype, imatrix: np.ndarray | None = None,
             n_threads: int | None = None, tensor_name: str | None = None) -> np.ndarray:
    """Quantizes ``x`` to ``qtype`` exactly as llama-quantize does.

    Args:
        x: float32, C-contiguous, shape (n_rows, n_per_row) (a 1-D array is one row).
        qtype: target ggml type (id, ``GGMLQuantizationType`` or name). F16, BF16 and F32 are
            accepted too (plain conversions).
        imatrix: float32 (n_per_row,) importance per column (mean squared activation, as
            llama-quantize computes it from an imatrix file), or None.
        n_threads: rows are split into this many contiguous chunks, quantized in parallel with
            the GIL released. Default: ``$VOODOO_GGML_THREADS`` or all cores. The bytes do not
            depend on it.
        tensor_name: the GGUF tensor name, used only for llama-quantize's imatrix rule
            (``token_embd.weight`` and ``output.weight`` may skip the imatrix).

    Returns:
        uint8 array of shape (n_rows, row_size(qtype, n_per_row)).

    Raises:
        TypeError: ``x`` or ``imatrix`` is not a float32 numpy array, or not C-contiguous.
        ValueError: ``n_per_row`` is not a multiple of the block size; NaN or Inf in ``x`` or
            ``imatrix``; ``imatrix`` of the wrong length; a type that needs an imatrix (see
            :func:`requires_imatrix`) given none.
    """
    t = type_id(qtype)
    name = type_name(t)
    x = _check_f32(x, "x")
    if x.ndim == 1:
        x = x.reshape(1, -1)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (n_rows, n_per_row); got {_describe(x)}")
    n_rows, n_per_row = x.shape
    bs = block_size(t)
    if n_per_row == 0 or n_per_row % bs:
        raise ValueError(f"cannot quantize a tensor of shape {x.shape} to {name}: n_per_row="
                         f"{n_per_row} is not a multiple of its block size {bs} (llama.cpp "
                         "would fall back to another type: see voodoo.quants.fallback_type)")
    if not np.isfinite(x).all():
        bad = int((~np.isfinite(x)).sum())
        raise ValueError(f"x of shape {x.shape} holds {bad} NaN/Inf values; {name} "
                         "quantization needs finite weights")
    if imatrix is not None:
        imatrix = _check_f32(imatrix, "imatrix")
        if imatrix.ndim != 1 or imatrix.shape[0] != n_per_row:
            raise ValueError(f"imatrix has {_describe(imatrix)} but the tensor of shape "
                             f"{x.shape} needs ({n_per_row},)")
        if not np.isfinite(imatrix).all():
            raise ValueError(f"imatrix for the tensor of shape {x.shape} holds NaN/Inf")
    elif requires_imatrix(t, tensor_name):
        who = f"tensor {tensor_name!r}" if tensor_name else f"a tensor of shape {x.shape}"
        raise ValueError(f"{name} needs an importance matrix for {who} (llama-quantize's "
                         "tensor_requires_imatrix rule); pass imatrix= or pick another type")
    out = np.empty((n_rows, int(_ggml.row_size(t, n_per_row))), dtype=np.uint8)
    if n_rows == 0:
        return out
    _ggml.quantize_init(t)
    n = _n_threads(n_threads, n_rows)
    _run(lambda a, b: _ggml.quantize_rows(t, x, out, a, b, imatrix), n_rows, n)
    return out


def dequantize(data: np.ndarray, qtype, n_per_row: int,
               n_threads: int | None = None) -> np.ndarray:
    """Dequantizes rows with libggml's ``to_float`` for ``qtype`` (F32, which has none there,
    is read as it is stored).

    Args:
        data: uint8, shape (n_rows, row_size) or flat with a multiple of row_size bytes.
        qtype: the ggml type of ``data``.
        n_per_row: weights per row.

    Returns:
        float32 array of shape (n_rows, n_per_row).

    Raises:
        TypeError: ``data`` is not a uint8 numpy array.
        ValueError: its size is not a whole number of rows, or ``n_per_row`` is not a multiple
            of the block size.
    """
    t = type_id(qtype)
    rs = row_size(t, n_per_row)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        raise TypeError(f"data must be a uint8 numpy array, got {_describe(data)}")
    if data.size % rs:
        raise ValueError(f"{data.size} bytes is not a whole number of {type_name(t)} rows of "
                         f"{n_per_row} weights ({rs} bytes each)")
    flat = np.ascontiguousarray(data).reshape(-1, rs)
    n_rows = flat.shape[0]
    if type_name(t) == "F32":  # libggml's F32 traits have no to_float: the bytes are the floats
        return flat.view(np.float32).reshape(n_rows, n_per_row).copy()
    out = np.empty((n_rows, n_per_row), dtype=np.float32)
    if n_rows:
        n = _n_threads(n_threads, n_rows)
        _run(lambda a, b: _ggml.dequantize_rows(t, flat, out, a, b), n_rows, n)
    return out


def _check_f32(a, what: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what} must be a numpy float32 array, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise TypeError(f"{what} must be float32, got {_describe(a)}; convert with "
                        ".astype(np.float32)")
    if not a.flags.c_contiguous:
        raise TypeError(f"{what} ({_describe(a)}) is not C-contiguous; pass "
                        "np.ascontiguousarray(...)")
    return a
