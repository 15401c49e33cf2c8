"""Writing the final GGUF, and the llama-quantize recipe that reproduces it.

:func:`export_gguf` takes the **base F32 GGUF** (:mod:`voodoo.models`; tensors in GGUF layout,
metadata and tokenizer) and an assignment (GGUF tensor name -> ggml type), and writes a GGUF
whose assigned tensors hold the candidate cache's bytes (libggml's own quantization, so they
are what ``llama-quantize`` would write) and whose other tensors are copied from the base.

:func:`write_tensor_type_file` + :func:`quantize_with_llama` are the independent route:
``llama-quantize --imatrix I --tensor-type-file T base-f32.gguf out.gguf <default>`` writes the
same tensor bytes (tests check it tensor by tensor).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

from .fsutil import remove_dead_partials
from .ggufio import read_gguf
from .progress import log
from .quants import fallback_type, nearest_ftype, qtype

__all__ = [
    "export_gguf", "write_tensor_type_file", "output_name", "quantize_with_llama",
    "assignment_types", "copy_kv", "dominant_file_type", "ExportError", "gguf_tensor_bytes",
    "badge_file_type", "model_id", "parse_model_id", "record_model", "find_model",
    "find_reference", "gguf_model_id", "prequantized_tensors", "requantize_args",
    "dequantized_copy",
]

#: GGUF pseudo-keys GGUFReader exposes that are not KV pairs of the file.
_READER_PSEUDO_KEYS = ("GGUF.",)
#: Written by GGUFWriter itself.
_WRITER_OWN_KEYS = frozenset(["general.architecture"])


class ExportError(RuntimeError):
    """The export or llama-quantize failed (reason in the message)."""


# ----------------------------------------------------------------------------- helpers
def assignment_types(assignment: Mapping[str, Any] | str | os.PathLike) -> dict[str, str]:
    """``{gguf_name: type name}`` from an assignment in any of its forms: the assignment JSON
    of :mod:`voodoo.bake` (``{"tensors": {name: {"type": ...}}}``), a path to that JSON, a
    ``{name: {"type": ...}}`` dict or a plain ``{name: "Q4_K"}`` dict.

    Raises ValueError for an unknown type name."""
    if isinstance(assignment, (str, os.PathLike)):
        with open(assignment) as f:
            assignment = json.load(f)
    if "tensors" in assignment and isinstance(assignment["tensors"], Mapping):
        assignment = assignment["tensors"]
    out = {}
    for name, v in assignment.items():
        t = v["type"] if isinstance(v, Mapping) else v
        out[name] = qtype(t).name
    return out


#: The key prefix of the provenance :func:`voodoo.cli` writes into an export (``voodoo.model``,
#: ``voodoo.budget_bytes``, ``voodoo.rounding``, ...): it describes one export and is never
#: carried into another file made from it.
VOODOO_KEY_PREFIX = "voodoo."
#: The keys llama-quantize writes into a GGUF quantized with an imatrix
#: (``tools/quantize/quantize.cpp``: ``LLM_KV_QUANTIZE_IMATRIX_*``).
QUANTIZE_IMATRIX_PREFIX = "quantize.imatrix."


def copy_kv(reader: GGUFReader, writer: GGUFWriter, skip: Iterable[str] = (),
            skip_prefixes: tuple[str, ...] = (VOODOO_KEY_PREFIX,)) -> None:
    """Copies every KV pair of ``reader`` into ``writer`` with its GGUF value type (arrays with
    their element type), except ``general.architecture`` (the writer writes it), the reader's
    ``GGUF.*`` pseudo-keys, ``skip`` and the keys starting with one of ``skip_prefixes``
    (default: a Voodoo export's own ``voodoo.*`` provenance). ``general.alignment`` also sets
    the writer's alignment. Raises ExportError for nested arrays (not used by llama.cpp
    models)."""
    skip = set(skip)
    for key, field in reader.fields.items():
        if key.startswith(_READER_PSEUDO_KEYS) or key in _WRITER_OWN_KEYS or key in skip \
                or key.startswith(tuple(skip_prefixes)):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            if len(field.types) != 2:
                raise ExportError(f"cannot copy nested GGUF array {key!r}")
            val = field.contents()
            if len(val) == 0:
                continue  # GGUFWriter refuses empty arrays
            writer.add_key_value(key, val, vtype, sub_type=field.types[1])
        else:
            val = field.contents()
            writer.add_key_value(key, val, vtype)
            if key == "general.alignment":
                writer.data_alignment = int(val)


def gguf_tensor_bytes(t) -> np.ndarray:
    """A GGUFReader tensor's data as uint8 ``(n_rows, row_size)`` (GGUF layout; rows are
    ``ne[1:]`` flattened)."""
    data = np.asarray(t.data)
    n_rows = int(np.prod([int(x) for x in t.shape[1:]])) if len(t.shape) > 1 else 1
    return data.view(np.uint8).reshape(n_rows, -1)


#: ggml type -> llama.cpp file type, for ``general.file_type`` (``llama_ftype`` in
#: ``include/llama.h``; ``gguf.LlamaFileType`` mirrors it).
_FTYPE_OF = {
    "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16, "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K, "Q5_K": LlamaFileType.MOSTLY_Q5_K_M,
    "Q5_1": LlamaFileType.MOSTLY_Q5_1, "Q5_0": LlamaFileType.MOSTLY_Q5_0,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_M, "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0, "IQ4_XS": LlamaFileType.MOSTLY_IQ4_XS,
    "IQ4_NL": LlamaFileType.MOSTLY_IQ4_NL, "Q3_K": LlamaFileType.MOSTLY_Q3_K_M,
    "IQ3_S": LlamaFileType.MOSTLY_IQ3_S, "IQ3_XXS": LlamaFileType.MOSTLY_IQ3_XXS,
    "Q2_K": LlamaFileType.MOSTLY_Q2_K, "IQ2_S": LlamaFileType.MOSTLY_IQ2_S,
    "IQ2_XS": LlamaFileType.MOSTLY_IQ2_XS, "IQ2_XXS": LlamaFileType.MOSTLY_IQ2_XXS,
    "IQ1_M": LlamaFileType.MOSTLY_IQ1_M, "IQ1_S": LlamaFileType.MOSTLY_IQ1_S,
}


def badge_file_type(badge: str) -> int:
    """``general.file_type`` for a file-name badge: ``"Q4_K_S"`` -> ``LlamaFileType.
    MOSTLY_Q4_K_S`` (15), ``"IQ2_M"`` -> ``MOSTLY_IQ2_M``. The badge is a llama.cpp file type
    (:data:`voodoo.quants.FTYPE_NOMINAL_BPW`). Raises ValueError for another name."""
    try:
        return int(LlamaFileType["MOSTLY_" + badge.upper()])
    except KeyError:
        raise ValueError(f"{badge!r} is not a llama.cpp file type (LlamaFileType has no "
                         f"MOSTLY_{badge.upper()})") from None


def dominant_file_type(weights: Mapping[str, int]) -> int:
    """``general.file_type`` for a mixed file: the llama.cpp file type of the ggml type that
    holds the most weights (``weights``: type name -> number of weights). llama.cpp reads the
    key only for display (``llama_model_ftype_name``); GGUFs written by llama-quantize with
    ``--tensor-type`` carry the file type asked for, which is also the dominant one."""
    if not weights:
        return int(LlamaFileType.ALL_F32)
    t = max(weights, key=lambda k: (weights[k], k))
    return int(_FTYPE_OF.get(t, LlamaFileType.GUESSED))


# ------------------------------------------------------------------------------ export
def export_gguf(base_gguf: str | os.PathLike, assignment,
                cache_lookup: Callable[[str, str], np.ndarray],
                out_path: str | os.PathLike, *, file_type: int | None = None,
                extra_kv: Mapping[str, Any] | None = None) -> Path:
    """Writes the mixed-precision GGUF.

    Args:
        base_gguf: the base F32 GGUF (GGUF layout, all metadata and tokenizer).
        assignment: ``{gguf_name: type}`` in any form :func:`assignment_types` accepts. Each
            type is mapped through llama.cpp's shape fallback (:func:`voodoo.quants.
            fallback_type`, ``tensor_type_fallback`` in ``src/llama-quant.cpp``) for the
            tensor's row length.
        cache_lookup: ``(gguf_name, type_name) -> np.uint8 (n_rows, row_size)``, the tensor's
            rows quantized to that (fallback) type by libggml, in GGUF layout. Called once per
            assigned tensor, as it is written (only one tensor's bytes are held at a time).
        out_path: the final file. Written to a temporary file in the same folder and renamed
            into place (``os.replace``) only when complete, so an interrupted export leaves
            nothing at ``out_path``.
        file_type: ``general.file_type`` to write. Default: the file type of the badge
            :func:`output_name` puts in the file name, i.e. :func:`voodoo.quants.
            nearest_ftype` of the assigned tensors' bits per weight (their bytes after the
            shape fallback × 8 / their weights), so ``…Voodoo55_Q4_K_S.gguf`` says
            ``MOSTLY_Q4_K_S`` (llama.cpp shows it as the model's type).
        extra_kv: more string/int/float/bool KV pairs (e.g. ``{"voodoo.assignment": ...}``;
            an ``np.uint32`` value is written as UINT32, as llama-quantize writes its
            ``quantize.imatrix.*`` counts). A base key of the same name is not copied, nor
            are the base's ``quantize.imatrix.*`` keys.

    Tensors not in the assignment are copied from the base unchanged (norms stay F32).
    ``general.quantization_version`` is set to 2 (``GGML_QNT_VERSION``).

    Returns the path written.

    Raises:
        KeyError: an assigned name is not a tensor of the base GGUF.
        ExportError: ``cache_lookup`` returned bytes of the wrong dtype or shape, or
            returned None.
    """
    types = assignment_types(assignment)
    base_gguf, out_path = Path(base_gguf), Path(out_path)
    reader = read_gguf(base_gguf)
    tensors = list(reader.tensors)
    by_name = {t.name: t for t in tensors}
    missing = sorted(set(types) - set(by_name))
    if missing:
        raise KeyError(f"assignment names tensors not in {base_gguf.name}: {missing[:5]}"
                       + (" ..." if len(missing) > 5 else ""))

    arch = reader.fields["general.architecture"].contents()
    # plan: (tensor, out type, nbytes)
    plan = []
    weights_per_type: dict[str, int] = {}
    assigned_bytes = assigned_weights = 0
    for t in tensors:
        ne = [int(x) for x in t.shape]           # GGUF ne: [n_per_row, n_rows, ...]
        n_per_row, n_rows = ne[0], int(np.prod(ne[1:])) if len(ne) > 1 else 1
        if t.name in types:
            q = fallback_type(types[t.name], n_per_row)
            nbytes = n_rows * q.row_nbytes(n_per_row)
            plan.append((t, q, n_rows, n_per_row, nbytes))
            weights_per_type[q.name] = weights_per_type.get(q.name, 0) + n_rows * n_per_row
            assigned_bytes += nbytes
            assigned_weights += n_rows * n_per_row
        else:
            plan.append((t, None, n_rows, n_per_row, int(t.n_bytes)))
            if len(ne) > 1:
                name = GGMLQuantizationType(t.tensor_type).name
                weights_per_type[name] = weights_per_type.get(name, 0) + n_rows * n_per_row

    out_path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_partials(out_path)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.{os.getpid()}.", suffix=".partial",
                               dir=out_path.parent)
    os.close(fd)
    writer = GGUFWriter(tmp, arch)
    try:
        # a quantized --model's base may carry its source's quantize.imatrix.* keys: they
        # describe another file's imatrix (this file's come in extra_kv)
        copy_kv(reader, writer, skip=["general.file_type", "general.quantization_version",
                                      *(extra_kv or {})],
                skip_prefixes=(VOODOO_KEY_PREFIX, QUANTIZE_IMATRIX_PREFIX))
        if file_type is None:
            file_type = (badge_file_type(nearest_ftype(8.0 * assigned_bytes / assigned_weights))
                         if assigned_weights else dominant_file_type(weights_per_type))
        writer.add_file_type(int(file_type))
        writer.add_quantization_version(2)
        for k, v in (extra_kv or {}).items():
            _add_scalar(writer, k, v)
        for t, q, n_rows, n_per_row, nbytes in plan:
            ne = [int(x) for x in t.shape]
            shape = list(reversed(ne))               # numpy order: (..., n_rows, n_per_row)
            if q is None:
                raw = GGMLQuantizationType(t.tensor_type)
                writer.add_tensor_info(t.name, _byte_shape(shape, raw), np.dtype(np.uint8),
                                       nbytes, raw_dtype=raw)
            else:
                writer.add_tensor_info(t.name, shape[:-1] + [q.row_nbytes(n_per_row)],
                                       np.dtype(np.uint8), nbytes, raw_dtype=q.ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t, q, n_rows, n_per_row, nbytes in plan:
            if q is None:
                data = np.asarray(t.data).view(np.uint8).reshape(-1)
            else:
                data = cache_lookup(t.name, q.name)
                rs = q.row_nbytes(n_per_row)
                if data is None:
                    raise ExportError(f"no {q.name} bytes for {t.name} in the candidate cache")
                if not isinstance(data, np.ndarray) or data.dtype != np.uint8 \
                        or data.size != nbytes:
                    raise ExportError(
                        f"cache bytes for {t.name} as {q.name} have shape "
                        f"{getattr(data, 'shape', None)}, dtype {getattr(data, 'dtype', None)};"
                        f" expected uint8 ({n_rows}, {rs})")
                data = np.ascontiguousarray(data).reshape(-1)
            writer.write_tensor_data(data)
            del data
        writer.close()
        from .fsutil import file_mode
        os.chmod(tmp, file_mode())
        os.replace(tmp, out_path)
    except BaseException as e:
        try:
            writer.close()
        except OSError:
            pass   # the disk is full: closing flushes nothing more
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        from .fsutil import is_disk_full, no_space_message
        if is_disk_full(e):
            # the tensors (each padded to the alignment) and about the base GGUF's metadata
            # (the same keys and tensor names): a tokenizer's vocabulary can be most of a
            # small file
            total = sum(-(-p[4] // 32) * 32 for p in plan) + min(
                (int(t.data_offset) for t in reader.tensors), default=0)
            raise ExportError(no_space_message(out_path.parent, out_path.name, total)) from e
        raise
    return out_path


def _byte_shape(shape: list[int], raw: GGMLQuantizationType) -> list[int]:
    """Numpy-order element shape -> the uint8 byte shape GGUFWriter expects for ``raw``."""
    from gguf import GGML_QUANT_SIZES
    bs, ts = GGML_QUANT_SIZES[raw]
    return shape[:-1] + [shape[-1] // bs * ts]


def _add_scalar(writer: GGUFWriter, key: str, v: Any) -> None:
    if isinstance(v, bool):
        writer.add_bool(key, v)
    elif isinstance(v, np.uint32):   # llama-quantize's own integer keys (quantize.imatrix.*)
        writer.add_uint32(key, int(v))
    elif isinstance(v, int):
        writer.add_int64(key, v) if v < 0 else writer.add_uint64(key, v)
    elif isinstance(v, float):
        writer.add_float32(key, v)
    elif isinstance(v, str):
        writer.add_string(key, v)
    else:
        raise TypeError(f"extra_kv[{key!r}] must be bool, int, float or str, not "
                        f"{type(v).__name__}")


# ------------------------------------------------------------- llama-quantize recipe
def tensor_pattern(gguf_name: str) -> str:
    """An anchored regex matching exactly ``gguf_name``. llama-quantize matches
    ``--tensor-type`` names with ``std::regex_search`` (``llama_tensor_get_type`` in
    ``src/llama-quant.cpp``) after lower-casing them (``parse_tensor_type`` in
    ``tools/quantize/quantize.cpp``), so a bare ``blk.1.attn_q.weight`` would also match
    ``blk.11.attn_q.weight``."""
    if gguf_name != gguf_name.lower():
        raise ValueError(f"llama-quantize lower-cases tensor-type patterns; {gguf_name!r} "
                         "has upper-case letters and could not be matched")
    if any(c.isspace() for c in gguf_name) or "=" in gguf_name:
        raise ValueError(f"tensor name {gguf_name!r} cannot be written to a tensor-type file")
    return "^" + re.escape(gguf_name) + "$"


def write_tensor_type_file(assignment, path: str | os.PathLike,
                           base_gguf: str | os.PathLike | None = None) -> Path:
    """Writes a ``llama-quantize --tensor-type-file``: one ``<regex>=<type>`` per line
    (``parse_tensor_type_file`` in ``tools/quantize/quantize.cpp`` reads whitespace-separated
    ``name=type`` items), each regex anchored to one tensor (:func:`tensor_pattern`), the type
    being the assignment's ggml type name in lower case. Types are written as assigned;
    llama-quantize applies the same shape fallback export does.

    With ``base_gguf``, every other tensor llama-quantize would quantize (2-D and larger
    weights) is pinned to its type in the base, so it is copied as :func:`export_gguf` copies
    it instead of getting llama-quantize's default type.

    Note llama-quantize's ``--token-embedding-type`` / ``--output-tensor-type`` override these
    patterns; :func:`quantize_with_llama` does not pass them.

    Returns ``path``. Written atomically."""
    types = assignment_types(assignment)
    lines = [f"{tensor_pattern(n)}={t.lower()}" for n, t in types.items()]
    if base_gguf is not None:
        for t in read_gguf(base_gguf).tensors:
            if t.name not in types and len(t.shape) >= 2 and t.name.endswith("weight"):
                lines.append(f"{tensor_pattern(t.name)}="
                             f"{GGMLQuantizationType(t.tensor_type).name.lower()}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------- which model a GGUF is of
def model_id(name: str, sha256: str) -> str:
    """The ``voodoo.model`` KV of an exported GGUF: the model's name and the sha256 of its
    reference GGUF's bytes (the source GGUF for GGUF input, the base F32 GGUF for an HF
    folder; what KLD is measured against), e.g. ``SmolLM2-135M-Instruct@sha256:b179c952…``.
    Never a local path: the file may travel to other machines."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise ValueError(f"not a hex sha256: {sha256!r}")
    return f"{name}@sha256:{sha256}"


def parse_model_id(value: str) -> tuple[str, str | None]:
    """``"Name@sha256:<hex>"`` -> ``(name, hex)``; any other string (GGUFs from before the
    hash was recorded held a path) -> ``(value, None)``."""
    m = re.fullmatch(r"(.*)@sha256:([0-9a-f]{64})", value)
    return (m.group(1), m.group(2)) if m else (value, None)


def _index_dir() -> Path:
    from .llamacpp import cache_root
    return cache_root() / "models" / "by-sha256"


def record_model(prepared, sha256: str | None = None) -> str:
    """Remembers, in this machine's Voodoo cache (``<cache>/models/by-sha256/<sha256>.json``),
    which local model a content hash stands for, so ``voodoo eval --gguf`` / ``voodoo chat
    --reference`` find the reference of a GGUF whose ``voodoo.model`` names that hash.
    ``prepared``: a :class:`voodoo.models.PreparedModel`. ``sha256``: of its
    ``reference_gguf`` (computed when None). Returns :func:`model_id`. A cache that cannot be
    written (read-only, full) costs only the lookup: one warning, and the id is returned."""
    from .evaluate import _sha256_file
    from .fsutil import atomic_write_text
    sha = sha256 or _sha256_file(Path(prepared.reference_gguf))
    src = prepared.reference_gguf if prepared.source == "gguf" else prepared.hf_dir
    try:
        atomic_write_text(_index_dir() / f"{sha}.json", json.dumps(
            {"name": prepared.name, "model": str(Path(src).resolve()),
             "reference_gguf": str(Path(prepared.reference_gguf).resolve()),
             "source": prepared.source}, indent=1) + "\n")
    except OSError as e:
        log(f"warning: cannot record which model sha256 {sha[:12]}… is in "
            f"{_index_dir()} ({e.strerror or e}); `voodoo eval --gguf`/`chat --reference` "
            "will then need --model")
    return model_id(prepared.name, sha)


def find_model(value: str) -> str | None:
    """The local model argument (for :func:`voodoo.models.prepare_model`) that a recorded
    ``voodoo.model`` value stands for, or None when this machine does not have it.

    ``Name@sha256:<hex>``: the default model when the hash is its GGUF's (fetched from PyPI
    if needed), else the model :func:`record_model` indexed under that hash, if its reference
    file is still there (size and hash are not re-checked here; KLD runs hash it again).
    A plain existing path (older GGUFs) is returned as is."""
    name, sha = parse_model_id(value)
    if sha is None:
        return value if Path(value).exists() else None
    from .models import DEFAULT_MODEL_WHEEL, default_model
    if sha == DEFAULT_MODEL_WHEEL["gguf_sha256"]:
        return str(default_model())
    f = _index_dir() / f"{sha}.json"
    try:
        rec = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    # the reference may have been pruned from the cache (``voodoo doctor --prune_cache``):
    # preparing the model converts it again
    return rec["model"] if Path(rec.get("model", "")).exists() else None


def find_reference(value: str) -> Path | None:
    """The reference GGUF (unquantized, or the source GGUF) of a recorded ``voodoo.model``
    value on this machine, without preparing the model: the default model's GGUF, or the
    ``reference_gguf`` :func:`record_model` indexed under the hash. None when unknown."""
    name, sha = parse_model_id(value)
    if sha is None:
        p = Path(value)
        return p if p.is_file() and p.suffix.lower() == ".gguf" else None
    from .models import DEFAULT_MODEL_WHEEL, default_model
    if sha == DEFAULT_MODEL_WHEEL["gguf_sha256"]:
        return default_model()
    try:
        rec = json.loads((_index_dir() / f"{sha}.json").read_text())
    except (OSError, ValueError):
        return None
    p = Path(rec.get("reference_gguf", ""))
    return p if p.is_file() else None


def gguf_model_id(path: str | os.PathLike) -> str | None:
    """The ``voodoo.model`` value of a GGUF file, or None (not written by Voodoo)."""
    f = read_gguf(path).fields.get("voodoo.model")
    return None if f is None else str(f.contents())


def output_name(model_name: str, ratio_percent: float, bpw: float,
                badge: str | None = None) -> str:
    """The exported file's name: ``<Model>.Voodoo<ratio>_<badge>.gguf``, e.g.
    ``SmolLM2-135M-Instruct.Voodoo45_Q3_K_M.gguf``: ``ratio`` is the size budget as a percent
    (rounded to an integer) and ``badge`` the llama.cpp file type whose nominal bpw is nearest
    the file's (:func:`voodoo.quants.nearest_ftype`), unless given (``--match_size Q3_K_S``:
    the file type whose size the file matches)."""
    return f"{model_name}.Voodoo{int(round(ratio_percent))}_{badge or nearest_ftype(bpw)}.gguf"


def _weight_types(base_gguf: str | os.PathLike) -> dict[str, GGMLQuantizationType]:
    """GGUF name -> type of the base's weights (2+ dims) stored other than as F32."""
    return {t.name: GGMLQuantizationType(t.tensor_type) for t in read_gguf(base_gguf).tensors
            if len(t.shape) >= 2 and t.tensor_type != GGMLQuantizationType.F32}


def prequantized_tensors(base_gguf: str | os.PathLike) -> dict[str, str]:
    """GGUF name -> ggml type name of the weights (2+ dims) that the base GGUF holds already
    quantized: a checkpoint's own blocks that ``convert_hf_to_gguf.py`` repacks losslessly
    instead of dequantizing (gpt-oss's MXFP4 experts, ``conversion/gpt_oss.py``), or a
    quantized source GGUF. Empty for an all-float base (F32/F16/BF16). Reads the header only."""
    from gguf import GGML_QUANT_SIZES
    return {n: q.name for n, q in _weight_types(base_gguf).items()
            if GGML_QUANT_SIZES[q][0] > 1}


def requantize_args(base_gguf: str | os.PathLike) -> list[str]:
    """``["--allow-requantize"]`` when the base holds quantized weights
    (:func:`prequantized_tensors`): llama-quantize refuses to quantize such a tensor to another
    type without it (``requantizing from type %s is disabled``, ``src/llama-quant.cpp``); with
    it, it quantizes their dequantized values, which is what Voodoo's candidates are made from.
    Else ``[]``."""
    return ["--allow-requantize"] if prequantized_tensors(base_gguf) else []


def dequantized_copy(base_gguf: str | os.PathLike) -> Path:
    """The base GGUF with every weight stored other than as F32 (quantized:
    :func:`prequantized_tensors`; or F16/BF16) converted to F32 by libggml's ``to_float``,
    every other tensor and KV copied: the same model computed without llama.cpp's activation
    rounding for those tensors (the pre-flight comparison with transformers' float forward),
    and the weights :func:`voodoo.pipeline.base_weights` maps. Written once next to the base as
    ``<stem>.dequantized.gguf`` (atomically; rewritten when the base is newer); returns its
    path, or the base itself when all its weights are F32."""
    base_gguf = Path(base_gguf)
    other = _weight_types(base_gguf)
    if not other:
        return base_gguf
    out = base_gguf.with_name(base_gguf.stem + ".dequantized.gguf")
    if out.is_file() and out.stat().st_mtime_ns >= base_gguf.stat().st_mtime_ns:
        return out
    import cython_ggml as cg
    by_name = {t.name: t for t in read_gguf(base_gguf).tensors}

    def lookup(name: str, type_name: str) -> np.ndarray:
        t = by_name[name]
        raw = np.ascontiguousarray(np.asarray(t.data)).view(np.uint8).reshape(-1)
        return cg.dequantize(raw, other[name].name, int(t.shape[0])).view(np.uint8).reshape(-1)

    return export_gguf(base_gguf, {n: "F32" for n in other}, lookup, out,
                       file_type=int(LlamaFileType.ALL_F32))


def quantize_with_llama(base_gguf: str | os.PathLike, out: str | os.PathLike,
                        tensor_type_file: str | os.PathLike | None = None,
                        imatrix_file: str | os.PathLike | None = None,
                        default_type: str = "Q8_0", n_threads: int | None = None,
                        extra_args: Iterable[str] = (), timeout: float | None = None) -> Path:
    """Runs ``llama-quantize [--imatrix I] [--tensor-type-file T] base out <default_type>
    [n_threads]`` (the pinned build, :func:`voodoo.llamacpp.tool_path`), with
    ``--allow-requantize`` when the base holds quantized weights (:func:`requantize_args`).

    ``default_type`` must be a quantized llama.cpp file type (``Q8_0``, ``Q4_K_M``...):
    llama-quantize applies tensor-type patterns only when the default type is quantized.
    Tensors no pattern matches get llama.cpp's own mixture for that file type. Written to a
    temporary name and renamed into place.

    Raises:
        voodoo.llamacpp.LlamaCppNotBuilt: the tool is missing.
        ExportError: llama-quantize failed (the end of its output is in the message).
    """
    from .llamacpp import tool_path
    exe = tool_path("llama-quantize")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_partials(out)  # a SIGKILLed run's unfinished file
    tmp = out.with_name(f".{out.name}.{os.getpid()}.llama-quantize.partial")
    cmd = [str(exe)]
    if imatrix_file is not None:
        cmd += ["--imatrix", str(imatrix_file)]
    if tensor_type_file is not None:
        cmd += ["--tensor-type-file", str(tensor_type_file)]
    cmd += list(extra_args)
    if "--allow-requantize" not in cmd:
        cmd += requantize_args(base_gguf)
    cmd += [str(base_gguf), str(tmp), default_type]
    if n_threads:
        cmd.append(str(int(n_threads)))
    try:
        from .proc import die_with_parent
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           errors="replace", timeout=timeout, preexec_fn=die_with_parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if r.returncode:
        tmp.unlink(missing_ok=True)
        from .fsutil import free_mib, no_space_message
        free = free_mib(out.parent)
        # a full disk reads as "basic_ios::clear: iostream error" in llama-quantize's log
        if free is not None and free * 2**20 < Path(base_gguf).stat().st_size and (
                "iostream error" in r.stdout or "No space left" in r.stdout):
            raise ExportError(no_space_message(out.parent, f"{out.name} (llama-quantize)"))
        raise ExportError(f"llama-quantize failed (exit {r.returncode}): {' '.join(cmd)}\n"
                          + "\n".join(r.stdout.splitlines()[-25:]))
    os.replace(tmp, out)
    return out
