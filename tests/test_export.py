"""voodoo.export: the exported GGUF holds the given bytes; llama-quantize with the written
tensor-type file and the same imatrix reproduces it byte for byte; llama.cpp loads it."""

from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
from voodoo.ggufio import read_gguf

import cython_ggml
from voodoo.export import (ExportError, assignment_types, export_gguf, output_name,
                           quantize_with_llama, tensor_pattern, write_tensor_type_file)
from voodoo.llamacpp import LlamaCppNotBuilt, tool_env, tool_path

#: A mixed assignment for the tiny model: k-quants, i-quants needing an imatrix, Q8_0.
MIXED = {
    "token_embd.weight": "Q4_K",
    "blk.0.attn_q.weight": "Q6_K", "blk.0.attn_k.weight": "Q8_0",
    "blk.0.attn_v.weight": "IQ4_XS", "blk.0.attn_output.weight": "IQ3_S",
    "blk.0.ffn_gate.weight": "IQ2_XXS", "blk.0.ffn_up.weight": "Q4_K",
    "blk.0.ffn_down.weight": "IQ1_S",
    "blk.1.attn_q.weight": "Q5_K", "blk.1.attn_k.weight": "Q4_0",
    "blk.1.attn_v.weight": "Q2_K", "blk.1.attn_output.weight": "IQ2_S",
    "blk.1.ffn_gate.weight": "IQ3_XXS", "blk.1.ffn_up.weight": "Q3_K",
    "blk.1.ffn_down.weight": "IQ2_XS",
}
IMATRIX_COUNT = 7


def _base_tensors(path):
    return {t.name: t for t in read_gguf(path).tensors}


def _imatrix_sums(base_gguf, names, seed=0):
    """Per-tensor (sums, count) of a made-up imatrix: positive, varied per column."""
    rng = np.random.default_rng(seed)
    tensors = _base_tensors(base_gguf)
    out = {}
    for n in names:
        n_per_row = int(tensors[n].shape[0])
        sums = (rng.gamma(0.5, 2.0, n_per_row) * IMATRIX_COUNT).astype(np.float32)
        out[n] = (sums, IMATRIX_COUNT)
    return out


def _imatrix_rows(sums):
    """What llama-quantize feeds libggml: sums / counts in float32 (tools/quantize)."""
    return {n: (s / np.float32(c)).astype(np.float32) for n, (s, c) in sums.items()}


