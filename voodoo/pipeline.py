"""The main job, stage by stage: model -> data -> imatrix -> menus -> candidates -> student ->
gate training -> bake -> export -> eval. No Ray here: the candidate stage takes a ``precache``
callable, which the CLI sets to the Ray actors of :mod:`cluster.precache` (or to
:func:`voodoo.candidates.precache_local`).

Each stage reads what the one before wrote, so each can run alone from the CLI. A run folder
(``--output_dir``) holds::

    data/               train.pt, eval.pt, meta.json          (voodoo data)
    imatrix.gguf        llama.cpp's GGUF imatrix format        (computed unless --imatrix)
    teacher/            bf16/ and q8_0/ checkpoints             (voodoo make-teacher)
    train/              partial.pt (journal), train_config.json
    <name>.assignment.json, <name>.gates.pt, <name>.gguf, <name>.tensor-types.txt
    eval/               report.json, report.md
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import quants
from .candidates import CandidateCache, CandidateJob
from .models import (PreparedModel, hf_from_pretrained, load_hf_model, prepare_model,
                     trust_remote_code)
from .progress import log
from .tensormap import MapEntry, TensorMap

__all__ = [
    "Context", "Timer", "load_context", "base_weights", "make_menus", "parse_types",
    "ensure_dataset", "ensure_imatrix", "ensure_hessians", "candidate_jobs", "ensure_candidates",
    "choose_rounding", "head_tensor", "head_inputs",
    "build_student", "build_teacher", "bytes_table", "selectable_budget", "train",
    "bake_assignment", "fill_margin", "export", "assign_student", "StudentFactory", "fisher_prior",
]


class Timer:
    """Wall time per stage, for the closing table of ``voodoo run``."""

    def __init__(self):
        self.stages: dict[str, float] = {}
        self.t0 = time.perf_counter()

    def __call__(self, name: str):
        timer = self

        class _S:
            def __enter__(self):
                self.t = time.perf_counter()
                log(f"--- {name}")

            def __exit__(self, *exc):
                timer.stages[name] = timer.stages.get(name, 0.0) + time.perf_counter() - self.t
        return _S()

    def report(self) -> str:
        total = time.perf_counter() - self.t0
        lines = ["| stage | seconds | share |", "| --- | ---: | ---: |"]
        for k, v in self.stages.items():
            lines.append(f"| {k} | {v:.1f} | {100 * v / total:.0f}% |")
        lines.append(f"| **total** | {total:.1f} | 100% |")
        return "\n".join(lines)


@dataclass
class Context:
    """A model ready for the later stages.

    ``tmap``: the tensor map derived from llama.cpp's converter (:mod:`voodoo.tensormap`);
    ``specs``: its entries (one per selectable GGUF tensor: ``gguf_name``, ``shape`` =
    ``(n_rows, n_per_row)`` with experts stacked as rows, ``role``, ``tp``); ``adapter``: the
    architecture's tensor-parallel policy when one is registered (None otherwise)."""

    prepared: PreparedModel
    tmap: TensorMap
    model: torch.nn.Module
    tokenizer: object = None
    adapter: object = None
    extra: dict = field(default_factory=dict)

    @property
    def specs(self) -> list[MapEntry]:
        return list(self.tmap.entries)

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        return {s.gguf_name: tuple(s.shape) for s in self.specs}


def load_context(model_arg, work_dir=None, with_tokenizer: bool = True,
                 converter_args=None, check: bool = True) -> Context:
    """Prepares ``model_arg`` (see :func:`voodoo.models.prepare_model`), loads it in float32 and
    derives its tensor map from llama.cpp's converter (:func:`voodoo.tensormap.derive_tensor_map`,
    cached), checked against the base F32 GGUF (``check``). ``converter_args``: extra
    ``convert_hf_to_gguf.py`` flags (default: what :func:`voodoo.models.converter_flags` says the
    model needs).

    Raises ModelPreparationError / UnsupportedArchitecture / TensorMapError with what to do."""
    from .tensormap import TensorMapError, check_against_base, derive_tensor_map
    prepared = prepare_model(model_arg, work_dir)
    model = load_hf_model(prepared)
    if converter_args is None:
        converter_args = getattr(prepared, "converter_args", None)
    if converter_args is None:
        converter_args = _needed_converter_flags(prepared)
    tmap = derive_tensor_map(model, prepared.hf_dir, converter_args)
    if check:
        try:
            check_against_base(tmap, model, base_weights(prepared.base_gguf, names=tmap.names))
        except TensorMapError as e:
            base = Path(prepared.base_gguf)
            if base.name != "base-f32.gguf" or base.resolve() == Path(model_arg).resolve():
                raise
            # a derived file Voodoo wrote: damaged on disk, or the map is wrong. Converting
            # again tells the two apart (a second disagreement is the map's)
            log(f"{str(e).split('; the map')[0]}: converting the model again in case the "
                f"cached {base} is damaged")
            base.unlink(missing_ok=True)
            prepared = prepare_model(model_arg, work_dir)
            check_against_base(tmap, model, base_weights(prepared.base_gguf, names=tmap.names))
            log(f"the new {base.name} agrees with the model: the cached one was damaged")
        _warn_unmapped(tmap, prepared.base_gguf)
    adapter = _tp_adapter(model, tmap)
    tok = None
    if with_tokenizer:
        from transformers import AutoTokenizer
        tok = hf_from_pretrained(AutoTokenizer, prepared.hf_dir)
    return Context(prepared, tmap, model, tok, adapter)


def _warn_unmapped(tmap, base_gguf) -> list[str]:
    """Names (and says, in one line) the base GGUF's tensors that llama-quantize would quantize
    but the tensor map does not hold: the export would copy them from the base as they are
    (F32), outside every menu and budget. Returns their names."""
    from .ggufio import read_gguf
    from .tensormap import quantize_rule
    rule = quantize_rule()
    known = set(tmap.names) | set(tmap.other)
    miss = []
    for t in read_gguf(base_gguf).tensors:
        shape = tuple(int(x) for x in reversed(list(t.shape)))
        if t.name not in known and rule.allows(t.name, shape, tmap.arch):
            miss.append((t.name, int(t.n_bytes)))
    if miss:
        log(f"warning: {len(miss)} tensor(s) of {Path(base_gguf).name} that llama-quantize "
            f"would quantize are not in the tensor map ({', '.join(n for n, _ in miss[:4])}"
            f"{', ...' if len(miss) > 4 else ''}; {sum(b for _, b in miss) / 2**20:.1f} MiB): "
            "the export copies them unquantized, outside the budget. The model's converter "
            "wrote them for the real weights and not for the probe checkpoints; please report "
            "it with the model's config.json")
    return [n for n, _ in miss]


def _needed_converter_flags(prepared: PreparedModel) -> list[str]:
    try:
        from .models import converter_flags
    except ImportError:
        return []
    try:
        cfg = json.loads((Path(prepared.hf_dir) / "config.json").read_text())
        from .llamacpp import source_dir
        return list(converter_flags(cfg, source_dir()))
    except Exception:  # noqa: BLE001 -- flags are an optimisation of the converter's defaults
        return []


def _tp_adapter(model, tmap: TensorMap):
    """The registered tensor-parallel adapter of the model's architecture, its policy copied
    onto the map's entries (``tp``); None when the architecture has none or its tensors are not
    the adapter's plain Linear/Embedding layout."""
    from .arch import UnsupportedArchitecture, get_adapter
    try:
        adapter = get_adapter(model.config)
        specs = {s.gguf_name: s for s in adapter.selectable(model)}
    except (UnsupportedArchitecture, ValueError):
        return None
    if set(specs) != set(tmap.names):
        return None
    for e in tmap:
        e.tp = specs[e.gguf_name].tp
    return adapter


def legacy_specs(ctx: Context) -> list:
    """The adapter's TensorSpecs (module names, TP policy), for the tensor-parallel student.
    Raises ValueError when the architecture has no tensor-parallel adapter."""
    if ctx.adapter is None:
        raise ValueError(f"no tensor-parallel policy for {ctx.tmap.hf_arch}; tensor parallelism "
                         "needs one (voodoo/arch/). Use --device_map to spread the layers over "
                         "several GPUs instead")
    return ctx.adapter.selectable(ctx.model)


def load_base_checkpoint(ctx: Context, path) -> None:
    """Loads the weights of an HF folder (e.g. ``voodoo make-teacher``'s ``bf16/``) into
    ``ctx.model`` in float32 (``--base_checkpoint``): the student's frozen weights and the
    teacher's come from it; candidates still come from the base F32 GGUF.

    Raises ValueError when the folder lacks weights (ModelPreparationError) or its tensors do
    not match the model's names and shapes."""
    from transformers import AutoModelForCausalLM

    from .models import refuse_missing_weights
    other, info = hf_from_pretrained(AutoModelForCausalLM, path, dtype=torch.float32,
                                     output_loading_info=True)
    refuse_missing_weights(f"--base_checkpoint {path}", info)
    other = other.state_dict()
    mine = ctx.model.state_dict()
    bad = [k for k in mine if k not in other or other[k].shape != mine[k].shape]
    if bad:
        raise ValueError(f"--base_checkpoint {path} does not match the model: {bad[0]} "
                         f"(and {len(bad) - 1} more) missing or of another shape")
    ctx.model.load_state_dict({k: other[k] for k in mine})


