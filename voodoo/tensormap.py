"""The tensor map: for every GGUF tensor llama-quantize would quantize, which elements of which
HF parameters it holds, and with what scale -- derived from llama.cpp's own converter at run
time, for any architecture the pinned converter registers.

How it is derived (:func:`derive_tensor_map`): a copy of the model gets *probe* weights whose
values encode each element's identity (a global element id, written in base 2**20 digits, one
digit per pass, plus a pass of per-parameter constants that reveals scales; each pass's
values are multiplied by that parameter's constant, 1..8, different for parameters of the same
shape, so that no two parameters are ever equal in a pass and a converter that drops a tensor
equal to another, e.g. an untied head equal to the embedding, keeps it); ``save_pretrained``
writes them as a
checkpoint (so transformers' own reverse weight conversion applies, e.g. fused 3-D experts
back to per-expert tensors), and the converter's model class (``convert_hf_to_gguf.py``, pinned
source, run in a subprocess with its own ``gguf-py``) transforms them exactly as it transforms
real weights: renames, Q/K row permutations, transposes, splits, head-interleaved gathers,
scalar multipliers, stacked experts. Decoding each output element gives its source
``(parameter, element)`` and scale; the result is compressed into row links (below). The map
is checked against the real weights: mapping the model's parameters through it must give the
base F32 GGUF's tensors.

A GGUF tensor of numpy shape ``(..., n_rows, n_per_row)`` is handled as 2-D ``(N, n_per_row)``
with ``N = prod(leading dims) * n_rows`` (stacked experts are just more rows; quantization is
row-wise). Each :class:`Link` says: GGUF rows ``g_rows`` equal ``scale * V[p_rows][:, cols]``,
where ``V`` is the parameter's *row view*: the parameter (transposed in its last two dims when
``transpose``), reshaped to ``(-1, last dim)``.

"Would quantize" is llama-quantize's ``tensor_allows_quantization`` in the pinned
``src/llama-quant.cpp``, parsed from that source (:func:`quantize_rule`), so a llama.cpp update
that changes the rule changes Voodoo's with it (or fails loudly on a form the parser does not
know).

No architecture names here; nothing imports Ray.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from .progress import room_log

__all__ = [
    "Link", "MapEntry", "TensorMap", "TensorMapError", "UnsupportedArchitecture",
    "derive_tensor_map", "quantize_rule", "would_quantize", "role_of",
]

_DIGIT_BITS = 20
_MASK = (1 << _DIGIT_BITS) - 1


class TensorMapError(ValueError):
    """The converter's output could not be mapped back to the model's parameters."""


class UnsupportedArchitecture(TensorMapError):
    """llama.cpp's pinned converter does not register this architecture."""


_log = room_log("tensormap")


# ----------------------------------------------------------------------- llama-quantize's rule
@dataclass(frozen=True)
class QuantizeRule:
    """llama-quantize's ``tensor_allows_quantization`` as data (see :func:`quantize_rule`).

    ``excluded_substrings``: a name containing one is never quantized; ``excluded_names``:
    exact names; ``arch_excluded``: gguf arch name -> substrings excluded for that arch only."""

    excluded_substrings: tuple[str, ...]
    excluded_names: tuple[str, ...]
    arch_excluded: dict

    def allows(self, name: str, shape, arch: str | None = None) -> bool:
        """Whether llama-quantize would quantize a tensor ``name`` of numpy ``shape``: at least
        2 dims as ggml counts them (``ggml_n_dims`` ignores trailing size-1 ``ne``, i.e.
        leading size-1 numpy dims), name ends with ``weight``, no excluded part."""
        dims = list(shape)
        while len(dims) > 1 and dims[0] == 1:
            dims.pop(0)
        if len(dims) < 2 or not name.endswith("weight"):
            return False
        if name in self.excluded_names:
            return False
        if any(s in name for s in self.excluded_substrings):
            return False
        if arch is not None and any(s in name for s in self.arch_excluded.get(arch, ())):
            return False
        return True


def _cpp_function_body(text: str, signature: str) -> str:
    i = text.find(signature)
    if i < 0:
        raise TensorMapError(f"{signature!r} not found in llama-quant.cpp; the pinned llama.cpp "
                             "changed: update voodoo.tensormap.quantize_rule")
    j = text.index("{", i)
    depth, k = 0, j
    while True:
        c = text[k]
        depth += c == "{"
        depth -= c == "}"
        k += 1
        if depth == 0:
            return text[j + 1:k - 1]