def write_imatrix_gguf(path, sums):
    """An imatrix in llama.cpp's GGUF format (common/imatrix-loader.cpp): tensors
    ``<name>.in_sum2`` (F32, n_per_row) and ``<name>.counts`` (F32, 1), KV
    ``imatrix.datasets``, ``imatrix.chunk_count``, ``imatrix.chunk_size``; general.type
    "imatrix"."""
    w = GGUFWriter(path, "llama")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["voodoo-test"])
    w.add_uint32("imatrix.chunk_count", 1)
    w.add_uint32("imatrix.chunk_size", 512)
    for n, (s, c) in sums.items():
        w.add_tensor(n + ".in_sum2", s.reshape(1, -1))
        w.add_tensor(n + ".counts", np.array([[c]], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _lookup_from(base_gguf, imatrix_rows, calls=None):
    tensors = _base_tensors(base_gguf)

    def lookup(name, type_name):
        if calls is not None:
            calls.append((name, type_name))
        w = np.ascontiguousarray(np.asarray(tensors[name].data, dtype=np.float32))
        return cython_ggml.quantize(w, type_name, imatrix_rows.get(name), tensor_name=name)
    return lookup


# ------------------------------------------------------------------------------- names
def test_tensor_pattern_is_anchored():
    import re
    p = tensor_pattern("blk.1.attn_q.weight")
    assert p == r"^blk\.1\.attn_q\.weight$"
    assert re.search(p, "blk.1.attn_q.weight")
    assert not re.search(p, "blk.11.attn_q.weight") and not re.search(p, "blk.1xattn_q.weight")
    with pytest.raises(ValueError):
        tensor_pattern("Blk.0.X.weight")


def test_write_tensor_type_file(tmp_path):
    f = write_tensor_type_file({"blk.0.attn_q.weight": "Q4_K", "output.weight": {"type": "q8_0"}},
                               tmp_path / "tt.txt")
    assert f.read_text().split() == [r"^blk\.0\.attn_q\.weight$=q4_k",
                                     r"^output\.weight$=q8_0"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_output_name_and_assignment_forms(tmp_path):
    from voodoo.quants import nearest_ftype
    assert output_name("SmolLM2-135M-Instruct", 45, 4.6) == \
        f"SmolLM2-135M-Instruct.Voodoo45_{nearest_ftype(4.6)}.gguf"
    assert output_name("SmolLM2-135M-Instruct", 45.2, 8.5) == \
        "SmolLM2-135M-Instruct.Voodoo45_Q8_0.gguf"
    assert output_name("M", 30.4, 2.05) == "M.Voodoo30_IQ2_XXS.gguf"
    # rows that are not a multiple of 32 stay F16: a file at 14-16 bpw is no "Q8_0"
    assert output_name("M", 100, 16.0) == "M.Voodoo100_F16.gguf"
    assert output_name("M", 95, 14.0) == "M.Voodoo95_F16.gguf"
    a = {"budget_bytes": 1, "total_bytes": 1,
         "tensors": {"x.weight": {"type": "q4_k", "bytes": 1, "menu": [], "probs": []}}}
    import json
    (tmp_path / "a.json").write_text(json.dumps(a))
    assert assignment_types(a) == assignment_types(tmp_path / "a.json") == {"x.weight": "Q4_K"}
    with pytest.raises(ValueError):
        assignment_types({"x.weight": "Q9_K"})


# ------------------------------------------------------------------------------ export
def test_export_writes_given_bytes(tiny_prepared, tmp_path):
    base = tiny_prepared.base_gguf
    rows = _imatrix_rows(_imatrix_sums(base, [n for n in MIXED if n != "token_embd.weight"]))
    calls = []
    out = export_gguf(base, {"tensors": {n: {"type": t} for n, t in MIXED.items()}},
                      _lookup_from(base, rows, calls), tmp_path / "out.gguf",
                      extra_kv={"voodoo.version": "test"})
    assert sorted(calls) == sorted(MIXED.items())
    assert [p.name for p in tmp_path.iterdir()] == ["out.gguf"]      # no temp file left
    src, got = read_gguf(base), read_gguf(out)
    assert [t.name for t in got.tensors] == [t.name for t in src.tensors]
    base_t = {t.name: t for t in src.tensors}
    lookup = _lookup_from(base, rows)
    for t in got.tensors:
        b = base_t[t.name]
        assert list(t.shape) == list(b.shape)
        if t.name in MIXED:
            assert t.tensor_type == GGMLQuantizationType[MIXED[t.name]], t.name
            want = lookup(t.name, MIXED[t.name])
            assert np.array_equal(np.asarray(t.data).reshape(want.shape), want), t.name
        else:
            assert t.tensor_type == GGMLQuantizationType.F32
            assert np.array_equal(np.asarray(t.data), np.asarray(b.data))
    # metadata and tokenizer copied; file type and version set
    for k in ("llama.block_count", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
              "llama.attention.head_count_kv"):
        assert got.fields[k].contents() == src.fields[k].contents(), k
    assert got.fields["tokenizer.ggml.tokens"].contents() == \
        src.fields["tokenizer.ggml.tokens"].contents()
    assert got.fields["tokenizer.ggml.merges"].contents()[:100] == \
        src.fields["tokenizer.ggml.merges"].contents()[:100]
    # general.file_type is the badge output_name gives the file: the llama.cpp file type
    # nearest the assigned tensors' bpw
    assigned = [t for t in got.tensors if t.name in MIXED]
    bpw = 8 * sum(int(t.n_bytes) for t in assigned) / sum(int(t.n_elements) for t in assigned)
    badge = output_name("M", 50, bpw).removesuffix(".gguf").split("_", 1)[1]
    assert badge == "IQ4_NL"  # 4.41 bpw
    assert got.fields["general.file_type"].contents() == int(LlamaFileType.MOSTLY_IQ4_NL)
    assert got.fields["general.quantization_version"].contents() == 2
    assert got.fields["voodoo.version"].contents() == "test"


def test_export_applies_shape_fallback(tiny_prepared, tmp_path):
    """Types go through llama.cpp's fallback for the row length: the lookup is asked for the
    type llama.cpp writes. (The tiny model's rows are multiples of 256, so nothing falls back;
    a Q4_0 request stays Q4_0.)"""
    base = tiny_prepared.base_gguf
    calls = []
    export_gguf(base, {"blk.0.ffn_down.weight": "Q4_0"}, _lookup_from(base, {}, calls),
                tmp_path / "o.gguf")
    assert calls == [("blk.0.ffn_down.weight", "Q4_0")]


def test_export_failure_leaves_no_file(tiny_prepared, tmp_path):
    base = tiny_prepared.base_gguf
    out = tmp_path / "out.gguf"

    def broken(name, type_name):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_gguf(base, {"blk.0.attn_q.weight": "Q8_0"}, broken, out)
    assert list(tmp_path.iterdir()) == []

    def short(name, type_name):
        return np.zeros((3, 10), np.uint8)

    with pytest.raises(ExportError, match="blk.0.attn_q.weight"):
        export_gguf(base, {"blk.0.attn_q.weight": "Q8_0"}, short, out)
    with pytest.raises(KeyError, match="blk.9"):
        export_gguf(base, {"blk.9.attn_q.weight": "Q8_0"}, short, out)
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_named_as_such(tiny_prepared, tmp_path, monkeypatch):
    """A write that runs out of space (ENOSPC, or numpy's short write "N requested and M
    written", which has no errno and was all the CLI printed) is reported as a full disk,
    naming the file and what is free; no partial file is left. Really full where a tmpfs can
    be mounted (root), else the same error raised by the writer."""
    import errno
    import shutil

    from voodoo.fsutil import is_disk_full
    assert is_disk_full(OSError("4325376 requested and 867072 written"))
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(ValueError("4 requested and 1 written"))
    base = tiny_prepared.base_gguf
    small = tmp_path / "small"
    small.mkdir()
    mounted = shutil.which("mount") and os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)],
        capture_output=True).returncode == 0
    real_write = GGUFWriter.write_tensor_data
    try:
        if not mounted:
            def full(self, tensor):
                raise OSError("4325376 requested and 867072 written")
            monkeypatch.setattr(GGUFWriter, "write_tensor_data", full)
        asg = {"token_embd.weight": "Q8_0"}   # the file is MBs: more than the 256 KiB mount
        with pytest.raises(ExportError, match=r"no space left on the device of .*small while "
                                              r"writing out.gguf \([\d.]+ MiB free, at least "
                                              r"[\d.]+ MiB") as e:
            export_gguf(base, asg, _lookup_from(base, {}), small / "out.gguf")
        assert list(small.iterdir()) == []
        # "needed" is the whole file's size, metadata (the tokenizer) included, to 0.1 MiB
        need = float(re.search(r"at least ([\d.]+) MiB", str(e.value)).group(1))
        monkeypatch.setattr(GGUFWriter, "write_tensor_data", real_write)
        size = export_gguf(base, asg, _lookup_from(base, {}), tmp_path / "out.gguf").stat().st_size
        assert abs(need - size / 2**20) <= 0.06, (need, size / 2**20)
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], check=True)