def base_weights(base_gguf, names=None) -> dict[str, np.ndarray]:
    """GGUF name -> float32 ``(n_rows, n_per_row)`` view (memory-mapped) of every tensor of at
    least 2 dims of the base GGUF, in GGUF layout; a 3-D tensor (stacked experts) has its
    experts' rows stacked. ``names``: only these.

    Weights the base holds in another type than F32 -- a checkpoint's own blocks that
    ``convert_hf_to_gguf.py`` repacks losslessly instead of dequantizing (gpt-oss's MXFP4
    experts: ``repack_mxfp4`` in the pinned ``conversion/gpt_oss.py``) -- are read from the
    base's dequantized copy (:func:`voodoo.export.dequantized_copy`, libggml's ``to_float``,
    written once): the values ``llama-quantize --allow-requantize`` quantizes from."""
    from gguf import GGMLQuantizationType

    from .export import dequantized_copy
    from .ggufio import read_gguf
    want = set(names) if names is not None else None
    return {t.name: np.asarray(t.data).reshape(-1, int(t.shape[0]))
            for t in read_gguf(dequantized_copy(base_gguf)).tensors
            if (want is None or t.name in want) and len(t.shape) >= 2
            and t.tensor_type == GGMLQuantizationType.F32}


def parse_types(text: str | Sequence[str] | None) -> list[str] | None:
    """``"Q8_0,Q6_K IQ4_XS"`` -> ``["Q8_0", "Q6_K", "IQ4_XS"]`` (validated; None passes)."""
    if text is None:
        return None
    items = text.replace(",", " ").split() if isinstance(text, str) else list(text)
    if not items:
        raise ValueError("an empty list of candidate types: give ggml type names, e.g. "
                         "--candidate_types Q8_0,Q4_K,IQ4_XS, or leave the flag out for the "
                         "default menus")
    return [quants.qtype(t).name for t in items]


def make_menus(specs: Sequence[MapEntry], candidate_types=None, attention_candidates=None,
               non_attention_candidates=None) -> dict[str, list[str]]:
    """Per tensor, its menu of type names after llama.cpp's shape fallbacks, deduplicated, most
    to fewest bpw (:func:`voodoo.quants.build_menu`). ``candidate_types`` applies to every
    tensor; the per-role lists override it for their role (the adapter says which tensors are
    attention-side).

    Raises ValueError for an unknown type or a menu that ends up empty."""
    base = parse_types(candidate_types)
    attn = parse_types(attention_candidates) or base or list(quants.DEFAULT_ATTENTION_MENU)
    other = parse_types(non_attention_candidates) or base or \
        list(quants.DEFAULT_NON_ATTENTION_MENU)
    menus = {}
    for s in specs:
        types = attn if s.role == "attention" else other
        menus[s.gguf_name] = [q.name for q in quants.build_menu(types, s.n_per_row)]
    return menus


def bytes_table(specs: Sequence[MapEntry], menus: Mapping[str, Sequence[str]]
                ) -> dict[str, list[int]]:
    """gguf_name -> bytes of the tensor as each menu type (:func:`voodoo.quants.tensor_nbytes`)."""
    return {s.gguf_name: [quants.tensor_nbytes(t, s.n_rows, s.n_per_row)
                          for t in menus[s.gguf_name]] for s in specs}


def selectable_budget(specs, compression_ratio=None, target_bits=None, budget_reduction=0.0,
                      budget_bytes_=None) -> int:
    """The budget in bytes over the selectable tensors (see :func:`voodoo.budget.budget_bytes`);
    ``budget_bytes_`` wins when given."""
    from .budget import budget_bytes
    if budget_bytes_ is not None:
        return int(budget_bytes_)
    shapes = {s.gguf_name: tuple(s.shape) for s in specs}
    return int(budget_bytes(shapes, compression_ratio=compression_ratio,
                            target_bits=target_bits, budget_reduction=budget_reduction))


def file_overhead_bytes(ctx: Context) -> int:
    """Bytes an exported GGUF holds besides the selectable tensors' data: the base F32 GGUF's
    size less its selectable tensors' F32 bytes (header, metadata, tokenizer, norms and other
    tensors kept as they are). Alignment padding of quantized tensors (< 32 bytes each) and
    the few KV pairs export adds are not counted (a few KB)."""
    sel = sum(4 * s.n_rows * s.n_per_row for s in ctx.specs)
    return os.path.getsize(ctx.prepared.base_gguf) - sel


# ------------------------------------------------------------------------------- data
def rebuild_keeping_previous(data_dir, build):
    """Rebuilds the dataset in ``data_dir`` keeping the one there as ``<data_dir>.previous``
    (one generation), so what was trained or exported on the old blocks stays usable.
    ``build(folder)`` writes a dataset into ``folder``: here ``<data_dir>.new``, swapped in
    once complete. When the rebuilt ``train.pt``/``eval.pt`` have the sha256 of those in
    ``data_dir`` (its ``meta.json``), nothing moves and an older ``.previous`` stays. When
    ``build`` raises (Ctrl-C included), ``data_dir`` is as it was. Returns what ``build``
    returns."""
    data_dir = Path(data_dir)
    keep = data_dir.with_name(data_dir.name + ".previous")
    new = data_dir.with_name(data_dir.name + ".new")
    shutil.rmtree(new, ignore_errors=True)  # a rebuild killed before its swap

    def files(d):
        try:
            return json.loads((d / "meta.json").read_text()).get("files")
        except (OSError, ValueError):
            return None
    try:
        out = build(new)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    old_files = files(data_dir)
    if old_files and old_files == files(new):
        # the same blocks again: the folder stays, its meta (sizes asked) from this build
        os.replace(new / "meta.json", data_dir / "meta.json")
        shutil.rmtree(new, ignore_errors=True)
        return out
    if data_dir.exists():
        if keep.exists():
            shutil.rmtree(keep)
        data_dir.rename(keep)
        log(f"the previous dataset is kept in {keep} (move it back to {data_dir} to "
            "export or resume what was made from it)")
    new.rename(data_dir)
    return out


def ensure_dataset(ctx: Context, data_dir, source="enwiki", seq_len=512, n_train=64,
                   n_eval=8, seed=0, up_to=False):
    """Loads ``data_dir`` if it holds a dataset with ``seq_len`` and enough blocks, else builds
    it (:func:`voodoo.data.build_dataset`); a folder built from a local text file that has
    changed since (its sha256 in meta.json) is rebuilt. ``up_to``: ``n_train`` is a cap (as
    many train blocks as the text holds, up to it; a folder built that way with the same cap,
    or one with at least that many, is reused), else a demand. A dataset that is rebuilt is
    kept as ``<data_dir>.previous`` (one generation; put back when the rebuild fails), so what
    was trained on it can still be exported or resumed. Returns (train, eval, meta)."""
    from .data import DatasetError, build_dataset, load_dataset_dir
    data_dir = Path(data_dir)
    want = int(n_train)
    keep = False
    if (data_dir / "meta.json").is_file():
        try:
            from .data import local_source_description, tokenizer_fingerprint
            tr, ev, meta = load_dataset_dir(data_dir)
            now = local_source_description(source)  # a local file: as it is now
            edited = (now is not None and meta.get("source_arg") == str(source)
                      and meta.get("source") != now)  # this file, changed since
            same = (meta.get("source_arg") == str(source) and meta.get("seed") == seed and
                    (meta.get("tokenizer") or {}).get("sha256") ==
                    tokenizer_fingerprint(ctx.tokenizer)["sha256"] and not edited)
            enough = tr.shape[0] >= want or (
                up_to and meta.get("n_train_blocks_asked") == f"up to {want}")
            if same and tr.shape[1] == seq_len and enough and ev.shape[0] >= n_eval:
                return tr[:want], ev[:n_eval], meta
            log(f"{data_dir} holds {tr.shape[0]} train blocks of {tr.shape[1]} tokens from "
                f"{meta.get('source_arg', meta.get('source'))!r} (seed {meta.get('seed')})"
                f"{' as it was before an edit' if edited else ''}; "
                f"rebuilding for {source!r}, seq_len={seq_len}, "
                f"{f'up to {want}' if up_to else want} train blocks, seed {seed}")
            keep = True
        except DatasetError as e:
            log(f"{data_dir}: {e}; rebuilding")

    def build(folder):
        build_dataset(ctx.tokenizer, source, folder, seq_len=seq_len, n_train_blocks=want,
                      n_eval_blocks=n_eval, seed=seed, up_to=up_to)
    if keep:
        rebuild_keeping_previous(data_dir, build)
    else:
        build(data_dir)
    tr, ev, meta = load_dataset_dir(data_dir)
    if up_to and tr.shape[0] < want:
        log(f"the text holds {tr.shape[0]} train blocks of {seq_len} "
            f"tokens after the {ev.shape[0]} eval blocks; using all {tr.shape[0]} (up to {want} "
            "with a longer --data_name text)")
    return tr, ev, meta


