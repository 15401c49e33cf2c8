"""Importance matrices (imatrix) as llama.cpp computes, stores and uses them.

What llama-imatrix collects (``tools/imatrix/imatrix.cpp``, ``collect_imatrix``): for every
matrix multiplication ``W·x`` whose weight is named ``blk.*`` (or ``output.weight`` with
``--process-output``), the per-column sum over tokens of ``x²`` (``in_sum2``, length
``n_per_row``) and the number of tokens (``counts``). Batches of fewer than 16 tokens are
ignored. llama-quantize (``tools/quantize/quantize.cpp``, ``load_imatrix``) then weights the
quantization error of column ``j`` by ``in_sum2[j] / counts`` (float32 division; ``counts == 0``
gives 1.0 for every column).

Here the same sums are collected with forward pre-hooks on the HF model's ``nn.Linear`` modules,
in float64 on the float activations torch computes (llama.cpp accumulates float32 and, for
quantized weights, runs the graph on its own kernels, so its sums differ slightly; see
``tests/test_imatrix.py`` for the measured agreement).

**Tied output head.** When ``lm_head`` shares the token embedding, llama.cpp's graph multiplies by
``token_embd.weight``; that name is neither ``blk.*`` nor ``output.weight``, so llama-imatrix
records nothing for the tied head (and never anything for the embedding lookup, a GET_ROWS).
:func:`compute_imatrix` records whatever ``name_map`` asks for: map ``lm_head`` to
``output.weight`` for an untied head (what ``--process-output`` gives); for a tied head, mapping
it to ``token_embd.weight`` gives llama-quantize an imatrix for the shared tensor weighted by the
head's inputs, which llama-imatrix does not provide (leave it out of ``name_map`` to mirror
llama.cpp exactly).

The GGUF file (``save_imatrix``): ``general.type = "imatrix"``, ``imatrix.datasets`` (array of
strings), ``imatrix.chunk_count`` and ``imatrix.chunk_size`` (u32), and per tensor
``<name>.in_sum2`` (F32, ne ``[n_per_row, n_mat]``) and ``<name>.counts`` (F32, ne ``[1, n_mat]``);
``n_mat`` is 1 for dense tensors (the number of experts for MoE). No ``general.architecture``.
"""

from __future__ import annotations

import os
import struct
import tempfile
import weakref
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

#: GGUF KV keys, as ``common/imatrix-loader.h`` names them.
KV_DATASETS = "imatrix.datasets"
KV_CHUNK_COUNT = "imatrix.chunk_count"
KV_CHUNK_SIZE = "imatrix.chunk_size"


class ImatrixError(RuntimeError):
    """An imatrix file cannot be read, or a module named in a name map is unusable."""