@lru_cache(maxsize=4)
def quantize_rule(src_dir: str | None = None) -> QuantizeRule:
    """Parses ``tensor_allows_quantization`` from ``<src>/src/llama-quant.cpp`` (and the tensor and
    arch name tables of ``src/llama-arch.cpp``) of the pinned llama.cpp source.

    Every statement of the function must be one of the forms the parser knows (``name.find(X)
    == npos``, ``name != LLM_TN(arch)(LLM_TENSOR_Y, "weight")``, ``if (arch == LLM_ARCH_Z) {...}``,
    the ends-with-weight, n_dims, output-tensor and only_copy checks); anything else raises
    TensorMapError, so a changed rule is never silently ignored."""
    from .llamacpp import source_dir
    src = Path(src_dir) if src_dir else source_dir()
    text = (src / "src" / "llama-quant.cpp").read_text()
    arch_text = (src / "src" / "llama-arch.cpp").read_text()
    tensor_names = dict(re.findall(r"\{\s*(LLM_TENSOR_\w+)\s*,\s*\"([^\"]+)\"\s*\}", arch_text))
    arch_names = dict(re.findall(r"\{\s*(LLM_ARCH_\w+)\s*,\s*\"([^\"]+)\"\s*\}", arch_text))
    body = _cpp_function_body(text, "static bool tensor_allows_quantization(")
    body = re.sub(r"//[^\n]*", "", body)
    subs, names, per_arch = [], [], {}
    cur = subs
    for raw in body.split("\n"):
        s = raw.strip()
        if not s:
            continue
        m = re.fullmatch(r"if \(arch == (LLM_ARCH_\w+)\) \{", s)
        if m:
            cur = per_arch.setdefault(arch_names[m.group(1)], [])
            continue
        if s == "}":
            cur = subs
            continue
        m = re.fullmatch(r'quantize &= name\.find\("([^"]+)"\)\s*== std::string::npos;', s)
        if m:
            cur.append(m.group(1))
            continue
        m = re.fullmatch(r'quantize &= name != LLM_TN\(arch\)\((LLM_TENSOR_\w+),\s*"(\w+)"\);', s)
        if m:
            names.append(f"{tensor_names[m.group(1)]}.{m.group(2)}")
            continue
        known = ("if (params->only_copy)", "if (ggml_n_dims(tensor) < 2)",
                 "const std::string name = ggml_get_name(tensor);",
                 'bool quantize = name.rfind("weight") == name.size() - 6;',
                 'quantize &= params->quantize_output_tensor || name != "output.weight";',
                 "return quantize;")
        if any(s.startswith(k) for k in known):
            continue
        raise TensorMapError(f"llama-quant.cpp's tensor_allows_quantization has a statement "
                             f"Voodoo does not understand: {s!r}; update "
                             "voodoo.tensormap.quantize_rule")
    return QuantizeRule(tuple(subs), tuple(names), {k: tuple(v) for k, v in per_arch.items()})


def would_quantize(name: str, shape, arch: str | None = None) -> bool:
    """:meth:`QuantizeRule.allows` of the pinned source's rule."""
    return quantize_rule().allows(name, shape, arch)


def role_of(gguf_name: str) -> str:
    """``"attention"`` for GGUF tensors of the attention block (``.attn_`` in the name, as
    llama.cpp names them: attn_q, attn_k, attn_v, attn_output, attn_qkv, attn_gate, ...), else
    ``"non_attention"``. Picks the menu (``--attention_candidates``)."""
    return "attention" if ".attn_" in gguf_name else "non_attention"