# ----------------------------------------------------------------------------- imatrix
def _linear_name_map(ctx: Context, partial: bool = False) -> dict[str, str] | None:
    """HF ``nn.Linear`` module name -> GGUF name, when every selectable tensor is read by
    llama.cpp as a matmul whose input is exactly some Linear's input: its one link reads a
    Linear's weight, not transposed, with the columns in order (then the squared input
    activations of that Linear are the tensor's imatrix). Tied embeddings count through their
    Linear head. None when some tensor is not like that (stacked experts, fused 3-D parameters,
    column permutations): the imatrix then comes from llama-imatrix itself. ``partial=True``
    skips such tensors instead (the map covers the plain ones)."""
    owners: dict[int, list[str]] = {}
    for mname, mod in ctx.model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            owners.setdefault(id(mod.weight), []).append(mname)
    params = dict(ctx.model.named_parameters(remove_duplicate=True))
    out = {}
    for e in ctx.tmap:
        if len(e.links) != 1 or len(e.gguf_shape) != 2:
            if partial:
                continue
            return None
        lk = e.links[0]
        if lk.transpose or lk.cols is not None or params[lk.param].dim() != 2:
            if partial:
                continue
            return None
        mods = owners.get(id(params[lk.param]))
        if not mods:
            if e.gguf_name.startswith("token_embd") or partial:
                continue  # an embedding without a Linear head is a get_rows: no imatrix entry
            return None
        for m in mods:
            out[m] = e.gguf_name
    return out


def ensure_imatrix(ctx: Context, path, blocks: torch.Tensor | None = None,
                   imatrix_file=None, dataset_name: str = "voodoo") -> dict[str, np.ndarray]:
    """The imatrix as llama-quantize uses it: gguf_name -> float32 (n_per_row,), or
    (n_expert, n_per_row) for stacked experts.

    ``imatrix_file`` given: read it (llama.cpp's GGUF form or legacy ``.dat``). Otherwise
    ``path`` is reused when it exists, else computed from ``blocks`` (calibration tokens) and
    saved at ``path`` in llama.cpp's GGUF format, so ``llama-quantize --imatrix`` can use the
    very same file: in torch (mean squared input activation per column of each selectable
    Linear, as llama-imatrix does) when every selectable tensor is a plain Linear's weight, else
    by ``llama-imatrix`` itself on the base F32 GGUF (experts get one vector each)."""
    from .imatrix import compute_imatrix, read_imatrix, write_imatrix_gguf
    if imatrix_file:
        im = read_imatrix(imatrix_file)
        names = _linear_name_map(ctx, partial=True)
        want = sorted(g for g in (names or {}).values() if g.startswith("blk."))
        missing = [g for g in want if g not in im]
        if missing:
            import warnings
            warnings.warn(
                f"--imatrix {imatrix_file} has no entry for {len(missing)} of the "
                f"{len(want)} matmul weights in this model's blocks (e.g. {missing[0]}); "
                "llama-imatrix run on this model records every one: was it made for another "
                "model? Those tensors are quantized without an imatrix, and the types that "
                "need one are left out of their menus", stacklevel=2)
        return im
    path = Path(path)
    if path.is_file():
        return read_imatrix(path)
    if blocks is None:
        raise ValueError("no imatrix file and no calibration blocks to compute one")
    names = _linear_name_map(ctx)
    if names is None:
        log(f"computing the imatrix with llama-imatrix on {blocks.shape[0]} x "
            f"{blocks.shape[1]} calibration tokens")
        from .imatrix import llama_imatrix
        llama_imatrix(ctx.prepared.base_gguf, blocks, path, ctx.tokenizer)
        return read_imatrix(path)
    log(f"computing the imatrix on {blocks.shape[0]} x {blocks.shape[1]} calibration tokens")
    sums, counts = compute_imatrix(ctx.model, blocks, names, progress=True)
    write_imatrix_gguf(path, sums, counts, datasets=[dataset_name],
                       chunk_count=int(blocks.shape[0]), chunk_size=int(blocks.shape[1]))
    return read_imatrix(path)


def shared_imatrix(path, inputs: dict, keep: bool = False) -> Path | None:
    """The Voodoo cache's copy of a computed imatrix (``<cache>/imatrix/<hash of inputs>.gguf``,
    ``inputs``: the model and the calibration tokens' sha256, :meth:`Run.imatrix_inputs`), so
    that another run folder with the same model and tokens does not compute it again (45-60 s
    for SmolLM2 on 2 cores; llama-imatrix's minutes for a larger model). ``keep=False``: when
    the cache has a readable one, it is placed at ``path`` (a hard link where the file systems
    allow) and returned; else None. ``keep=True``: ``path`` (just computed) is put in the cache
    (a read-only or full cache costs only the reuse). Raises OSError (ENOSPC, naming
    ``path``) only when the run folder has no room for the cache's copy: computing it anew
    would fail there too."""
    from .imatrix import read_imatrix
    want = json.dumps({**{k: v for k, v in inputs.items() if k != "sha256"},
                       "imatrix_version": 1}, sort_keys=True)
    shared = _cache_file("imatrix", want, ".gguf")
    path = Path(path)
    from .fsutil import atomic_write_text, sha256_file
    record = shared.with_suffix(".json")  # its sha256: a copy edited in place is not served
    if keep:
        try:
            _link_or_copy(path, shared)
            atomic_write_text(record, json.dumps({"inputs": want, "sha256": sha256_file(path)}))
        except OSError as e:
            log(f"could not keep the imatrix in the cache ({shared}: {e.strerror or e})")
        return shared
    if "tokens" not in inputs or not shared.is_file():
        return None
    try:
        if json.loads(record.read_text()).get("sha256") != sha256_file(shared):
            raise ValueError("its bytes changed since it was kept")
        read_imatrix(shared)
        _link_or_copy(shared, path)
    except (OSError, ValueError) as e:  # damaged: computed anew
        from .fsutil import is_disk_full
        if is_disk_full(e):   # the run folder is full: computing it would fail there too
            import errno
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e
        log(f"the cache's imatrix {shared} could not be used ({e}); computing it")
        return None
    log(f"imatrix: taken from the cache ({shared}), made from the same model and calibration "
        "tokens")
    return shared