# ------------------------------------------------------------ against llama.cpp's tools
def _tool(name):
    try:
        return tool_path(name)
    except LlamaCppNotBuilt as e:
        pytest.skip(f"{name} not built: {e}")


@pytest.mark.slow
def test_export_matches_llama_quantize_and_loads(tiny_prepared, tmp_path):
    _tool("llama-quantize")
    base = tiny_prepared.base_gguf
    names = [n for n in MIXED if n != "token_embd.weight"]
    sums = _imatrix_sums(base, names, seed=1)
    imatrix = tmp_path / "imatrix.gguf"
    write_imatrix_gguf(imatrix, sums)
    ours = export_gguf(base, MIXED, _lookup_from(base, _imatrix_rows(sums)),
                       tmp_path / "ours.gguf")
    tt = write_tensor_type_file(MIXED, tmp_path / "tensor_types.txt", base_gguf=base)
    theirs = quantize_with_llama(base, tmp_path / "theirs.gguf", tt, imatrix, "Q8_0",
                                 n_threads=2)
    a = {t.name: t for t in read_gguf(ours).tensors}
    b = {t.name: t for t in read_gguf(theirs).tensors}
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].tensor_type == b[n].tensor_type, n
        assert list(a[n].shape) == list(b[n].shape), n
        assert np.array_equal(np.asarray(a[n].data).view(np.uint8),
                              np.asarray(b[n].data).view(np.uint8)), f"{n} bytes differ"

    # llama.cpp loads and runs the exported file. --no-repack: a native build on an AMX CPU
    # repacks weights into AMX tiles, which some VMs' kernels refuse (SIGILL on tilezero).
    ppl = _tool("llama-perplexity")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["The quick brown fox jumps over the lazy dog."] * 60))
    r = subprocess.run([str(ppl), "-m", str(ours), "-f", str(text), "-c", "64", "-b", "64",
                        "--chunks", "2", "-t", "2", "--no-repack"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                       env=tool_env())
    assert r.returncode == 0, r.stdout[-3000:]
    assert "Final estimate: PPL" in r.stdout, r.stdout[-3000:]


@pytest.mark.slow
def test_quantize_with_llama_reports_failure(tiny_prepared, tmp_path):
    _tool("llama-quantize")
    tt = write_tensor_type_file({"blk.0.ffn_gate.weight": "IQ2_XXS"}, tmp_path / "tt.txt")
    with pytest.raises(ExportError, match="imatrix"):
        quantize_with_llama(tiny_prepared.base_gguf, tmp_path / "o.gguf", tt, None, "Q8_0")
    assert not (tmp_path / "o.gguf").exists()


def test_export_removes_a_killed_exports_partial_file(tiny_prepared, tmp_path):
    """A ``.partial`` temp file left by an export killed with SIGKILL (its pid is gone) is
    removed by the next export of that file; one of a live process is left alone."""
    import os
    import subprocess
    import sys
    base = tiny_prepared.base_gguf
    out = tmp_path / "o.gguf"
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True, check=True)
    dead = tmp_path / f".o.gguf.{int(p.stdout)}.abc123.partial"   # that process has exited
    live = tmp_path / f".o.gguf.{os.getpid()}.def456.partial"
    dead.write_bytes(b"x" * 100)
    live.write_bytes(b"y")
    export_gguf(base, {"blk.0.ffn_down.weight": "Q4_0"}, _lookup_from(base, {}), out)
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted([out.name, live.name])
    # and llama-quantize's unfinished file of a SIGKILLed run (a stock file of `voodoo run`)
    stock = tmp_path / "stock"
    stock.mkdir()
    dead_q = stock / f".q.gguf.{int(p.stdout)}.llama-quantize.partial"
    dead_q.write_bytes(b"z" * 100)
    quantize_with_llama(base, stock / "q.gguf", default_type="Q8_0")
    assert sorted(f.name for f in stock.iterdir()) == ["q.gguf"]