# ---------------------------------------------------------------------------- the map itself
@dataclass
class Link:
    """GGUF rows ``g_rows`` of one tensor (its 2-D ``(N, n_per_row)`` form) equal
    ``scale[:, None] * V[p_rows][:, cols]`` where ``V`` is parameter ``param``'s row view
    (``param.transpose(-1, -2)`` when ``transpose``, then ``reshape(-1, last)``).

    ``g_rows``/``p_rows``: int64 (n,); ``cols``: int64 (n_per_row,) or None (identity);
    ``scale``: float64 (n,) or None (all ones)."""

    param: str
    transpose: bool
    g_rows: np.ndarray
    p_rows: np.ndarray
    cols: np.ndarray | None = None
    scale: np.ndarray | None = None

    def to_json(self) -> dict:
        return {"param": self.param, "transpose": self.transpose,
                "g_rows": _ranges(self.g_rows), "p_rows": _ranges(self.p_rows),
                "cols": None if self.cols is None else self.cols.tolist(),
                "scale": None if self.scale is None else self.scale.tolist()}

    @classmethod
    def from_json(cls, d: dict) -> "Link":
        return cls(d["param"], bool(d["transpose"]), _unranges(d["g_rows"]),
                   _unranges(d["p_rows"]),
                   None if d["cols"] is None else np.asarray(d["cols"], np.int64),
                   None if d["scale"] is None else np.asarray(d["scale"], np.float64))


def _ranges(a: np.ndarray) -> list:
    """int array -> [[start, stop], ...] runs of +1 steps (compact JSON)."""
    a = np.asarray(a, np.int64)
    if a.size == 0:
        return []
    br = np.nonzero(np.diff(a) != 1)[0] + 1
    starts = np.concatenate([[0], br])
    stops = np.concatenate([br, [a.size]])
    return [[int(a[s]), int(a[e - 1]) + 1] for s, e in zip(starts, stops)]


def _unranges(r: list) -> np.ndarray:
    if not r:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in r])


@dataclass
class MapEntry:
    """One selectable GGUF tensor.

    ``gguf_name``: e.g. ``blk.3.ffn_down.weight``; ``gguf_shape``: numpy order, e.g.
    ``(n_rows, n_per_row)`` or ``(n_expert, n_rows, n_per_row)``; ``links``: how its rows come
    from HF parameters. ``n_rows`` is the 2-D row count (experts stacked), ``n_per_row`` the
    last dim; ``role``: :func:`role_of`; ``tp``: a tensor-parallel split when an adapter gives
    one (``"column"``/``"row"``/None)."""

    gguf_name: str
    gguf_shape: tuple
    links: list[Link]
    role: str = "non_attention"
    tp: str | None = None

    @property
    def n_per_row(self) -> int:
        return int(self.gguf_shape[-1])

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.gguf_shape[:-1]))

    @property
    def shape(self) -> tuple[int, int]:
        """``(n_rows, n_per_row)``: the 2-D form every size and candidate uses."""
        return (self.n_rows, self.n_per_row)

    @property
    def n_expert(self) -> int:
        """Leading experts (1 for a 2-D tensor)."""
        return int(np.prod(self.gguf_shape[:-2])) if len(self.gguf_shape) > 2 else 1

    @property
    def params(self) -> list[str]:
        return sorted({lk.param for lk in self.links})