# ------------------------------------------------------------------- input Hessians
def ensure_hessians(ctx: Context, path, blocks: torch.Tensor | None = None,
                    inputs: dict | None = None, label: str = "input Hessians"
                    ) -> dict[str, np.ndarray]:
    """The input Hessians for ``--rounding gptq``: gguf_name -> float32 (n_per_row,
    n_per_row) (:func:`voodoo.imatrix.compute_hessians` on the calibration ``blocks``), for
    every selectable tensor that llama.cpp reads as a plain matmul of some ``nn.Linear``'s
    input. A tied ``token_embd`` gets its output head's input Hessian: its get_rows use is not
    weighted by it, but the head's error dominates the KL (SmolLM2's tied Q8_0-born embedding,
    real KL on held-out enwiki blocks: Q5_1 0.0078 -> 0.0055, Q5_0 0.0166 -> 0.0095, IQ4_NL
    0.055 -> 0.030 nats/token with error feedback). Saved at ``path`` (``.npz``, atomically)
    with ``inputs`` (what they were made from, e.g. model and tokens) and reused while
    ``inputs`` match. ``label``: what the log line and the progress bar call them (e.g.
    ``"held-out Hessians"``).

    With ``inputs`` given, the file is also kept in the Voodoo cache
    (``<cache>/hessians/<hash of inputs>.npz``, a hard link where the file systems allow, so
    no second copy on disk): another run folder with the same model and calibration tokens
    takes it from there instead of computing it again (the largest stage of a CPU run).

    Raises ValueError when the file is missing or stale and no ``blocks`` are given."""
    from .imatrix import compute_hessians
    path = Path(path)
    # version 2: a tied embedding's head Hessian included; 3: inputs shared by identity, not
    # by address (older files gave later layers an early layer's Hessian)
    want = json.dumps({**(inputs or {}), "hessians_version": 3}, sort_keys=True)
    import zipfile
    unreadable = (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError)
    if path.is_file():
        try:
            got = load_hessians(path, want)
        except unreadable as e:
            log(f"{path} is unreadable ({type(e).__name__}: {e}: a damaged or cut-off file); "
                "recomputing it")
        else:
            if got is not None:
                return got
            log(f"{path} was made from other inputs; recomputing it")
    shared = _cache_file("hessians", want, ".npz") if inputs else None
    if shared is not None and shared.is_file():
        try:
            got = load_hessians(shared, want)
        except unreadable:
            got = None
        if got is not None:
            log(f"{label}: taken from the cache ({shared}), made from the same model and "
                "calibration tokens")
            try:
                _link_or_copy(shared, path)
            except OSError as e:   # e.g. a full run folder: the cache's copy serves
                log(f"could not place {label} in {path} ({e.strerror or e}); the cache's copy "
                    "is used")
            return got
        log(f"{shared} is damaged; computing {label} again")
        shared.unlink(missing_ok=True)
    if blocks is None:
        raise ValueError("no input Hessians file and no calibration blocks to compute one")
    names = dict(_linear_name_map(ctx, partial=True) or {})
    log(f"computing {label} of {len(set(names.values()))} tensors on {blocks.shape[0]} "
        f"x {blocks.shape[1]} tokens")
    hs = compute_hessians(ctx.model, blocks, names, progress=label)
    first: dict[int, str] = {}  # tensors sharing one input (q/k/v) share one array
    alias = {g: first.setdefault(id(h), g) for g, h in hs.items()}

    def save(target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.partial-{os.getpid()}.npz")
        try:
            np.savez(tmp, __inputs__=np.array(want), __alias__=np.array(json.dumps(alias)),
                     **{g: h for g, h in hs.items() if alias[g] == g})
            os.replace(tmp, target)
        except BaseException:   # a full disk, Ctrl-C: no half-written file left behind
            tmp.unlink(missing_ok=True)
            raise

    try:
        save(path)
    except OSError:
        if shared is None:
            raise
        save(shared)   # the run folder is full: the cache keeps them (or this raises too)
        log(f"could not write {path}; {label} kept in the cache ({shared})")
        return hs
    if shared is not None:
        try:
            _link_or_copy(path, shared)
        except OSError as e:   # a read-only or full cache costs only the reuse
            log(f"could not keep {label} in the cache ({shared}: {e.strerror or e})")
    return hs


def _cache_file(kind: str, want: str, suffix: str) -> Path:
    """``<cache>/<kind>/<sha256 of want>[:32]<suffix>``: where a derived file made from the
    inputs ``want`` (their JSON) is shared between run folders (Hessians, imatrix, rounding
    scores)."""
    from .llamacpp import cache_root
    import hashlib
    return cache_root() / kind / f"{hashlib.sha256(want.encode()).hexdigest()[:32]}{suffix}"


def _link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` becomes the same file as ``src``: a hard link (no second copy on disk), else a
    copy; atomically (a temporary name, then renamed)."""
    import shutil
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.partial-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_hessians(path, inputs: str | None = None) -> dict[str, np.ndarray] | None:
    """Reads :func:`ensure_hessians`' file: gguf_name -> float32 (n, n); None when
    ``inputs`` (its JSON) is given and differs from the file's."""
    with np.load(path, allow_pickle=False) as z:
        if inputs is not None and str(z["__inputs__"]) != inputs:
            return None
        arrays = {k: z[k] for k in z.files if not k.startswith("__")}
        alias = json.loads(str(z["__alias__"])) if "__alias__" in z.files else {}
    return {**arrays, **{g: arrays[o] for g, o in alias.items()}}


# -------------------------------------------------------------------------- candidates
def candidate_jobs(ctx: Context, menus, imatrix, weights=None,
                   hessians=None, feedback=None) -> list[CandidateJob]:
    """One job per (tensor, menu type): weights in GGUF layout from the base F32 GGUF.
    ``hessians`` (gguf_name -> (n_per_row, n_per_row)): those tensors' candidates get
    error-feedback rounding (``--rounding gptq``). ``feedback`` (gguf_name -> types, from
    :func:`choose_rounding`; ``--rounding auto``): only those (tensor, type) pairs do, the
    others keep llama-quantize's bytes."""
    weights = weights if weights is not None else base_weights(ctx.prepared.base_gguf,
                                                               names=ctx.tmap.names)
    jobs = []
    for s in ctx.specs:
        w = weights.get(s.gguf_name)
        if w is None:
            raise KeyError(f"{s.gguf_name} is not an F32 2-D tensor of {ctx.prepared.base_gguf}")
        row = imatrix.get(s.gguf_name) if imatrix else None
        h = hessians.get(s.gguf_name) if hessians else None
        if h is not None and (h.shape != (w.shape[1], w.shape[1]) or
                              (row is not None and np.ndim(row) != 1)):
            h = None  # stacked experts or another layout: llama-quantize's rounding
        for t in menus[s.gguf_name]:
            ht = h if feedback is None or t in feedback.get(s.gguf_name, ()) else None
            jobs.append(CandidateJob(s.gguf_name, w, t, row, ht))
    return jobs


def ensure_candidates(ctx: Context, menus, imatrix, cache: CandidateCache,
                      precache: Callable | None = None,
                      hessians=None, feedback=None) -> dict[tuple[str, str], object]:
    """Quantizes every (tensor, menu type) not yet in ``cache``; returns {(name, type): key}.

    ``precache(jobs, cache)``: the executor (Ray actors or :func:`precache_local`).
    ``hessians``, ``feedback``: see :func:`candidate_jobs`."""
    from .candidates import precache_local
    jobs = candidate_jobs(ctx, menus, imatrix, hessians=hessians, feedback=feedback)
    run = precache or precache_local
    return dict(run(jobs, cache))


def head_tensor(ctx: Context) -> str | None:
    """The GGUF name of ``ctx.model``'s output head (a tied ``token_embd`` or ``output``), or
    None when the head is not a plain matmul of one GGUF tensor."""
    head = ctx.model.get_output_embeddings()
    if head is None:
        return None
    names = _linear_name_map(ctx, partial=True) or {}
    mname = next((m for m, mod in ctx.model.named_modules() if mod is head), None)
    return names.get(mname)


@torch.no_grad()
def head_inputs(ctx: Context, blocks: torch.Tensor, max_tokens: int = 4096,
                logit_map: bool = False):
    """The inputs of ``ctx.model``'s output head (the final hidden states) over ``blocks``
    (LongTensor (n, seq_len); at most ``max_tokens`` tokens): float32 (n_tokens, hidden).

    With ``logit_map``: ``(x, m)``, ``m`` the elementwise map from the head's output to the
    model's logits (:func:`voodoo.rounding.fit_logit_map` on the first block's tokens: a final
    scale or softcap, whatever the model's forward does after the head), or None, with a line,
    when the logits are no such map of it."""
    from .rounding import fit_logit_map
    head = ctx.model.get_output_embeddings()
    xs: list[torch.Tensor] = []
    zs: list[torch.Tensor] = []

    def hook(_mod, args):
        xs.append(args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu())

    def out_hook(_mod, _args, out):
        if logit_map and not zs:
            zs.append(out.detach().reshape(-1, out.shape[-1]).float().cpu())
    handle = head.register_forward_pre_hook(hook)
    handle_out = head.register_forward_hook(out_hook)
    dev = next(ctx.model.parameters()).device
    fmap, fitted = None, False
    try:
        n = 0
        for i in range(len(blocks)):
            if n >= max_tokens:
                break
            out = ctx.model(input_ids=blocks[i: i + 1].to(dev), use_cache=False)
            if logit_map and not fitted and zs:
                fitted = True
                lg = getattr(out, "logits", None)
                z = zs[0]
                if lg is not None and tuple(lg.reshape(-1, lg.shape[-1]).shape) == tuple(z.shape):
                    lg = lg.detach().reshape(-1, lg.shape[-1]).float().cpu()
                    rows = torch.arange(0, z.shape[0], max(1, z.shape[0] // 16))
                    fmap = fit_logit_map(z[rows].numpy(), lg[rows].numpy())
                if fmap is None:
                    log("rounding choice: the model's logits are not a scale or softcap of "
                        "its head's output; the head's KL is scored on the head's output")
                zs.clear()
            n += int(blocks.shape[1])
    finally:
        handle.remove()
        handle_out.remove()
    x = torch.cat(xs)[:max_tokens].numpy()
    return (x, fmap) if logit_map else x


def _shared_rounding(heldout_id: str) -> tuple[Path, dict]:
    """The Voodoo cache's scores of :func:`choose_rounding` for ``heldout_id``
    (``<cache>/rounding/<hash>.json``: ``"<ggml key>:<feedback key>:<proxy>"`` -> ``[ggml,
    feedback]``), and its path; ``{}`` when it is missing or unreadable."""
    return _shared_rounding_at(_cache_file("rounding", heldout_id, ".json"))


def _keep_rounding(shared_path: Path | None, table: dict) -> None:
    """Merges a run's scored pairs (``rounding.json``'s ``tensors``) into the cache's file
    (atomically; a read-only or full cache costs only the reuse)."""
    if shared_path is None:
        return
    _, have = _shared_rounding_at(shared_path)
    for by_type in table.values():
        for ent in by_type.values():
            have[f"{ent['ggml_key']}:{ent['feedback_key']}:{ent['proxy']}"] = [ent["ggml"],
                                                                             ent["feedback"]]
    from .fsutil import atomic_write_text
    try:
        atomic_write_text(shared_path, json.dumps(have))
    except OSError as e:
        log(f"could not keep the rounding scores in the cache ({shared_path}: {e.strerror or e})")


def _shared_rounding_at(p: Path) -> tuple[Path, dict]:
    """``(p, the scores in the JSON file p)``; ``{}`` when it is missing or unreadable."""
    try:
        got = json.loads(p.read_text())
    except (OSError, ValueError):
        return p, {}
    return p, got if isinstance(got, dict) else {}


def choose_rounding(ctx: Context, menus, imatrix, cache: CandidateCache, hessians, heldout,
                    precache: Callable | None = None, path=None,
                    heldout_id: str = "", head=None) -> dict[str, list[str]]:
    """``--rounding auto``: for every (tensor, menu type), llama-quantize's bytes or the
    error-feedback bytes (fit on ``hessians``), whichever has the smaller output-error proxy
    ``tr(E H E^T)`` (:func:`voodoo.rounding.proxy_error`) on ``heldout``: input Hessians of
    calibration blocks the fit did not see. Ties keep llama-quantize's bytes.

    Both kinds are quantized into ``cache`` (``precache`` as in :func:`ensure_candidates`).
    ``path``: a JSON file of the choices and proxies (written atomically), reused per pair
    while both candidates' keys and ``heldout_id`` (what the held-out Hessians were made from)
    match. Tensors without a Hessian in both dicts (``token_embd``, stacked experts) and
    block-size-1 types keep llama-quantize's bytes.

    ``head``: ``(gguf_name, x)`` of the output head (:func:`head_tensor`) and its held-out
    inputs (float32 (n_tokens, n_per_row), :func:`head_inputs`, or ``(x, logit_map)``; or a
    function returning either, called only when a head candidate needs scoring): that tensor
    is scored by the logits' KL
    (:func:`voodoo.rounding.logit_kl`) instead, since the plain proxy weighs every vocabulary
    row alike (SmolLM2's tied Q8_0-born embedding at Q5_1: the plain held-out proxy 47.9 vs
    48.5 calls the two roundings even, while the error-feedback bytes cut the model's real KL
    on those blocks from 0.0078 to 0.0055 and the whole IQ4_XS-size file's KLD in llama.cpp
    from 0.0309 to 0.0287).

    Returns gguf_name -> the types whose error-feedback bytes win (the ``feedback`` argument
    of :func:`ensure_candidates`)."""
    from .rounding import logit_kl, proxy_error
    head_name, head_x = head if head is not None else (None, None)
    keys_g = ensure_candidates(ctx, menus, imatrix, cache, precache)
    keys_f = ensure_candidates(ctx, menus, imatrix, cache, precache, hessians=hessians)
    path = Path(path) if path is not None else None
    saved: dict = {}
    if path is not None and path.is_file():
        try:
            saved = json.loads(path.read_text())
        except ValueError:
            saved = {}
        if saved.get("heldout") != heldout_id:
            saved = {}
    table = saved.get("tensors", {})
    todo = []  # (spec, type, kind): the pairs whose saved score is missing or stale
    eligible = 0
    for s in ctx.specs:
        n = s.gguf_name
        hh = heldout.get(n) if heldout else None
        for t in menus[n]:
            kg, kf = keys_g[(n, t)], keys_f[(n, t)]
            if kf.rounding == "ggml" or (hh is None and n != head_name):
                continue
            eligible += 1
            kind = "logit_kl" if n == head_name else "output_error"
            ent = table.get(n, {}).get(t)
            if ent and ent.get("ggml_key") == kg.digest and \
                    ent.get("feedback_key") == kf.digest and ent.get("proxy") == kind:
                continue
            todo.append((s, t, kind))
    weights = None
    changed = False
    from .progress import Progress
    kept = eligible - len(todo)  # scored by an interrupted earlier run (rounding.json)
    if todo and kept and path is not None:
        log(f"rounding choice: {kept} (tensor, type) pairs already scored in {path.name}; "
            f"{len(todo)} to score")
    shared_path, shared = _shared_rounding(heldout_id) if path is not None else (None, {})
    if todo and shared:  # scored by another run folder with the same held-out blocks
        left = []
        for s, t, kind in todo:
            n = s.gguf_name
            kg, kf = keys_g[(n, t)], keys_f[(n, t)]
            got = shared.get(f"{kg.digest}:{kf.digest}:{kind}")
            if not (isinstance(got, list) and len(got) == 2):
                left.append((s, t, kind))
                continue
            eg, ef = float(got[0]), float(got[1])
            table.setdefault(n, {})[t] = {"ggml": eg, "feedback": ef, "proxy": kind,
                                          "choice": "feedback" if ef < eg else "ggml",
                                          "ggml_key": kg.digest, "feedback_key": kf.digest}
            changed = True
        if len(left) < len(todo):
            log(f"rounding choice: {len(todo) - len(left)} (tensor, type) pairs taken from the "
                f"cache ({shared_path}), scored on the same held-out blocks")
        todo = left

    def save():
        if path is not None and changed:
            tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
            tmp.write_text(json.dumps({"heldout": heldout_id, "tensors": table}, indent=1))
            os.replace(tmp, path)
            _keep_rounding(shared_path, table)

    def work(s, kind):  # the pair's multiply-adds in GFLOP (at least 1), so the progress line
        # moves with the time spent: the head's logits over 4096 tokens outweigh a layer's pair
        if kind == "logit_kl":
            f = 3 * 4096 * s.n_per_row * s.n_rows    # x W^T for the reference and both candidates
        else:
            f = 2 * s.n_rows * s.n_per_row ** 2      # E H E^T for both candidates
        return max(1, round(f / 1e9))
    prog = Progress(sum(work(s, kind) for s, _, kind in todo),
                    "rounding choice: held-out error of both roundings",
                    unit="GFLOP") if todo else None
    finished = False
    try:
        for s, t, kind in todo:
            n = s.gguf_name
            kg, kf = keys_g[(n, t)], keys_f[(n, t)]
            if weights is None:
                log(f"rounding choice: reading the base F32 weights of {len(ctx.specs)} "
                    "tensors")
                weights = base_weights(ctx.prepared.base_gguf, names=ctx.tmap.names)
            prog.update(0, note=f"{n} {t}")
            w = weights[n]
            dg = _dequantized(cache, kg, t, s.n_per_row)
            df = _dequantized(cache, kf, t, s.n_per_row)
            if kind == "logit_kl":
                if callable(head_x):
                    log("rounding choice: the output head's inputs, from a forward pass "
                        "over held-out tokens")
                    head_x = head_x()
                hx, hmap = head_x if isinstance(head_x, tuple) else (head_x, None)
                eg, ef = logit_kl(w, [dg, df], hx, logit_map=hmap)
            else:
                eg, ef = proxy_error(w, dg, heldout[n]), proxy_error(w, df, heldout[n])
            table.setdefault(n, {})[t] = {"ggml": eg, "feedback": ef, "proxy": kind,
                                          "choice": "feedback" if ef < eg else "ggml",
                                          "ggml_key": kg.digest, "feedback_key": kf.digest}
            changed = True
            prog.update(work(s, kind), note=f"{n} {t}")
        finished = True
    finally:  # an interrupted run keeps the pairs it scored (the next run scores the rest)
        save()
        if prog is not None:
            prog.close(ok=finished)
    out: dict[str, list[str]] = {}
    won = total = 0
    for s in ctx.specs:
        for t in menus[s.gguf_name]:
            ent = table.get(s.gguf_name, {}).get(t)
            if ent is None or ent.get("feedback_key") != keys_f[(s.gguf_name, t)].digest:
                continue
            total += 1
            if ent["choice"] == "feedback":
                won += 1
                out.setdefault(s.gguf_name, []).append(t)
    log(f"--rounding auto: error-feedback bytes kept for {won} of {total} (tensor, type) "
        "candidates (smaller output error on held-out calibration blocks)"
        + (", llama-quantize's bytes for the rest" if won < total else ""))
    return out


def _stale_report_note(gguf: Path) -> str:
    """``"; <run>/eval/report.md scored the file it replaces ..."`` when the run folder's
    report names ``gguf`` (a re-export under the same name leaves that table describing the old
    file), else ``""``."""
    report = Path(gguf).parent / "eval" / "report.json"
    try:
        rows = json.loads(report.read_text())
    except (OSError, ValueError):
        return ""
    if not any(isinstance(r, dict) and r.get("name") == Path(gguf).name for r in rows or []):
        return ""
    return (f"; {report.with_suffix('.md')} scored the file it replaces: `voodoo eval --gguf "
            f"{gguf}` scores the new one")