# ---------------------------------------------------------------------------------- collecting
@torch.no_grad()
def compute_imatrix(model: torch.nn.Module, blocks: torch.Tensor | Sequence[torch.Tensor],
                    name_map: Mapping[str, str], batch_size: int = 1,
                    progress: bool = False) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Runs ``model`` over ``blocks`` and returns ``(sums, counts)`` as llama-imatrix would.

    ``blocks``: LongTensor ``(n_blocks, seq_len)`` of token ids (or a sequence of such rows),
    fed as they are (no BOS added: put one in the blocks if the model wants it).
    ``name_map``: HF module name (an ``nn.Linear``, e.g. ``model.layers.0.mlp.down_proj``) →
    GGUF name (``blk.0.ffn_down.weight``). Several modules may map to one GGUF name; their
    inputs then accumulate into one entry.

    Returns ``sums[gguf_name]``: float32 ``(n_per_row,)`` = Σ over tokens of ``x[j]²`` (accumulated
    in float64), and ``counts[gguf_name]``: int, the number of tokens (input rows) seen. Raises
    ImatrixError when a module is missing or is not an ``nn.Linear``."""
    modules = dict(model.named_modules())
    acc: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    handles = []

    def make_hook(gname: str, n_in: int):
        def hook(_mod, args):
            x = args[0].detach().reshape(-1, n_in).to(torch.float64)  # (tokens, n_per_row)
            acc[gname] += (x * x).sum(0)
            counts[gname] += x.shape[0]
        return hook

    for hf_name, gname in name_map.items():
        mod = modules.get(hf_name)
        if mod is None:
            raise ImatrixError(f"module {hf_name!r} (for {gname}) is not in the model")
        if not isinstance(mod, torch.nn.Linear):
            raise ImatrixError(f"module {hf_name!r} (for {gname}) is a {type(mod).__name__}, "
                               "not an nn.Linear; the imatrix covers matmul inputs only")
        n = mod.in_features
        if gname in acc and acc[gname].shape[0] != n:
            raise ImatrixError(f"{gname}: modules with different in_features map to it")
        acc.setdefault(gname, torch.zeros(n, dtype=torch.float64))
        counts.setdefault(gname, 0)
        handles.append(mod.register_forward_pre_hook(make_hook(gname, n)))

    if isinstance(blocks, torch.Tensor):
        rows = blocks if blocks.dim() == 2 else blocks.reshape(1, -1)
    else:
        rows = torch.stack([torch.as_tensor(b) for b in blocks])
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    starts = range(0, rows.shape[0], batch_size)
    if progress:
        try:
            from tqdm import tqdm
            starts = tqdm(starts, desc="imatrix", unit="batch")
        except ImportError:  # pragma: no cover
            pass
    try:
        for s in starts:
            model(input_ids=rows[s:s + batch_size].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    sums = {k: v.to(torch.float32).cpu().numpy() for k, v in acc.items()}
    return sums, counts


def compute_hessians(model: torch.nn.Module, blocks: torch.Tensor,
                     name_map: Mapping[str, str], progress: bool | str = False
                     ) -> dict[str, np.ndarray]:
    """The input Hessian of each mapped ``nn.Linear``: ``H = X^T X / n_tokens`` over the
    calibration ``blocks`` (LongTensor ``(n_blocks, seq_len)``), for error-feedback rounding
    (:mod:`voodoo.rounding`).

    ``name_map``: HF ``nn.Linear`` module name -> GGUF name (as for :func:`compute_imatrix`).
    Modules fed the very same input tensor (e.g. q/k/v of one layer) share one accumulation.

    Returns gguf_name -> float32 ``(in_features, in_features)``. Raises ImatrixError as
    :func:`compute_imatrix` does. Memory: 4·in_features² bytes per distinct input (float64
    while accumulating)."""
    modules = dict(model.named_modules())
    acc: dict[str, torch.Tensor] = {}
    alias: dict[str, str] = {}
    # inputs seen in this forward, held weakly: sharing means the very same live tensor object
    # (q/k/v of one layer). An address would not do: a freed input's memory is reused by a
    # later layer's input of the same shape, which then aliased every later q/k/v (and the
    # head) to one early layer's Hessian.
    seen_in_step: list[tuple[weakref.ref, str]] = []
    counts: dict[str, int] = {}
    handles = []

    def make_hook(gname: str, n_in: int):
        def hook(_mod, args):
            x = args[0]
            if gname not in alias:  # first call: does it share another module's input?
                owner = next((g for r, g in seen_in_step if r() is x), None)
                alias[gname] = owner if owner is not None else gname
            if alias[gname] != gname:
                return
            seen_in_step.append((weakref.ref(x), gname))
            x = x.detach()
            x = x.reshape(-1, n_in).to(torch.float32)
            acc.setdefault(gname, torch.zeros(n_in, n_in, dtype=torch.float64))
            acc[gname] += (x.T @ x).to(torch.float64)
            counts[gname] = counts.get(gname, 0) + x.shape[0]
        return hook

    for hf_name, gname in name_map.items():
        mod = modules.get(hf_name)
        if not isinstance(mod, torch.nn.Linear):
            raise ImatrixError(f"module {hf_name!r} (for {gname}) is not an nn.Linear")
        handles.append(mod.register_forward_pre_hook(make_hook(gname, mod.in_features)))
    rows = blocks if blocks.dim() == 2 else blocks.reshape(1, -1)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    it = range(rows.shape[0])
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc=progress if isinstance(progress, str) else "input Hessians",
                  unit="block")
    try:
        with torch.no_grad():
            for i in it:
                seen_in_step.clear()
                model(input_ids=rows[i:i + 1].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    out = {g: (acc[g] / max(counts[g], 1)).to(torch.float32).cpu().numpy() for g in acc}
    for g, owner in alias.items():
        if owner != g:
            out[g] = out[owner]
    return out


def imatrix_from_sums(sums: Mapping[str, np.ndarray],
                      counts: Mapping[str, int | np.ndarray]) -> dict[str, np.ndarray]:
    """The per-column weights llama-quantize uses: ``float32(sums) / float32(counts)``; an entry
    with ``counts == 0`` becomes all 1.0 (``tools/quantize/quantize.cpp``, ``load_imatrix``).

    ``sums[name]``: ``(n_per_row,)`` or ``(n_mat, n_per_row)``; ``counts[name]``: int or
    ``(n_mat,)``. Returns float32 arrays of the same shapes as ``sums``."""
    out = {}
    for name, s in sums.items():
        s = np.asarray(s, dtype=np.float32)
        c = np.asarray(counts[name], dtype=np.float32)
        s2 = s.reshape(-1, s.shape[-1])
        c2 = c.reshape(-1)
        if c2.size != s2.shape[0]:
            raise ImatrixError(f"{name}: {c2.size} counts for {s2.shape[0]} matrices")
        v = np.ones_like(s2)
        ok = c2 > 0
        v[ok] = s2[ok] / c2[ok, None]
        out[name] = v.reshape(s.shape)
    return out


# ------------------------------------------------------------------------------------- writing
def write_imatrix_gguf(path: str | os.PathLike, sums: Mapping[str, np.ndarray],
                       counts: Mapping[str, int | np.ndarray], datasets: Sequence[str],
                       chunk_count: int, chunk_size: int) -> Path:
    """Writes an imatrix in llama.cpp's GGUF format (what llama-imatrix's ``save_imatrix``
    writes; read by ``common_imatrix_load``, hence ``llama-quantize --imatrix FILE``).

    ``sums[name]``: float ``(n_per_row,)`` (or ``(n_mat, n_per_row)``), the raw Σx² per column;
    ``counts[name]``: tokens seen, int (or ``(n_mat,)``). ``datasets``: names of the calibration
    data, at least one (llama-quantize refuses a file without ``imatrix.datasets``, and gguf-py
    cannot write an empty array); ``chunk_count``: chunks processed; ``chunk_size``: tokens per
    chunk (llama-imatrix: ``n_ctx / n_parallel``). Tensors are written sorted by name, as llama.cpp
    does. The write is atomic (temporary file, then rename). Returns the path. Raises ImatrixError
    for inconsistent shapes or non-finite sums (llama-imatrix aborts on those too), ValueError for
    an empty ``datasets``."""
    import gguf
    if isinstance(datasets, str) or not datasets:
        raise ValueError("datasets must be a non-empty list of names")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch="imatrix")
        # llama-imatrix writes no general.architecture; drop the one GGUFWriter adds
        for kv in w.kv_data:
            kv.pop(gguf.Keys.General.ARCHITECTURE, None)
        w.add_type(gguf.GGUFType.IMATRIX)
        w.add_array(KV_DATASETS, [str(d) for d in datasets])
        w.add_uint32(KV_CHUNK_COUNT, int(chunk_count))
        w.add_uint32(KV_CHUNK_SIZE, int(chunk_size))
        for name in sorted(sums):
            s = np.asarray(sums[name], dtype=np.float32)
            s = s.reshape(-1, s.shape[-1])                       # (n_mat, n_per_row)
            c = np.asarray(counts[name], dtype=np.float32).reshape(-1, 1)  # (n_mat, 1)
            if c.shape[0] != s.shape[0]:
                raise ImatrixError(f"{name}: {c.shape[0]} counts for {s.shape[0]} matrices")
            if not np.isfinite(s).all():
                raise ImatrixError(f"{name}: non-finite sums")
            w.add_tensor(f"{name}.in_sum2", s)
            w.add_tensor(f"{name}.counts", c)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        from .fsutil import file_mode
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# ------------------------------------------------------------------------------------- reading
def read_imatrix_raw(path: str | os.PathLike) -> dict:
    """Reads an imatrix file as stored: ``{"sums": {name: float32 (n_mat, n_per_row)},
    "counts": {name: int64 (n_mat,)}, "datasets": [...], "chunk_count": int,
    "chunk_size": int, "legacy": bool}``.

    GGUF files: counts are rounded to integers (``std::lround`` in ``common_imatrix_load``).
    Legacy ``.dat`` files (``save_imatrix_legacy``): ``sums`` hold ``(Σx²/n)·ncall``,
    ``counts`` hold ``ncall``, ``chunk_size`` is 0. Raises ImatrixError when the file is
    neither, or a tensor lacks its partner."""
    path = Path(path)
    if not path.is_file():
        raise ImatrixError(f"imatrix file {path} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _read_gguf(path)
    return _read_legacy(path)


def _read_gguf(path: Path) -> dict:
    import gguf

    from .ggufio import read_gguf
    try:
        r = read_gguf(path)
    except Exception as e:
        raise ImatrixError(f"{path}: not a readable GGUF ({type(e).__name__}: {e}); if Voodoo "
                           "wrote it (a run folder's imatrix.gguf), delete it and it is "
                           "computed again, else pass a good --imatrix file") from None
    sums, counts = {}, {}
    for t in r.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ImatrixError(f"{path}: {t.name} is {t.tensor_type.name}; sums and counts must "
                               "be F32")
        ne = [int(x) for x in t.shape]                   # ggml order: [n_per_row, n_mat]
        data = np.array(t.data, dtype=np.float32).reshape(-1)
        n_mat = int(np.prod(ne[1:])) if len(ne) > 1 else 1
        if t.name.endswith(".in_sum2"):
            sums[t.name[:-len(".in_sum2")]] = data.reshape(n_mat, ne[0])
        elif t.name.endswith(".counts"):
            counts[t.name[:-len(".counts")]] = np.rint(data).astype(np.int64)
    if not sums and not counts:
        raise ImatrixError(f"{path}: no imatrix data (no <name>.in_sum2 tensors)")
    for name in set(sums) ^ set(counts):
        raise ImatrixError(f"{path}: mismatched sums and counts for {name}")

    def kv(key, default):
        f = r.fields.get(key)
        return default if f is None else f.contents()
    return {"sums": sums, "counts": counts, "datasets": list(kv(KV_DATASETS, [])),
            "chunk_count": int(kv(KV_CHUNK_COUNT, 0)), "chunk_size": int(kv(KV_CHUNK_SIZE, 0)),
            "legacy": False}


def quantize_imatrix_kv(path: str | os.PathLike, recorded: str | None = None) -> dict:
    """The ``quantize.imatrix.*`` KV pairs llama-quantize writes when given ``--imatrix path``
    (``tools/quantize/quantize.cpp``, ``main``): ``file`` (the path as given, or ``recorded``
    in its place, at most 127 characters), ``dataset`` (the first of the file's
    ``imatrix.datasets``, at most 127; absent when it has none), ``entries_count`` (the
    number of tensors it holds) and ``chunks_count`` (its chunk count; absent when 0). The
    counts are ``np.uint32``: llama.cpp writes integer overrides as UINT32
    (``llama_model_quantize_impl``, ``src/llama-quant.cpp``). Raises ImatrixError when the
    file cannot be read."""
    from .export import QUANTIZE_IMATRIX_PREFIX
    raw = read_imatrix_raw(path)
    kv: dict = {QUANTIZE_IMATRIX_PREFIX + "file":
                str(path if recorded is None else recorded)[:127]}
    if raw["datasets"]:
        kv[QUANTIZE_IMATRIX_PREFIX + "dataset"] = str(raw["datasets"][0])[:127]
    kv[QUANTIZE_IMATRIX_PREFIX + "entries_count"] = np.uint32(len(raw["sums"]))
    if raw["chunk_count"] > 0:
        kv[QUANTIZE_IMATRIX_PREFIX + "chunks_count"] = np.uint32(raw["chunk_count"])
    return kv


def _read_legacy(path: Path) -> dict:
    buf = path.read_bytes()
    pos = 0

    def take(fmt):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(buf):
            raise ImatrixError(f"{path}: truncated legacy imatrix (or not an imatrix file)")
        v = struct.unpack_from(fmt, buf, pos)
        pos += size
        return v
    (n_entries,) = take("<i")
    if n_entries < 1 or n_entries > 1_000_000:
        raise ImatrixError(f"{path}: neither a GGUF nor a legacy imatrix file")
    sums, counts = {}, {}
    for _ in range(n_entries):
        (ln,) = take("<i")
        if ln < 0 or ln > 4096:
            raise ImatrixError(f"{path}: neither a GGUF nor a legacy imatrix file")
        name = bytes(take(f"<{ln}s")[0]).decode("utf-8", "replace")
        ncall, nval = take("<ii")
        if nval < 1:
            raise ImatrixError(f"{path}: entry {name} has no values")
        vals = np.array(take(f"<{nval}f"), dtype=np.float32)
        sums[name] = vals.reshape(1, nval)
        counts[name] = np.array([ncall], dtype=np.int64)
    chunk_count, datasets = 0, []
    if pos + 4 <= len(buf):
        (chunk_count,) = take("<i")
        if pos + 4 <= len(buf):
            (ln,) = take("<i")
            if ln > 0 and pos + ln <= len(buf):
                datasets.append(buf[pos:pos + ln].decode("utf-8", "replace"))
    return {"sums": sums, "counts": counts, "datasets": datasets, "chunk_count": chunk_count,
            "chunk_size": 0, "legacy": True}


def read_imatrix(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """``{gguf_name: float32 (n_per_row,)}``: the per-column weights llama-quantize would use
    (``tools/quantize/quantize.cpp``, ``load_imatrix``).

    GGUF: ``in_sum2 / counts`` in float32, all 1.0 where ``counts == 0``. Legacy ``.dat``:
    ``sums / ncall`` (``sums`` as stored when ``ncall == 0``). MoE entries (``n_mat > 1``) come
    back as ``(n_mat, n_per_row)``. Raises ImatrixError (see :func:`read_imatrix_raw`)."""
    raw = read_imatrix_raw(path)
    out = {}
    for name, s in raw["sums"].items():
        c = raw["counts"][name]
        if raw["legacy"]:
            ncall = int(c[0]) if c.size else 0
            v = (s / np.float32(ncall)).astype(np.float32) if ncall > 0 else s.copy()
        else:
            v = imatrix_from_sums({name: s}, {name: c})[name]
        out[name] = v[0] if v.shape[0] == 1 else v
    return out


def llama_imatrix(base_gguf: str | os.PathLike, blocks, out_path: str | os.PathLike,
                  tokenizer, threads: int | None = None, timeout: float | None = None) -> Path:
    """Computes the imatrix with llama.cpp's own ``llama-imatrix`` on the base F32 GGUF and
    writes it (GGUF format) to ``out_path``, atomically. Used for models whose selectable
    tensors are not all plain ``nn.Linear`` weights (stacked experts get one vector per expert,
    as llama-imatrix writes them).

    ``blocks``: (N, T) int64 calibration tokens, decoded with ``tokenizer`` to the text file
    llama-imatrix reads (``-c T --chunks N``; it re-tokenizes, so chunk boundaries follow its
    tokenizer); ``--process-output`` so the output head is collected too (as the torch path
    does). Raises RuntimeError with the tool's output tail when it fails or writes nothing."""
    import subprocess
    import tempfile

    from .llamacpp import tool_env, tool_path
    from .llamatext import llama_join
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    n, t = int(blocks.shape[0]), int(blocks.shape[1])
    with tempfile.TemporaryDirectory(dir=out_path.parent) as tmp:
        text = Path(tmp) / "calibration.txt"
        text.write_text(llama_join(base_gguf, (tokenizer.decode(b.tolist()) for b in blocks),
                                   "the calibration text for llama-imatrix"))
        part = Path(tmp) / "imatrix.gguf"
        cmd = [str(tool_path("llama-imatrix")), "-m", str(base_gguf), "-f", str(text),
               "-o", str(part), "-c", str(t), "--chunks", str(n), "--no-ppl",
               "--process-output", "-t", str(threads or os.cpu_count() or 1)]
        from .proc import die_with_parent
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           errors="replace", timeout=timeout, env=tool_env(),
                           preexec_fn=die_with_parent)
        if r.returncode or not part.is_file():
            tail = "\n".join(r.stdout.strip().splitlines()[-15:])
            raise RuntimeError(f"llama-imatrix failed on {base_gguf}:\n{tail}")
        os.replace(part, out_path)
    return out_path