@dataclass
class TensorMap:
    """The map of a model: selectable GGUF tensors (in GGUF file order) and facts about the
    conversion. ``arch``: GGUF architecture name; ``other``: names of the GGUF tensors the
    converter writes that llama-quantize would not quantize (kept as they are)."""

    arch: str
    hf_arch: str
    entries: list[MapEntry]
    other: list[str] = field(default_factory=list)
    converter_args: list[str] = field(default_factory=list)

    def __post_init__(self):
        self._by_name = {e.gguf_name: e for e in self.entries}

    def __getitem__(self, name: str) -> MapEntry:
        return self._by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def names(self) -> list[str]:
        return [e.gguf_name for e in self.entries]

    def by_param(self) -> dict[str, list[tuple[MapEntry, Link]]]:
        """HF parameter name -> [(entry, link)] of every link reading it."""
        out: dict[str, list] = {}
        for e in self.entries:
            for lk in e.links:
                out.setdefault(lk.param, []).append((e, lk))
        return out

    # ------------------------------------------------------------------- applying the map
    def to_gguf(self, name: str, params: dict, scale_power: float = 1.0) -> torch.Tensor:
        """The GGUF tensor ``name`` in 2-D form ``(n_rows, n_per_row)`` computed from HF
        tensors ``params`` (name -> tensor of the parameter's shape): each link's rows are
        ``scale**scale_power * V[p_rows][:, cols]``. ``scale_power=-1`` maps a gradient
        (dL/dW_gguf = dL/dW_hf / scale), ``-2`` a Fisher diagonal. Differentiable; float32 unless
        the inputs are float64. Raises KeyError for a missing parameter."""
        e = self[name]
        out = None
        for lk in e.links:
            v = row_view(params[lk.param], lk.transpose)
            rows = v.index_select(0, _idx(lk.p_rows, v.device))
            if lk.cols is not None:
                rows = rows.index_select(1, _idx(lk.cols, v.device))
            if lk.scale is not None and scale_power != 0:
                s = torch.as_tensor(lk.scale ** scale_power, dtype=rows.dtype, device=v.device)
                rows = rows * s[:, None]
            if out is None:
                out = rows.new_zeros(e.shape)
            out = out.index_copy(0, _idx(lk.g_rows, v.device), rows)
        return out

    def to_json(self) -> dict:
        return {"version": 1, "arch": self.arch, "hf_arch": self.hf_arch,
                "other": self.other, "converter_args": self.converter_args,
                "entries": [{"gguf_name": e.gguf_name, "gguf_shape": list(e.gguf_shape),
                             "role": e.role, "tp": e.tp,
                             "links": [lk.to_json() for lk in e.links]} for e in self.entries]}

    @classmethod
    def from_json(cls, d: dict) -> "TensorMap":
        if d.get("version") != 1:
            raise TensorMapError("tensor map file of another version; it will be re-derived")
        ents = [MapEntry(x["gguf_name"], tuple(x["gguf_shape"]),
                         [Link.from_json(lk) for lk in x["links"]], x.get("role", "non_attention"),
                         x.get("tp")) for x in d["entries"]]
        return cls(d["arch"], d["hf_arch"], ents, list(d.get("other", [])),
                   list(d.get("converter_args", [])))


def row_view(p: torch.Tensor, transpose: bool) -> torch.Tensor:
    """A parameter's row view: ``p`` (transposed in its last two dims when ``transpose``) as
    ``(-1, last dim)``; a 1-D parameter is one row."""
    if p.dim() == 1:
        return p.reshape(1, -1)
    if transpose:
        p = p.transpose(-1, -2)
    return p.reshape(-1, p.shape[-1])


_IDX_CACHE: dict = {}


def _idx(a: np.ndarray, device) -> torch.Tensor:
    key = (id(a), str(device))
    t = _IDX_CACHE.get(key)
    if t is None or t[0] is not a:
        t = (a, torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device))
        _IDX_CACHE[key] = t
    return t[1]