def test_an_unwritable_model_index_costs_only_the_lookup(tiny_prepared, tmp_path, monkeypatch,
                                                          capsys):
    """A read-only or broken ``<cache>/models/by-sha256`` stopped the export after training
    (the assignment already replaced, the GGUF not); now one warning, and the id is still
    returned (and written into the GGUF)."""
    import voodoo.export as ex
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    monkeypatch.setattr(ex, "_index_dir", lambda: blocker / "by-sha256")
    mid = ex.record_model(tiny_prepared, sha256="ab" * 32)
    assert mid == ex.model_id(tiny_prepared.name, "ab" * 32)
    err = capsys.readouterr().err
    assert "cannot record which model sha256 abababababab" in err and "--model" in err


def test_a_folder_where_the_gguf_goes_is_named(tmp_path):
    """A folder at the output GGUF's path: the log said '... exists; it is replaced', then the
    export died with '[Errno 21] Is a directory' at the rename; it is refused first, naming
    the way out."""
    from voodoo.export import ExportError
    from voodoo.pipeline import export
    d = tmp_path / "m.Voodoo55.gguf"
    d.mkdir()
    with pytest.raises(ExportError, match=r"m.Voodoo55.gguf is a folder, where the GGUF would "
                                          r"be written.*--output_name"):
        export(None, {"tensors": {}}, {}, None, d)