def _dequantized(cache: CandidateCache, key, type_name: str, n_per_row: int) -> np.ndarray:
    import cython_ggml as cg
    data = cache.get(key)
    if data is None:
        raise RuntimeError(f"candidate {type_name} ({key}) is missing from {cache}; run "
                           "`voodoo precache` again")
    return cg.dequantize(np.ascontiguousarray(data), type_name, n_per_row)


def candidate_tensors(ctx: Context, menus, keys, cache: CandidateCache, dtype=torch.float32,
                      device="cpu") -> dict[str, torch.Tensor]:
    """gguf_name -> (K, n_rows, n_per_row) candidates in GGUF layout, dequantized by libggml
    exactly as llama.cpp does, in ``dtype`` on ``device``."""
    out = {}
    for s in ctx.specs:
        out[s.gguf_name] = torch.stack([torch.from_numpy(np.ascontiguousarray(
            _dequantized(cache, keys[(s.gguf_name, t)], t, s.n_per_row))).to(dtype)
            for t in menus[s.gguf_name]]).to(device)
    return out


def quantized_candidates(ctx: Context, menus, keys, cache: CandidateCache, device="cpu"
                         ) -> dict:
    """gguf_name -> :class:`voodoo.lazy.QuantizedCandidates` holding the tensor's K candidates
    as the cache's ggml bytes (the bytes the exported GGUF gets), on ``device``: about
    ``sum_k bpw_k / 8`` bytes per weight instead of ``K x 4`` (float32) dense. Each candidate
    is copied from the memory-mapped cache file straight to ``device``."""
    from .lazy import QuantizedCandidates
    out = {}
    for s in ctx.specs:
        blocks = []
        for t in menus[s.gguf_name]:
            data = cache.get(keys[(s.gguf_name, t)])
            if data is None:
                raise RuntimeError(f"candidate {s.gguf_name} as {t} ({keys[(s.gguf_name, t)]})"
                                   f" is missing from {cache}; run `voodoo precache` again")
            blocks.append(torch.from_numpy(np.array(data, dtype=np.uint8)).to(device))
        out[s.gguf_name] = QuantizedCandidates(blocks, menus[s.gguf_name], tuple(s.shape))
    return out