# -------------------------------------------------------------------------------- derivation
def _model_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Unique parameters (tied ones once, under their first name)."""
    return list(model.named_parameters(remove_duplicate=True))


def _probe_values(offset: int, numel: int, digit: int | None) -> torch.Tensor:
    """float32 (numel,): 1 everywhere (digit None) or digit ``digit`` of the global element id
    (``offset + i``) plus one, so every probe value is a non-zero integer <= 2**20."""
    if digit is None:
        return torch.ones(numel, dtype=torch.float32)
    ids = torch.arange(offset, offset + numel, dtype=torch.int64)
    return (((ids >> (_DIGIT_BITS * digit)) & _MASK) + 1).to(torch.float32)


def _probe_multipliers(shapes: list[tuple]) -> list[float]:
    """Per parameter, a constant in 1..8 that the probe passes multiply its values by: the
    rank of the parameter among those of the same shape, modulo 8, plus one. Two parameters a
    converter could compare (same shape, e.g. an untied head and the embedding, which the
    converter of a tied-by-default family may drop as "tied" when they are equal) are then
    never equal in the first pass; values stay integers <= 2**23, exact in float32."""
    seen: dict[tuple, int] = {}
    out = []
    for shp in shapes:
        r = seen.get(tuple(shp), 0)
        seen[tuple(shp)] = r + 1
        out.append(float(1 + r % 8))
    return out


def _safetensors_keys(d: Path) -> dict[str, Path]:
    """tensor name -> the ``*.safetensors`` file of folder ``d`` that holds it (headers only)."""
    from safetensors import safe_open
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update((k, f) for k in h.keys())
    return out


def _source_layout(hf_dir: Path, params: dict, probe_dirs: list[Path],
                   offsets: np.ndarray) -> dict[str, str]:
    """The renames that give the probe checkpoints the tensor names of the model's own
    checkpoint (``{saved name: source name}``; empty where they are the same, the usual case).

    transformers renames checkpoint tensors when it loads (its conversion mapping) and renames
    them back when it saves; where the way back is not the way in (transformers 5.25 saves
    Kimi-Linear's dense layer-0 MLP as ``block_sparse_moe.*``), llama.cpp's converter, written
    for the published layout, cannot map the probes' names, though it converts the model's own
    folder. Each tensor that only the saved layout has is identified from its first element's
    probe values (the parameter of ``params``, name -> tensor, in probe order, whose global
    element ids start at ``offsets``) and matched to the one tensor of the same shape and
    values among those only the source has; if any stays unmatched (a tensor saved merged,
    split or transposed), nothing is renamed and the probes keep transformers' layout, as
    before. Reads the headers, each unmatched tensor's first element and the source tensors of
    its shape."""
    import torch
    from safetensors import safe_open
    src = _safetensors_keys(hf_dir)
    saved = [_safetensors_keys(d) for d in probe_dirs]
    only_saved = sorted(set(saved[0]) - set(src))
    if not src or not only_saved:
        return {}
    only_src = sorted(set(src) - set(saved[0]))
    by_shape: dict[tuple, list[str]] = {}
    for k in only_src:
        with safe_open(str(src[k]), "pt") as h:
            by_shape.setdefault(tuple(h.get_slice(k).get_shape()), []).append(k)
    names = list(params)
    renames: dict[str, str] = {}
    for k in only_saved:
        firsts = []
        for files in saved:
            with safe_open(str(files[k]), "pt") as h:
                sl = h.get_slice(k)
                shape = tuple(sl.get_shape())
                first = sl[tuple(slice(0, 1) for _ in shape)] if shape else h.get_tensor(k)
                firsts.append(np.asarray([float(first.reshape(-1)[0])]))
        ids, _ = _decode(firsts)
        gid = int(ids[0])
        i = int(np.searchsorted(offsets, gid, side="right")) - 1
        hits = []
        if gid >= 0 and gid == offsets[i] and tuple(params[names[i]].shape) == shape:
            t = params[names[i]].detach().cpu()
            for c in by_shape.get(shape, []):
                if c in renames.values():
                    continue
                with safe_open(str(src[c]), "pt") as h:
                    ref = h.get_tensor(c)
                if torch.equal(t.to(ref.dtype), ref):
                    hits.append(c)
        if len(hits) != 1:
            _log(f"the probe checkpoints keep transformers' tensor names: {k} (as transformers "
                 f"saves it) matches {len(hits)} tensors of {hf_dir}")
            return {}
        renames[k] = hits[0]
    return renames


def _rename_tensors(d: Path, renames: dict[str, str]) -> None:
    """Renames tensors in folder ``d``'s safetensors files (and its index) by ``renames``."""
    if not renames:
        return
    from safetensors.torch import load_file, save_file
    for f in sorted(d.glob("*.safetensors")):
        sd = load_file(str(f))
        if any(k in renames for k in sd):
            save_file({renames.get(k, k): v for k, v in sd.items()}, str(f),
                      metadata={"format": "pt"})
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        j = json.loads(idx.read_text())
        j["weight_map"] = {renames.get(k, k): v for k, v in j.get("weight_map", {}).items()}
        idx.write_text(json.dumps(j, indent=2))


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' progress bars off inside the block (as they were after it)."""
    from transformers.utils import logging as tlog
    was = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            tlog.enable_progress_bar()


def _run_converter(runs: list[tuple[Path, Path]], converter_args, spec_path: Path) -> list[dict]:
    """Runs :mod:`voodoo._converter_probe` once over ``runs`` ([(hf_dir, out_prefix)]) with the
    pinned source's gguf-py; returns each run's metadata."""
    from .llamacpp import source_dir
    src = source_dir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src / "gguf-py"), str(src)])
    env.setdefault("HF_HUB_OFFLINE", "1")
    spec_path.write_text(json.dumps({"runs": [[str(a), str(b)] for a, b in runs],
                                     "flags": list(converter_args)}))
    script = Path(__file__).with_name("_converter_probe.py")
    from .models import converter_command, run_converter  # raw config.json keys
    r = run_converter(converter_command(script, str(src), str(spec_path)), env=env)
    if r.returncode == 3:
        arch = r.stdout.strip().splitlines()[-1].replace("UNSUPPORTED ", "")
        raise UnsupportedArchitecture(
            f"llama.cpp's converter (pinned source {src}) does not support {arch}: no model "
            f"class is registered for it in convert_hf_to_gguf.py, so llama.cpp cannot run this "
            "model and Voodoo cannot quantize it")
    if r.returncode:
        tail = "\n".join(r.stdout.strip().splitlines()[-15:])
        raise TensorMapError(f"llama.cpp's converter failed on the probe checkpoint of "
                             f"{runs[0][0]}:\n{tail}")
    return [json.loads(Path(str(b) + ".json").read_text()) for _, b in runs]