def test_output_name_takes_the_matched_file_type_as_its_badge():
    """``--match_size Q3_K_S`` named a file of the stock Q3_K_S's size ``…_Q4_K_M`` (the
    nominal bpw nearest its own), which llama.cpp then showed as "Q4_K - Medium": the matched
    type is the badge; a byte target, a file or no --match_size keep the nearest-bpw one."""
    from types import SimpleNamespace

    from voodoo.cli import _match_badge
    assert output_name("M", 58, 4.94) == "M.Voodoo58_Q4_K_M.gguf"
    assert output_name("M", 58, 4.94, badge="Q3_K_S") == "M.Voodoo58_Q3_K_S.gguf"
    assert _match_badge(SimpleNamespace(match_size="q3_k_s")) == "Q3_K_S"
    for m in (None, "20000000", "Q9_K"):
        assert _match_badge(SimpleNamespace(match_size=m)) is None, m


def test_provenance_names_the_imatrix_as_llama_quantize_does(tmp_path, capsys):
    """``quantize.imatrix.*`` from the imatrix file (llama-quantize's keys, counts as UINT32);
    an imatrix gone by export time costs the keys and a line, not the export."""
    from types import SimpleNamespace

    from voodoo import cli
    from voodoo.imatrix import write_imatrix_gguf
    names = ("blk.0.attn_q.weight", "blk.0.ffn_up.weight")
    im = write_imatrix_gguf(tmp_path / "im.gguf", {n: np.ones((1, 8), np.float32) for n in names},
                            {n: np.array([64]) for n in names}, datasets=["calib.txt"],
                            chunk_count=4, chunk_size=16)
    prepared = SimpleNamespace()
    asg = {"total_bytes": 1, "budget_bytes": 1, "tensors": {}}
    import voodoo.export as ex
    orig = ex.record_model
    ex.record_model = lambda p: "M@sha256:00"
    try:
        kv = cli._provenance(SimpleNamespace(), asg, prepared, None, im)
        assert kv["quantize.imatrix.file"] == "im.gguf"   # its name: no local path
        assert kv["quantize.imatrix.dataset"] == "calib.txt"
        assert kv["quantize.imatrix.entries_count"] == 2
        assert kv["quantize.imatrix.chunks_count"] == 4
        assert type(kv["quantize.imatrix.chunks_count"]) is np.uint32
        kv = cli._provenance(SimpleNamespace(), asg, prepared, None, tmp_path / "gone.gguf")
        assert not any(k.startswith("quantize.") for k in kv) and "voodoo.model" in kv
        assert "the GGUF names no imatrix" in capsys.readouterr().err
    finally:
        ex.record_model = orig