def build_student(ctx: Context, menus, keys, cache: CandidateCache, dtype=torch.float32,
                  device="cpu", lazy: bool = False):
    """Installs the gates on ``ctx.model`` (in place): each selectable GGUF tensor gets its K
    candidates (dequantized by libggml exactly as llama.cpp does, GGUF layout), and the HF
    parameters it reads are recomputed from the gates through the tensor map
    (:func:`voodoo.gates.install_param_gates`). Returns gguf_name -> MixedWeight.

    ``lazy``: keep the candidates as their ggml bytes (:func:`quantized_candidates`) and mix
    them tile by tile on the fly (:mod:`voodoo.lazy`; bit-identical dequantization, so the
    same weights as the eager path; ``dtype`` is then unused: the mixtures are accumulated in
    float32 and come out in the model parameters' dtype). Eager (default): dense
    ``(K, n_rows, n_per_row)`` candidates of ``dtype``."""
    from .gates import install_param_gates
    table = bytes_table(ctx.specs, menus)
    ctx.model.to(device)
    if lazy:
        stores = quantized_candidates(ctx, menus, keys, cache, device)
        return install_param_gates(ctx.model, ctx.tmap, {}, table, menus=menus, stores=stores)
    cands = candidate_tensors(ctx, menus, keys, cache, dtype, device)
    return install_param_gates(ctx.model, ctx.tmap, cands, table, menus=menus)


def build_student_tp(ctx: Context, menus, keys, cache: CandidateCache, dtype=torch.float32,
                     device="cpu", lazy: bool = False):
    """The tensor-parallel student: the adapter's Linear/Embedding modules replaced by gated
    modules (:func:`voodoo.gates.install_gates`), which :mod:`cluster.tp` then shards; HF
    layout from the tensor map's row permutation. Raises ValueError without a TP adapter.

    ``lazy``: the candidates stay the cache's ggml bytes (rows put in HF order; a
    :class:`voodoo.lazy.QuantizedCandidates` per tensor) and :func:`cluster.tp.shard_model`
    keeps only each rank's shard of the blocks (rows for a column split, whole blocks of
    columns for a row split); build on the CPU (``device="cpu"``) so that no rank ever holds
    the whole tensors on its GPU."""
    from .gates import install_gates
    specs = legacy_specs(ctx)
    inv_rows = {}
    for s in specs:
        lk = ctx.tmap[s.gguf_name].links[0]
        inv = np.empty_like(lk.p_rows)
        inv[lk.p_rows] = lk.g_rows   # HF row r holds GGUF row inv[r]
        inv_rows[s.gguf_name] = inv
    if lazy:
        q = quantized_candidates(ctx, menus, keys, cache, device)
        stores = {n: q[n].take_rows(inv) for n, inv in inv_rows.items()}
        ctx.model.to(device)
        return install_gates(ctx.model, specs, {}, bytes_table(ctx.specs, menus), menus=menus,
                             stores=stores)
    cands = candidate_tensors(ctx, menus, keys, cache, dtype, "cpu")
    hf = {n: cands[n][:, torch.from_numpy(inv)].to(device) for n, inv in inv_rows.items()}
    ctx.model.to(device)
    return install_gates(ctx.model, specs, hf, bytes_table(ctx.specs, menus), menus=menus)


@torch.no_grad()
def build_teacher(ctx: Context, teacher_quant: str = "BF16", keys=None, cache=None,
                  imatrix=None, checkpoint=None, lazy: bool = False):
    """The teacher for distillation: ``checkpoint`` (an HF folder) if given; else a copy of the
    base model whose selectable weights are rounded to ``BF16`` (computed in float32), or passed
    through Q8_0 by libggml (``Q8_0``). Call before :func:`build_student` (which replaces the
    modules of ``ctx.model``).

    ``lazy`` with ``Q8_0``: the selectable weights stay as their Q8_0 bytes (libggml's
    quantization, 34 bytes per 32 weights) in a :class:`voodoo.lazy.QuantizedParams`
    (``teacher.voodoo_quantized``) and are dequantized module by module in each forward:
    the same logits as the dense Q8_0 teacher, no weight gradients (not for the Fisher prior).
    Ignored for BF16/F32 and a checkpoint."""
    import copy

    import cython_ggml as cg
    if checkpoint:
        from .models import load_hf_model  # as the student is loaded (YaRN as ggml computes it)
        return load_hf_model(checkpoint, dtype=torch.float32).eval()
    tq = teacher_quant.upper()
    if tq not in ("BF16", "Q8_0", "F32"):
        raise ValueError(f"--teacher_quant must be BF16, Q8_0 or F32, not {teacher_quant!r}")
    teacher = copy.deepcopy(ctx.model).eval()
    if tq == "F32":
        return teacher
    params = dict(teacher.named_parameters(remove_duplicate=True))
    if tq == "BF16":
        for pname in ctx.tmap.by_param():
            w = params[pname]
            w.copy_(w.to(torch.bfloat16).to(w.dtype))
        return teacher
    if lazy:
        from .lazy import QuantizedCandidates, QuantizedParams
        stores = {}
        for s in ctx.specs:
            g = ctx.tmap.to_gguf(s.gguf_name, {n: params[n].detach().float().cpu()
                                               for n in s.params}).numpy()
            q = cg.quantize(np.ascontiguousarray(g, dtype=np.float32), "Q8_0")
            stores[s.gguf_name] = QuantizedCandidates([torch.from_numpy(q)], ["Q8_0"],
                                                      tuple(s.shape))
        del params
        teacher.voodoo_quantized = QuantizedParams(teacher, ctx.tmap, stores)
        return teacher
    from .gates import write_gguf_into_params
    q8 = {}
    for s in ctx.specs:
        g = ctx.tmap.to_gguf(s.gguf_name, {n: params[n].detach().float().cpu()
                                           for n in s.params}).numpy()
        q = cg.quantize(np.ascontiguousarray(g, dtype=np.float32), "Q8_0")
        q8[s.gguf_name] = torch.from_numpy(cg.dequantize(q, "Q8_0", s.n_per_row))
    write_gguf_into_params(teacher, ctx.tmap, q8)
    return teacher