def _decode(outs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(ones pass, digit passes...) -> (global ids int64, scale float64); ids -1 where the
    element comes from no parameter (scale 0)."""
    s = outs[0].astype(np.float64)
    ids = np.zeros(s.shape, np.int64)
    ok = s != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        for j, o in enumerate(outs[1:]):
            q = o.astype(np.float64) / np.where(ok, s, 1.0)
            d = np.rint(q)
            if ok.any() and np.abs(q - d)[ok].max() > 0.25:
                raise TensorMapError("the converter transforms weights non-linearly (probe "
                                     "digits do not decode)")
            ids += (d.astype(np.int64) - 1) << (_DIGIT_BITS * j)
    ids[~ok] = -1
    return ids, s


def _links_for(name: str, ids2: np.ndarray, s2: np.ndarray, offsets: np.ndarray,
               pnames: list[str], pshapes: list[tuple]) -> list[Link]:
    """Compress one GGUF tensor's decoded ids ``(N, C)`` into row links."""
    n, c = ids2.shape
    if (ids2 < 0).any():
        raise TensorMapError(f"{name}: some elements do not come from any model parameter "
                             "(the converter synthesises them)")
    prow = np.searchsorted(offsets, ids2[:, 0], side="right") - 1
    plast = np.searchsorted(offsets, ids2[:, -1], side="right") - 1
    if not np.array_equal(prow, plast):
        raise TensorMapError(f"{name}: a row mixes several HF parameters")
    links: list[Link] = []
    for p in np.unique(prow):
        rsel = np.nonzero(prow == p)[0]
        loc = ids2[rsel] - offsets[p] if len(rsel) < n else ids2 - offsets[p]
        shp = pshapes[p]
        if len(shp) == 1:
            shp = (1, shp[0])
        last, prev = shp[-1], shp[-2]
        lead = loc // (last * prev)
        i = (loc // last) % prev
        j = loc % last
        # non-transposed: (lead, i) constant along the row; transposed: (lead, j) constant
        lead_const = (lead == lead[:, :1]).all(1)
        plain = lead_const & (i == i[:, :1]).all(1)
        trans = lead_const & (j == j[:, :1]).all(1) & ~plain
        if c == 1:
            trans[:] = False
            plain = lead_const
        if not (plain | trans).all():
            raise TensorMapError(f"{name}: rows are not rows or columns of "
                                 f"{pnames[p]} {tuple(pshapes[p])}")
        for flag, sel in ((False, plain), (True, trans)):
            if not sel.any():
                continue
            rr = rsel[sel]
            if flag:
                prows = lead[sel, 0] * last + j[sel, 0]
                cols = i[sel]
            else:
                prows = lead[sel, 0] * prev + i[sel, 0]
                cols = j[sel]
            # group rows by identical column patterns (usually one)
            if (cols == cols[:1]).all():
                groups = [np.arange(len(rr))]
            else:
                _, inv = np.unique(cols, axis=0, return_inverse=True)
                inv = inv.reshape(-1)
                groups = [np.nonzero(inv == g)[0] for g in range(int(inv.max()) + 1)]
            for ks in groups:
                cc = cols[ks[0]]
                ident = cc.size == (prev if flag else last) and \
                    np.array_equal(cc, np.arange(cc.size))
                ss = s2[rr[ks]]
                sc = ss[:, 0]
                if not (ss == sc[:, None]).all() and \
                        not np.allclose(ss, sc[:, None], rtol=1e-6, atol=0):
                    raise TensorMapError(f"{name}: the converter scales the elements of a row "
                                         f"of {pnames[p]} differently (not supported)")
                links.append(Link(pnames[p], flag, rr[ks].astype(np.int64),
                                  prows[ks].astype(np.int64), None if ident else cc.copy(),
                                  None if np.all(sc == 1.0) else sc.copy()))
    return links


def _fingerprint(model, converter_args) -> str:
    from .llamacpp import llama_cpp_commit
    h = hashlib.sha256()
    cfg = model.config.to_json_string(use_diff=False)
    h.update(re.sub(r'"_name_or_path": "[^"]*"', "", cfg).encode())
    h.update(type(model).__name__.encode())
    for n, p in _model_params(model):
        h.update(f"{n}:{tuple(p.shape)};".encode())
    h.update(json.dumps(list(converter_args)).encode())
    h.update(llama_cpp_commit().encode())
    h.update(Path(__file__).read_bytes())
    h.update(Path(__file__).with_name("_converter_probe.py").read_bytes())
    return h.hexdigest()[:24]


def derive_tensor_map(model: torch.nn.Module, hf_dir: str | os.PathLike,
                      converter_args=(), cache_dir: str | os.PathLike | None = None,
                      progress: bool = True) -> TensorMap:
    """Derives the :class:`TensorMap` of ``model`` (a transformers causal LM, any dtype) whose
    HF folder is ``hf_dir`` (config and tokenizer files are copied from it), running the pinned
    converter on probe checkpoints (module docstring). Cached as JSON under
    ``cache_dir`` (default ``<voodoo cache>/tensormaps``), keyed by the config, the parameter
    names and shapes, the converter flags and the llama.cpp commit.

    Cost: ``1 + ceil(log2(n_params) / 20)`` probe checkpoints (3 for 135M parameters), each
    written and converted once: about the cost of converting the model to F32 three times.

    Raises:
        UnsupportedArchitecture: the converter has no model class for the architecture.
        TensorMapError: a transform the map cannot express (non-linear, elements mixing
            parameters within a row, per-element scales), or the converter failed.
    """
    from .llamacpp import cache_root
    root = Path(cache_dir) if cache_dir else cache_root() / "tensormaps"
    key = _fingerprint(model, converter_args)
    path = root / f"{key}.json"
    if path.is_file():
        try:
            return TensorMap.from_json(json.loads(path.read_text()))
        except (TensorMapError, KeyError, ValueError):
            pass
    params = _model_params(model)
    pnames = [n for n, _ in params]
    pshapes = [tuple(p.shape) for _, p in params]
    sizes = np.asarray([int(np.prod(s)) if s else 1 for s in pshapes], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    total = int(sizes.sum())
    n_digits = max(1, math.ceil(math.log2(total + 1) / _DIGIT_BITS))
    hf_dir = Path(hf_dir)
    work = Path(tempfile.mkdtemp(prefix="voodoo-probe-"))
    try:
        probe = copy.deepcopy(model).float()
        probe_params = dict(probe.named_parameters(remove_duplicate=True))
        mult = _probe_multipliers(pshapes)
        mult_arr = np.asarray(mult, np.float64)
        runs = []
        for pi, digit in enumerate([None] + list(range(n_digits))):
            with torch.no_grad():
                for n, off, sz, c in zip(pnames, offsets, sizes, mult):
                    p = probe_params[n]
                    p.copy_(_probe_values(int(off), int(sz), digit).mul_(c).reshape(p.shape))
            d = work / f"ckpt{pi}"
            with _quiet_transformers():   # its "Writing model shards" bar, once a probe
                probe.save_pretrained(d, safe_serialization=True)
            # the converter reads the model's own config.json and tokenizer files (which
            # transformers may spell differently when it saves: e.g. layer_types)
            for f in hf_dir.iterdir():
                if f.is_file() and \
                        not f.name.endswith((".safetensors", ".bin", ".pt", ".pth")) and \
                        not f.name.endswith(".index.json"):
                    shutil.copy(f, d / f.name)
            runs.append((d, work / f"out{pi}"))
        renames = _source_layout(hf_dir, dict(params), [d for d, _ in runs], offsets)
        for d, _ in runs:
            _rename_tensors(d, renames)
        if progress:
            _log(f"deriving the tensor map: llama.cpp's converter on {len(runs)} probe "
                 f"checkpoints of {total:,} parameters")
        metas = _run_converter(runs, converter_args, work / "spec.json")
        outs_meta = metas[0]
        if not outs_meta["tensors"]:
            raise TensorMapError(
                f"llama.cpp's converter ({outs_meta.get('hf_arch') or type(model).__name__}) "
                "handed no tensor to its GGUF writer for the probe checkpoints, so no tensor "
                "map can be derived; please report it with the model's config.json")
        rule = quantize_rule()

        def selectable(meta):
            return {t["name"] for t in meta["tensors"]
                    if rule.allows(t["name"], tuple(t["shape"]), meta["arch"])}
        names0 = selectable(outs_meta)
        for m in metas[1:]:
            if selectable(m) != names0:
                diff = sorted(names0 ^ selectable(m))
                raise TensorMapError(
                    "llama.cpp's converter wrote different tensors for probe checkpoints that "
                    f"differ only in their values ({', '.join(diff[:6])}): it "
                    "decides what to write from the weights' values, which the tensor map "
                    "cannot follow")
        outs: list[dict[str, np.ndarray]] = []
        for (_, prefix), meta in zip(runs, metas):
            with np.load(str(prefix) + ".npz") as z:
                outs.append({t["name"]: z[f"t{i}"] for i, t in enumerate(meta["tensors"])})
        del probe
        entries, other = [], []
        for t in outs_meta["tensors"]:
            name, shape = t["name"], tuple(t["shape"])
            if not rule.allows(name, shape, outs_meta["arch"]):
                other.append(name)
                continue
            arrs = [o[name] for o in outs]
            ids, s = _decode(arrs)
            ok = ids >= 0   # the first pass's values carry the parameter's multiplier
            s[ok] /= mult_arr[np.searchsorted(offsets, ids[ok], side="right") - 1]
            c = shape[-1]
            links = _links_for(name, ids.reshape(-1, c), s.reshape(-1, c), offsets, pnames,
                               pshapes)
            entries.append(MapEntry(name, shape, links, role_of(name)))
        tmap = TensorMap(outs_meta["arch"], outs_meta["hf_arch"], entries, other,
                         list(converter_args))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    from .fsutil import atomic_write_text
    atomic_write_text(path, json.dumps(tmap.to_json()))
    return tmap


@torch.no_grad()
def _few_rows(got: torch.Tensor, ref: torch.Tensor, rtol, atol, model) -> str:
    """Where only a few rows differ and transformers' copy holds zeros there (e.g. an
    embedding's padding row, which some model classes zero when they initialise, after the
    checkpoint is loaded): a note naming them and the config's pad_token_id; else ""."""
    if got.dim() != 2:
        return ""
    bad = (~torch.isclose(got, ref, rtol=rtol, atol=atol)).any(dim=1).nonzero().flatten()
    if not 0 < len(bad) <= 4 or bool(got[bad].abs().max() > 0):
        return ""
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    rows = ", ".join(str(int(r)) for r in bad)
    return (f": only row{'s' if len(bad) > 1 else ''} {rows}, which transformers' model holds "
            f"as zeros and the checkpoint does not (config.json's pad_token_id is {pad}: a "
            "model class that zeroes its padding row after loading changes the weights; set "
            "pad_token_id to null in config.json, or report it to transformers)")


def check_against_base(tmap: TensorMap, model: torch.nn.Module, base_weights: dict,
                       rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Checks that the model's parameters mapped through ``tmap`` equal the base F32 GGUF's
    tensors (``base_weights``: GGUF name -> numpy array of the GGUF's shape).

    Raises TensorMapError naming the first tensor that differs (its max abs difference), or a
    selectable tensor missing from the base GGUF (a GGUF made by another converter)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for e in tmap:
        if e.gguf_name not in base_weights:
            raise TensorMapError(f"{e.gguf_name} is not in the base F32 GGUF; the GGUF was made "
                                 "by another converter than the pinned one")
        ref = torch.from_numpy(np.array(base_weights[e.gguf_name],
                                        np.float32).reshape(e.shape))
        got = tmap.to_gguf(e.gguf_name, {n: params[n].detach().float().cpu()
                                         for n in e.params})
        if not torch.allclose(got, ref, rtol=rtol, atol=atol):
            diff = float((got - ref).abs().max())
            raise TensorMapError(f"{e.gguf_name}: the model's weights mapped through the derived "
                                 f"tensor map differ from the base F32 GGUF (max |diff| "
                                 f"{diff:.3g})" + (_few_rows(got, ref, rtol, atol, model)
                                                   or "; the map is wrong for this model"))