def _weights_fingerprint(model: torch.nn.Module, tmap: TensorMap) -> str:
    import hashlib
    h = hashlib.sha256()
    params = dict(model.named_parameters(remove_duplicate=True))
    for pname in sorted(tmap.by_param()):
        h.update(pname.encode())
        h.update(params[pname].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def fisher_prior(ctx: Context, teacher: torch.nn.Module, menus, keys, cache: CandidateCache,
                 blocks: torch.Tensor, budget: int, *, strength: float = 2.0, seed: int = 0,
                 fisher_cache_dir=None, report_path=None, progress: bool = True,
                 hessians=None, activation_rounding: str = "cpu") -> dict[str, torch.Tensor]:
    """The ``--gate_init fisher`` starting logits (:mod:`voodoo.sensitivity`).

    The Fisher diagonal is computed on ``teacher`` (an ordinary HF model; call before
    :func:`build_student`, which replaces ``ctx.model``'s modules) from ``blocks`` (N, T) int64
    calibration tokens and cached in ``fisher_cache_dir`` (default
    ``~/.cache/voodoo/fisher``, keyed by the teacher's weights, the tokens and ``seed``). Each
    candidate's predicted KL ``D[t, k]`` (nats/token) uses the candidates exactly as llama.cpp
    dequantizes them (from ``cache``) against the teacher's weights; a tensor with an input
    Hessian in ``hessians`` (gguf_name -> (n_per_row, n_per_row), :func:`ensure_hessians`)
    is scored with the input correlation put back
    (:func:`voodoo.sensitivity.correlated_distortion`), which error-feedback candidates need.
    ``activation_rounding="cpu"`` adds to ``D`` the predicted KL of the activation rounding
    llama.cpp's CPU backend does for each candidate type, relative to the reference tensor's
    own (:mod:`voodoo.actround`; forward passes over ``blocks``); ``"none"`` leaves it out.
    ``report_path``: where to
    write ``{"mu_nats_per_byte", "choice_bytes", "predicted_kl", "lagrangian_bytes",
    "lagrangian_predicted_kl", "tensors": {name: {"menu", "bytes", "dkl", "choice"}}, ...}``
    (JSON, atomic). Returns gguf_name -> (K,) float32 logits, menu order."""
    from .llamacpp import cache_root
    from .sensitivity import (correlated_distortion, distortion_table, fisher_gate_logits,
                              lagrangian_choice, load_or_compute_fisher)
    root = Path(fisher_cache_dir) if fisher_cache_dir else cache_root() / "fisher"
    hessians = hessians or {}
    from types import SimpleNamespace
    pspecs = [SimpleNamespace(gguf_name=p, param=p) for p in sorted(ctx.tmap.by_param())]
    fisher = load_or_compute_fisher(teacher, pspecs, blocks, root,
                                    _weights_fingerprint(teacher, ctx.tmap), seed=seed,
                                    progress=progress)
    table = bytes_table(ctx.specs, menus)
    tparams = {n: p.detach().float().cpu()
               for n, p in teacher.named_parameters(remove_duplicate=True)}
    dist = {}
    specs = ctx.specs
    if progress:
        from tqdm.auto import tqdm
        specs = tqdm(specs, desc="prior costs", unit="tensor", dynamic_ncols=True)
    for s in specs:
        cands = torch.stack([torch.from_numpy(np.ascontiguousarray(
            _dequantized(cache, keys[(s.gguf_name, t)], t, s.n_per_row)))
            for t in menus[s.gguf_name]])
        ref = ctx.tmap.to_gguf(s.gguf_name, tparams)
        f = ctx.tmap.to_gguf(s.gguf_name, fisher, scale_power=-2)
        if s.gguf_name in hessians:
            dist[s.gguf_name] = correlated_distortion(f, cands, ref, hessians[s.gguf_name])
        else:
            dist.update(distortion_table({s.gguf_name: f}, {s.gguf_name: cands},
                                         {s.gguf_name: ref}))
    act = {}
    if activation_rounding == "cpu":
        if progress:
            log(f"pricing activation rounding (--activation_rounding cpu) on "
                f"{blocks.shape[0]} x {blocks.shape[1]} tokens")
        act = _activation_costs(ctx, teacher, menus, fisher, blocks)
        for n, costs in act.items():
            dist[n] = [d + costs.get(_vdt(t), 0.0) for d, t in zip(dist[n], menus[n])]
    elif activation_rounding != "none":
        raise ValueError(f"activation_rounding={activation_rounding!r}: use 'cpu' or 'none'")
    logits = fisher_gate_logits(dist, table, budget, strength)
    if report_path is not None:
        mu, hull = lagrangian_choice(dist, table, budget)
        choice = {n: int(torch.argmax(z)) for n, z in logits.items()}  # = knapsack_choice
        rep = {"mu_nats_per_byte": mu, "budget_bytes": int(budget),
               "fisher_blocks": int(blocks.shape[0]), "tokens_per_block": int(blocks.shape[1]),
               "strength": strength, "seed": seed,
               "input_correlated": sorted(n for n in dist if n in hessians),
               "activation_rounding": activation_rounding,
               "activation_cost": {n: {t: act[n].get(_vdt(t), 0.0) for t in menus[n]}
                                   for n in sorted(act)},
               "choice_bytes": int(sum(table[n][k] for n, k in choice.items())),
               "predicted_kl": sum(dist[n][k] for n, k in choice.items()),
               "lagrangian_bytes": int(sum(table[n][k] for n, k in hull.items())),
               "lagrangian_predicted_kl": sum(dist[n][k] for n, k in hull.items()),
               "tensors": {n: {"menu": list(menus[n]), "bytes": table[n], "dkl": dist[n],
                               "choice": menus[n][choice[n]]} for n in sorted(dist)}}
        write_json(report_path, rep)
    return logits


#: Bytes the bake's fill keeps free besides 32 a tensor (:func:`fill_margin`): the KV pairs export
#: adds beyond the base GGUF's metadata (about 350 bytes on SmolLM2) with room to spare.
FILL_MARGIN_BASE = 4096


def prior_costs(report_path, menus) -> dict | None:
    """The Fisher prior's predicted KL per candidate (gguf_name -> K floats, menu order, nats
    per token, activation rounding included) from the ``report_path`` that :func:`fisher_prior`
    wrote, or None when there is none or it was made for other menus."""
    import json
    try:
        rep = json.loads(Path(report_path).read_text())
        t = rep["tensors"]
        if set(t) != set(menus) or any(list(t[n]["menu"]) != [str(getattr(x, "name", x))
                                                               for x in menus[n]] for n in t):
            return None
        return {n: [float(c) for c in t[n]["dkl"]] for n in t}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _vdt(type_name: str) -> str | None:
    from .actround import vec_dot_type
    try:
        return vec_dot_type(type_name)
    except KeyError:
        return None


def _activation_costs(ctx: Context, teacher, menus, fisher, blocks) -> dict:
    """:func:`voodoo.actround.activation_costs` for every selectable tensor that is one whole
    HF weight read by ``nn.Linear`` modules (a split or stacked tensor gets none), priced for
    the classes of its menu against the reference GGUF's type of the same tensor (F32 when
    the reference lacks it)."""
    from .actround import activation_costs
    from .ggufio import read_gguf
    ref_types = {}
    try:
        for t in read_gguf(ctx.prepared.reference_gguf).tensors:
            ref_types[t.name] = t.tensor_type.name
    except (OSError, ValueError):
        pass
    params, classes, reference = {}, {}, {}
    tw = dict(teacher.named_parameters(remove_duplicate=False))
    for s in ctx.specs:
        e = ctx.tmap[s.gguf_name]
        lk = e.links[0]
        w = tw.get(lk.param)
        if len(e.links) != 1 or lk.cols is not None or lk.transpose or w is None or \
                w.dim() != 2 or len(lk.p_rows) != w.shape[0]:
            continue
        params[s.gguf_name] = lk.param
        classes[s.gguf_name] = [c for c in (_vdt(t) for t in menus[s.gguf_name]) if c]
        reference[s.gguf_name] = _vdt(ref_types.get(s.gguf_name, "F32")) or "F32"
    return activation_costs(teacher, params, classes, reference, fisher, blocks)


def train(ctx: Context, teacher, train_blocks, cfg, out_dir, budget=None, **kw):
    """:func:`voodoo.train.train_gates` with the run folder's journal (``out_dir/partial.pt``)."""
    from .train import train_gates
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return train_gates(ctx.model, teacher, train_blocks, cfg, output_dir=out_dir,
                       budget=budget, **kw)


def fill_margin(table) -> int:
    """Bytes the bake's fill keeps free under the budget for a GGUF of the tensors in
    ``table``: :data:`FILL_MARGIN_BASE` plus 32 a tensor (its alignment padding)."""
    return FILL_MARGIN_BASE + 32 * len(table)


def bake_assignment(gates, menus, table, budget, path=None, **options) -> dict:
    """:func:`voodoo.bake.bake` with ``options``, its keyword arguments (``tensor_upgrades``,
    ``tolerance``, ``ceiling``/``ceiling_ref`` for ``--match_size``, ``fill_costs`` from
    :func:`prior_costs` with ``fill_margin`` from :func:`fill_margin`), saved as JSON at
    ``path`` (atomically) when given."""
    from .bake import bake
    a = bake(gates, menus, table, budget, **options)
    if path:
        write_json(path, a)
    return a


def export(ctx: Context, assignment, keys, cache: CandidateCache, out_path,
           extra_kv=None) -> Path:
    """Writes the GGUF (bytes from the candidate cache) and, beside it, the
    ``--tensor-type-file`` that makes llama-quantize write the same tensors from the base F32
    GGUF and the imatrix."""
    from .export import export_gguf, write_tensor_type_file

    def lookup(name, t):
        data = cache.get(keys[(name, t)])
        if data is None:
            raise RuntimeError(f"candidate {name} as {t} is missing from the cache")
        return data
    out_path = Path(out_path)
    own = sorted(n for n, v in assignment["tensors"].items()
                 if getattr(keys.get((n, v["type"])), "rounding", "ggml") != "ggml")
    if own:
        # the run's mode ("gptq", or "auto": per tensor and type, whichever bytes won on
        # held-out blocks); the count says how many tensors hold error-feedback bytes
        mode = (assignment.get("provenance") or {}).get("rounding") or "gptq"
        extra_kv = {**(extra_kv or {}), "voodoo.rounding": str(mode),
                    "voodoo.rounding.tensor_count": len(own)}
    if out_path.is_dir():
        from .export import ExportError
        raise ExportError(f"{out_path} is a folder, where the GGUF would be written: move it "
                          "away, or name the file otherwise (--output_name NAME)")
    if out_path.exists():  # written atomically: the old file stays whole until the new one is
        log(f"{out_path.name} exists; it is replaced (--output_name NAME keeps both)"
            + _stale_report_note(out_path))
    file_type = None
    if assignment.get("badge"):   # --match_size TYPE: general.file_type says the type matched
        from .export import badge_file_type
        try:
            file_type = badge_file_type(assignment["badge"])
        except ValueError:
            log(f"the assignment's badge {assignment['badge']!r} is not a llama.cpp file type; "
                "general.file_type is the one of the file's bpw")
    p = export_gguf(ctx.prepared.base_gguf, assignment, lookup, out_path, extra_kv=extra_kv,
                    file_type=file_type)
    tt = write_tensor_type_file(assignment, out_path.with_suffix(".tensor-types.txt"),
                                base_gguf=ctx.prepared.base_gguf)
    if own:
        log(f"{len(own)} of {len(assignment['tensors'])} tensors hold error-feedback rounded "
            f"bytes (error-feedback rounding: same types and sizes, not llama-quantize's bytes); "
            f"llama-quantize --tensor-type-file {tt.name} reproduces the other "
            f"{len(assignment['tensors']) - len(own)} exactly")
    return p


def assign_student(mixed: Mapping, assignment: Mapping) -> None:
    """Sets every gate one-hot on its assigned type (logits 0 / -inf-like), for evaluating the
    baked model in torch."""
    with torch.no_grad():
        for name, mw in mixed.items():
            t = assignment["tensors"][name]["type"]
            k = list(assignment["tensors"][name]["menu"]).index(t)
            mw.logits.fill_(-1e4)
            mw.logits[k] = 1e4
            mw.temperature.fill_(1.0)


def write_json(path, obj) -> Path:
    """Atomic JSON write (tmp file + os.replace)."""
    from .fsutil import atomic_write_text
    return atomic_write_text(path, json.dumps(obj, indent=1, default=str))


# --------------------------------------------------------------------- Ray Train factory
@dataclass
class StudentFactory:
    """A picklable ``factory(WorkerInfo) -> StudentJob`` for :mod:`cluster.train` /
    :mod:`cluster.tune`: every worker (and every Tune trial) loads the model, builds the teacher
    and the gated student from the candidate cache, on its own device.

    Plain fields only, so it travels to Ray workers. ``model``: what :func:`load_context` takes (an
    HF folder, a .gguf, a hub id); ``work_dir``: prepare_model's. ``cache_dir``: the candidate cache
    (None: the default). ``menus``: gguf_name -> type names. Tokens:
    ``train_blocks``/``eval_blocks`` ((N, seq_len) int64) when given, else read from ``data_dir``
    (``n_train``/``n_eval`` first blocks). ``imatrix``: path of the imatrix file (None: no imatrix).
    ``teacher_quant``/``teacher_checkpoint``: :func:`build_teacher`'s. ``dtype``: candidates' dtype
    (None: ``info.cfg.dtype``). ``budget``: bytes (None: from the TrainConfig). ``hessians``: the
    ``.npz`` of :func:`ensure_hessians` for error-feedback candidates, ``feedback``:
    :func:`choose_rounding`'s pairs (``--rounding auto``; None: every candidate of a tensor with a
    Hessian). ``lazy``: candidates held as ggml bytes (:func:`build_student`'s ``lazy``; with tensor
    parallelism :func:`build_student_tp`'s: a rank keeps only its shard's blocks; the Q8_0 teacher
    is held lazily only without tensor parallelism).

    Candidates must already be in the cache (``voodoo precache`` / the CLI's candidate stage):
    the factory only looks them up (in-process, no quantization expected). The core imports no
    Ray: :mod:`cluster.train`'s StudentJob is imported here, lazily."""

    model: str
    menus: dict
    imatrix: str | None = None
    cache_dir: str | None = None
    train_blocks: torch.Tensor | None = None
    eval_blocks: torch.Tensor | None = None
    data_dir: str | None = None
    n_train: int | None = None
    n_eval: int | None = None
    teacher_quant: str = "BF16"
    teacher_checkpoint: str | None = None
    hessians: str | None = None
    feedback: dict | None = None
    dtype: str | None = None
    budget: int | None = None
    work_dir: str | None = None
    lazy: bool = False
    #: ``--trust_remote_code`` of the driver, carried to workers on other nodes
    remote_code: bool = field(default_factory=trust_remote_code)

    def blocks(self):
        """(train_blocks, eval_blocks)."""
        if self.train_blocks is not None:
            return self.train_blocks, self.eval_blocks
        if self.data_dir is None:
            raise ValueError("StudentFactory needs train_blocks or a data_dir")
        from .data import load_dataset_dir
        tr, ev, _ = load_dataset_dir(self.data_dir)
        return tr[: self.n_train], (ev[: self.n_eval] if ev is not None else None)

    def __call__(self, info):
        from cluster.train import StudentJob

        from .imatrix import read_imatrix
        from .train import torch_dtype
        if self.remote_code:
            from .models import TRUST_REMOTE_CODE_ENV
            os.environ[TRUST_REMOTE_CODE_ENV] = "1"
        ctx = load_context(self.model, self.work_dir, with_tokenizer=False,
                           check=False)
        cache = CandidateCache(self.cache_dir) if self.cache_dir else CandidateCache()
        im = read_imatrix(self.imatrix) if self.imatrix else None
        hs = None
        if self.hessians:
            hs = load_hessians(self.hessians)
        keys = ensure_candidates(ctx, self.menus, im, cache, None, hessians=hs,
                                 feedback=self.feedback)
        cfg = getattr(info, "cfg", None)
        tp = int(getattr(info, "tp_size", 1) or 1)
        # --lazy: a Q8_0 teacher held as its bytes too (one GPU / data parallel; the Fisher
        # prior of a lazy run is computed by the driver, cli train_ray)
        lazy_teacher = self.lazy and tp == 1 and self.teacher_quant.upper() == "Q8_0"
        teacher = build_teacher(ctx, self.teacher_quant, checkpoint=self.teacher_checkpoint,
                                lazy=lazy_teacher)
        dtype = self.dtype or (cfg.dtype if cfg is not None else "float32")
        specs = legacy_specs(ctx) if tp > 1 else list(ctx.specs)
        if tp > 1:
            # lazy: built on the CPU; shard_model keeps this rank's blocks, then moves them
            build_student_tp(ctx, self.menus, keys, cache, dtype=torch_dtype(dtype),
                             device="cpu" if self.lazy else info.device, lazy=self.lazy)
        else:
            build_student(ctx, self.menus, keys, cache, dtype=torch_dtype(dtype),
                          device=info.device, lazy=self.lazy)
        n_head = getattr(ctx.adapter, "n_head", None) or getattr(
            ctx.model.config, "num_attention_heads", None)
        n_head_kv = getattr(ctx.adapter, "n_head_kv", None) or getattr(
            ctx.model.config, "num_key_value_heads", None) or n_head
        tr, ev = self.blocks()
        return StudentJob(student=ctx.model, teacher=teacher, train_blocks=tr, eval_blocks=ev,
                          specs=specs, n_head=n_head, n_head_kv=n_head_kv, budget=self.budget)
