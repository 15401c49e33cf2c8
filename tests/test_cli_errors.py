"""Bad input gives a clear error and loses nothing: exit code 2, one line ``voodoo CMD: error:
...`` naming the problem and the fix, no traceback; checks that can run before expensive work
do (nothing of the later stages is written); files already there are kept."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from test_pipeline import run_cli, tiny_fixed  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--seq_len", "64", "--n_train_blocks", "8", "--n_eval_blocks", "2",
         "--imatrix_blocks", "4", "--no_ray", "--max_steps", "2"]


def error_line(rc: int, stderr: str, cmd: str = "train") -> str:
    """Asserts exit code 2 and exactly one ``voodoo CMD: error:`` line with no traceback;
    returns it."""
    assert rc == 2, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith(f"voodoo {cmd}: error:")]
    assert len(lines) == 1, stderr[-2000:]
    return lines[0]


def nothing_written(out: Path) -> None:
    """No stage output in ``out`` (the folder may exist, empty)."""
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())


# ------------------------------------------------------------------------------- the model
def test_model_path_missing(tmp_path):
    out = tmp_path / "out"
    rc, _, err = run_cli(["train", "--model", str(tmp_path / "no-such-model"),
                          "--output_dir", str(out), *SMALL])
    line = error_line(rc, err)
    assert "no-such-model" in line and "no such file or folder" in line
    assert "HF model folder, a .gguf file" in line and "`default`" in line
    assert "load model" not in err, err[-2000:]  # refused before any stage starts
    nothing_written(out)


def test_model_not_a_causal_lm(tmp_path):
    d = tmp_path / "bert"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 64,
        "vocab_size": 100}))
    out = tmp_path / "out"
    rc, _, err = run_cli(["train", "--model", str(d), "--output_dir", str(out), *SMALL])
    line = error_line(rc, err)
    assert "BertForMaskedLM" in line and "not a causal language model" in line
    nothing_written(out)


def test_architecture_the_converter_does_not_know(tmp_path):
    """A causal LM that llama.cpp's pinned converter does not register fails before any
    conversion, naming the architecture and the converter (any architecture it does register
    is supported: no adapter needed)."""
    d = tmp_path / "foobar"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["FooBarForCausalLM"], "model_type": "foobar", "hidden_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 64,
        "vocab_size": 100}))
    out = tmp_path / "out"
    t0 = time.perf_counter()
    rc, _, err = run_cli(["train", "--model", str(d), "--output_dir", str(out), *SMALL])
    line = error_line(rc, err)
    assert "FooBarForCausalLM" in line and "convert_hf_to_gguf.py" in line, line
    assert time.perf_counter() - t0 < 60
    nothing_written(out)


# ---------------------------------------------------------------------------- the budget
def test_unreachable_compression_ratio(tiny_fixed, tmp_path):  # noqa: F811
    """Checked as soon as the menus are known: no data, imatrix or candidates are made."""
    out = tmp_path / "out"
    rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                          *SMALL, "--compression_ratio", "0.05"])
    line = error_line(rc, err)
    assert "reachable range" in line and "compression ratio" in line
    import re
    m = re.search(r"compression ratio (\d\.\d+)\.\.(\d\.\d+)", line)
    assert m and float(m.group(1)) < float(m.group(2)) and float(m.group(1)) > 0.05, line
    nothing_written(out)
    # --match_size of a file no assignment reaches: the range in the same unit, bytes of file
    rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                          *SMALL, "--match_size", "2000000000"])
    line = error_line(rc, err)
    m = re.search(r"--match_size 2000000000: a file of 2,000,000,000 bytes is out of reach; "
                  r"with these menus the files Voodoo writes are ([\d,]+) to ([\d,]+) bytes",
                  line)
    assert m, line
    lo, hi = (int(g.replace(",", "")) for g in m.groups())
    assert 0 < lo < hi < 2_000_000_000 and "--candidate_types" in line, line
    nothing_written(out)


# ---------------------------------------------------------------------- training numbers
@pytest.mark.parametrize("flag, value", [("--fisher_blocks", "0"), ("--max_steps", "0"),
                                         ("--lr", "-1"), ("--gate_init_strength", "0"),
                                         ("--gate_init_strength", "inf")])
def test_bad_training_numbers_before_any_work(flag, value, tmp_path):
    """Rejected before the model is loaded (the model path here does not exist)."""
    out = tmp_path / "out"
    rc, _, err = run_cli(["train", "--model", str(tmp_path / "model-not-needed"),
                          "--output_dir", str(out), *SMALL, flag, value])
    line = error_line(rc, err)
    assert flag in line and value in line, line
    nothing_written(out)


@pytest.mark.parametrize("cmd, flags, words", [
    ("train", ["--match_size", "Q9_K"], ["--match_size 'Q9_K'", "IQ4_XS", "number of bytes"]),
    ("run", ["--match_size", "Q9_K"], ["--match_size 'Q9_K'", "IQ4_XS"]),
    ("train", ["--data_name", "no-such-dir/calib.txt"], ["calib.txt does not exist",
                                                         "leave --data_name out"]),
    ("train", ["--data_name", "@DOCX@"], ["unsupported file type '.docx'", ".jsonl"]),
    ("run", ["--ctx", "64", "--chunks", "2"], ["scores 62 tokens", "raise --chunks"]),
    ("eval", ["--ctx", "64", "--chunks", "2", "--gguf", "x.gguf"], ["scores 62 tokens"]),
])
def test_bad_match_size_or_data_before_any_work(cmd, flags, words, tmp_path):
    """A file type llama.cpp does not have and a calibration file that is missing or of an
    unknown kind are refused before the model is loaded (the model path here does not exist)."""
    if "@DOCX@" in flags:
        docx = tmp_path / "calib.docx"
        docx.write_text("text")
        flags = [str(docx) if f == "@DOCX@" else f for f in flags]
    out = tmp_path / "out"
    common = ["--model", str(tmp_path / "model-not-needed"), "--output_dir", str(out)]
    rc, _, err = run_cli([cmd, *common, *(SMALL if cmd != "eval" else []), *flags])
    line = error_line(rc, err, cmd)
    assert all(w in line for w in words), line
    nothing_written(out)


@pytest.mark.parametrize("cmd", ["eval", "chat", "serve", "run"])
def test_gguf_that_is_no_model(cmd, tmp_path):
    """An imatrix GGUF (no general.architecture) or a file that is no GGUF given as --gguf is
    refused with one line saying what it is, before llama.cpp prints its own errors."""
    import numpy as np

    from voodoo.imatrix import write_imatrix_gguf
    im = tmp_path / "imatrix.gguf"
    write_imatrix_gguf(im, {"blk.0.attn_q.weight": np.ones(64, np.float32)},
                       {"blk.0.attn_q.weight": 4}, ["calib.txt"], 1, 64)
    flag = "--model" if cmd == "run" else "--gguf"   # run: the model to quantize
    out = ["--output_dir", str(tmp_path / "out")] if cmd == "run" else []
    rc, _, err = run_cli([cmd, flag, str(im), *out])
    line = error_line(rc, err, cmd)
    assert "without general.architecture" in line and "imatrix" in line, line
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    rc, _, err = run_cli([cmd, flag, str(not_gguf), *out])
    assert "not a readable GGUF file" in error_line(rc, err, cmd)


def _model_gguf(path, model=None):
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), "llama")
    if model is not None:
        w.add_string("voodoo.model", model)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_eval_split_too_short_for_llama_perplexity_is_refused_before_work(tmp_path,
                                                                        monkeypatch):
    """Without --eval_text and ../shared's WikiText, llama-perplexity scores the eval split;
    one too short for --ctx used to fail after training with llama.cpp's own message ("you need
    at least 256 tokens"). Now: one line before the model loads, naming the flags that fix it;
    enough blocks, or an --eval_text, pass the check."""
    from voodoo import cli
    monkeypatch.setattr(cli, "_default_eval_text", lambda: None)
    out = tmp_path / "out"
    argv = ["run", "--model", str(tmp_path / "not-loaded"), "--output_dir", str(out), *SMALL,
            "--ctx", "128", "--chunks", "2"]
    rc, _, err = run_cli(argv)
    line = error_line(rc, err, "run")
    assert "2 blocks x 64 tokens = 128 tokens" in line and "--ctx 128" in line, line
    assert "--eval_text" in line and "--n_eval_blocks" in line, line
    nothing_written(out)
    ok = cli._check_eval_split_length
    from types import SimpleNamespace
    ok(SimpleNamespace(eval_text=None, ctx=128, chunks=2, n_eval_blocks=4, seq_len=64))
    ok(SimpleNamespace(eval_text="x.txt", ctx=128, chunks=2, n_eval_blocks=2, seq_len=64))
    with pytest.raises(cli.UsageError, match="it needs 256"):
        # 4 chunks of 64 hold only 2 usable: 2 x 31 = 62 scored tokens < 100
        ok(SimpleNamespace(eval_text=None, ctx=64, chunks=4, n_eval_blocks=2, seq_len=64))


def test_eval_refuses_to_score_a_gguf_against_a_model_it_was_not_made_from(tmp_path, capsys):
    """Without --model, a GGUF that records no voodoo.model used to be scored against the
    default model, and several GGUFs against the first one's model, as valid-looking rows
    (KLD 16.9, same top-p 0). Now: one line with the way out; with --model, a warning for a
    file that records another model."""
    from types import SimpleNamespace

    from voodoo import cli
    stock = _model_gguf(tmp_path / "stock.Q4_K_M.gguf")
    a = _model_gguf(tmp_path / "a.gguf", "ModelA@sha256:" + "a" * 64)
    b = _model_gguf(tmp_path / "b.gguf", "ModelB@sha256:" + "b" * 64)
    rc, _, err = run_cli(["eval", "--gguf", str(stock)])
    line = error_line(rc, err, "eval")
    assert "stock.Q4_K_M.gguf records no voodoo.model" in line and "--model" in line, line
    assert "e.g." not in line, line   # nothing beside it records a model this machine has
    # a run folder's stock/ file: the Voodoo file of the run folder names the model to pass
    from voodoo.export import find_model
    from voodoo.models import DEFAULT_MODEL_WHEEL
    run = tmp_path / "run"
    (run / "stock").mkdir(parents=True)
    smol = f"SmolLM2@sha256:{DEFAULT_MODEL_WHEEL['gguf_sha256']}"
    _model_gguf(run / "m.Voodoo55_Q4_K_S.gguf", smol)
    stock2 = _model_gguf(run / "stock" / "stock.IQ4_XS.gguf")
    for cmd in (["eval", "--gguf", str(stock2)], ["chat", "--gguf", str(stock2), "--reference",
                                                   "--prompt", "hi"]):
        rc, _, err = run_cli(cmd)
        line = error_line(rc, err, cmd[0])
        assert "stock.IQ4_XS.gguf records no voodoo.model" in line, line
        assert f"(e.g. --model {find_model(smol)}, the model m.Voodoo55_Q4_K_S.gguf " \
            "records)" in line, line
    # a file of another vocabulary than the reference's (llama-perplexity would print KLD 20)
    from gguf import GGUFWriter
    w = GGUFWriter(str(run / "v.gguf"), "llama")
    w.add_string("voodoo.model", smol)
    w.add_token_list([f"t{i}" for i in range(10)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (run / "x.txt").write_text("Some text to score. " * 400)
    rc, _, err = run_cli(["eval", "--gguf", str(run / "v.gguf"), "--eval_text",
                          str(run / "x.txt")])
    line = error_line(rc, err, "eval")
    assert "v.gguf has a vocabulary of 10 tokens" in line and " 49152: " in line, line
    assert "--model" in line, line
    rc, _, err = run_cli(["eval", "--gguf", str(a), str(b)])
    line = error_line(rc, err, "eval")
    assert "different models" in line and "a.gguf from ModelA" in line and \
        "b.gguf from ModelB" in line, line
    ref = tmp_path / "ref.gguf"
    ref.write_bytes(b"reference bytes")
    cli._warn_other_model(SimpleNamespace(gguf=[str(a), str(stock)]),
                          SimpleNamespace(name="ModelC", reference_gguf=str(ref)))
    err = capsys.readouterr().err
    assert "a.gguf was made from ModelA" in err and "not from ModelC" in err
    assert "stock.Q4_K_M" not in err


# ---------------------------------------------------------------------- --tensor_upgrades
@pytest.mark.parametrize("spec, words", [
    ('[{"pattern": "ffn_down", "levels": 1}', "not valid JSON"),
    ('[{"pattern": "ffn_(down", "levels": 1}]', "bad regex"),
    ('[{"pattern": "ffn_down", "levels": "one"}]', "levels must be an integer"),
    ('{"pattern": "ffn_down"}', "must be a JSON list"),
])
def test_tensor_upgrades_malformed_before_any_work(spec, words, tmp_path):
    """Parsed before the model is even loaded (the model path here does not exist)."""
    out = tmp_path / "out"
    rc, _, err = run_cli(["train", "--model", str(tmp_path / "model-not-needed"),
                          "--output_dir", str(out), *SMALL, "--tensor_upgrades", spec])
    line = error_line(rc, err)
    assert "--tensor_upgrades" in line and words in line, line
    nothing_written(out)


def test_run_says_before_any_work_when_it_will_not_score_wikitext(tmp_path, monkeypatch):
    """Without --eval_text and ../shared/data/wikitext-2-raw-test.txt, ``voodoo run`` says at
    the start (not after training) which text its final llama-perplexity table will score."""
    from voodoo import cli
    monkeypatch.setattr(cli, "_default_eval_text", lambda: None)
    out = tmp_path / "out"
    rc, _, err = run_cli(["run", "--model", str(tmp_path / "model-not-needed"),
                          "--output_dir", str(out), *SMALL, "--n_eval_blocks", "4", "--ctx", "64",
                          "--chunks", "4",
                          "--tensor_upgrades", "[{"])
    line = error_line(rc, err, "run")
    assert "--tensor_upgrades" in line
    notice = err.index("not WikiText-2")
    assert "eval split of the calibration corpus" in err and notice < err.index(line), err
    nothing_written(out)


def test_tensor_upgrades_pattern_matches_nothing(tiny_fixed, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                          *SMALL, "--tensor_upgrades",
                          '[{"pattern": "ffn_down", "levels": 1}, '
                          '{"pattern": "^blk\\\\.99\\\\.", "levels": 1}]'])
    line = error_line(rc, err)
    assert "matches no tensor" in line and "blk\\.99\\." in line and "blk.0." in line
    nothing_written(out)


def test_train_in_a_run_folder_without_model_uses_the_runs_model(tmp_path, capsys):
    """``train --output_dir OUT`` without --model, OUT holding a run (README's way to add
    --tensor_upgrades): the model of OUT's newest assignment, said in a line, not the default
    model; a recorded path that is gone is refused naming --model; --model given wins."""
    import os
    from types import SimpleNamespace

    from voodoo import cli
    out, model = tmp_path / "run", tmp_path / "h320"
    out.mkdir()
    model.mkdir()
    (out / "old.assignment.json").write_text(json.dumps({"model": "/nowhere/old"}))
    os.utime(out / "old.assignment.json", (1, 1))
    (out / "h320.Voodoo55_Q4_K_S.assignment.json").write_text(json.dumps({"model": str(model)}))
    a = SimpleNamespace(model=None, output_dir=str(out))
    cli._run_folder_model(a)
    assert a.model == str(model)
    assert f"--model not given: using {model}, the model of the run in {out}" in \
        capsys.readouterr().err
    a = SimpleNamespace(model="/given", output_dir=str(out))
    cli._run_folder_model(a)
    assert a.model == "/given"
    (out / "h320.Voodoo55_Q4_K_S.assignment.json").unlink()
    with pytest.raises(cli.UsageError, match=r"holds a run of /nowhere/old \(old.assignment"
                                             r".json\), which is not there any more; pass "
                                             r"--model"):
        cli._run_folder_model(SimpleNamespace(model=None, output_dir=str(out)))
    a = SimpleNamespace(model=None, output_dir=str(tmp_path / "new"))
    cli._run_folder_model(a)
    assert a.model is None


# ---------------------------------------------------------------------------- candidates
def test_iq_type_needs_an_imatrix():
    from voodoo.candidates import plan_precache, quantize_candidate
    from voodoo.candidates import CandidateCache
    w = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    with pytest.raises(ValueError, match="imatrix"):
        quantize_candidate(w, "IQ2_XXS", None, "blk.0.ffn_down.weight")
    with pytest.raises(ValueError, match="needs an importance matrix"):
        plan_precache([("blk.0.ffn_down.weight", w, "IQ2_XXS", None)], CandidateCache("/nonexistent"))


def test_corrupt_cached_candidate_is_rebuilt(tiny_fixed, tmp_path):  # noqa: F811
    """Truncate one cached candidate and corrupt another's bytes; ``voodoo precache`` again
    detects both, rebuilds them, and the rebuilt files hold the same rows."""
    from voodoo.candidates import CorruptCandidateWarning, from_arrow
    import pyarrow as pa
    cache_dir, out = tmp_path / "cache", tmp_path / "out"
    argv = ["precache", "--model", str(tiny_fixed), "--output_dir", str(out), "--cache_dir",
            str(cache_dir), "--seq_len", "64", "--n_train_blocks", "8", "--n_eval_blocks", "2",
            "--imatrix_blocks", "4", "--no_ray", "--candidate_types", "Q8_0,Q4_K",
            "--rounding", "ggml"]  # llama-quantize's bytes only: one file per (tensor, type)
    rc, stdout, err = run_cli(argv)
    assert rc == 0, err[-2000:]
    files = sorted(cache_dir.rglob("*.arrow"))
    assert len(files) == 30  # 15 tensors x 2 types

    def rows(p):
        with pa.memory_map(str(p), "r") as src:
            return from_arrow(pa.ipc.open_file(src).read_all())[0].tobytes()
    a, b = files[0], files[-1]
    want = {a: rows(a), b: rows(b)}
    a.write_bytes(a.read_bytes()[: a.stat().st_size // 2])           # truncated
    raw = bytearray(b.read_bytes())
    i = raw.find(want[b][:64])
    assert i > 0
    raw[i + 10] ^= 0xFF                                              # one flipped byte
    b.write_bytes(bytes(raw))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc, stdout, err = run_cli(argv)
    assert rc == 0, err[-2000:]
    assert sum(issubclass(w.category, CorruptCandidateWarning) for w in caught) == 2
    assert "28 cached, 2 quantized" in err
    assert rows(a) == want[a] and rows(b) == want[b]


# -------------------------------------------------------------------------------- journal
def test_corrupt_journal_is_an_error_and_kept(tiny_fixed, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    journal = out / "train" / "partial.pt"
    journal.parent.mkdir(parents=True)
    junk = b"PK\x03\x04 not really a torch file" + bytes(range(256)) * 4
    journal.write_bytes(junk)
    rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                          *SMALL, "--compression_ratio", "0.5"])
    line = error_line(rc, err)
    assert "partial.pt" in line and "kept" in line and "delete it" in line
    assert journal.read_bytes() == junk
    assert sorted(p.name for p in out.iterdir()) == ["train"]  # failed before the data stage


# ------------------------------------------------------------------------ output folder
@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_unwritable_output_folder(where, tmp_path):
    """Fails first, before the model is prepared (the model path here does not exist)."""
    if where == "under-a-file":
        f = tmp_path / "a-file"
        f.write_text("x")
        out = f / "run"
    else:
        out = Path("/proc/voodoo-run")
    rc, _, err = run_cli(["train", "--model", str(tmp_path / "model-not-needed"),
                          "--output_dir", str(out), *SMALL])
    line = error_line(rc, err)
    assert "--output_dir" in line, line
    if where == "under-a-file":   # the file in the way is named
        assert f"{f} is a file, not a folder" in line, line
        assert f.read_text() == "x"
    else:
        assert "cannot write to the output folder" in line, line


# ------------------------------------------------------------------------------- export
def test_interrupted_export_leaves_no_file(tiny_fixed, tmp_path):  # noqa: F811
    """The cache lookup raises (KeyboardInterrupt, then an error) midway through the export:
    nothing at the final name, no temporary file left, and an existing file is kept."""
    import cython_ggml as cg
    from voodoo.models import prepare_model
    from voodoo.pipeline import export
    from voodoo.pipeline import base_weights
    prepared = prepare_model(tiny_fixed)
    w = base_weights(prepared.base_gguf)
    names = sorted(n for n, a in w.items() if a.shape[1] % 32 == 0)
    asg = {"tensors": {n: {"type": "Q8_0"} for n in names}}

    class Ctx:
        pass
    ctx = Ctx()
    ctx.prepared = prepared

    class Cache:
        def __init__(self, fail_at, exc):
            self.n, self.fail_at, self.exc = 0, fail_at, exc

        def get(self, key):
            self.n += 1
            if self.n == self.fail_at:
                raise self.exc
            return cg.quantize(np.ascontiguousarray(w[key]), "Q8_0")
    keys = {(n, "Q8_0"): n for n in names}
    final = tmp_path / "model.gguf"
    with pytest.raises(KeyboardInterrupt):
        export(ctx, asg, keys, Cache(4, KeyboardInterrupt()), final)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    final.write_bytes(b"an older export")
    with pytest.raises(RuntimeError, match="disk on fire"):
        export(ctx, asg, keys, Cache(len(names), RuntimeError("disk on fire")), final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]
    assert final.read_bytes() == b"an older export"
    # the same export, uninterrupted, is complete
    export(ctx, asg, keys, Cache(-1, None), final)
    from voodoo.ggufio import read_gguf
    assert len([t for t in read_gguf(final).tensors if t.name in names]) == len(names)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "model.tensor-types.txt"]


@pytest.mark.slow
@pytest.mark.parametrize("sig, status, word", [(signal.SIGINT, 130, "interrupted"),
                                             (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_sigint_during_cli_export_leaves_no_file(sig, status, word, tiny_fixed,  # noqa: F811
                                                 tmp_path):
    """``voodoo export`` in a subprocess, interrupted (SIGINT, or SIGTERM as `timeout` and
    schedulers send it) while writing tensors."""
    from voodoo.models import prepare_model
    from voodoo.pipeline import base_weights
    prepared = prepare_model(tiny_fixed)
    names = sorted(base_weights(prepared.base_gguf))
    asg = tmp_path / "x.assignment.json"
    asg.write_text(json.dumps({"budget_bytes": 1, "total_bytes": 1,
                               "tensors": {n: {"type": "Q8_0"} for n in names}}))
    out = tmp_path / "out"
    # slow each cache lookup down so that SIGINT lands during the export
    code = (
        "import sys, time, voodoo.candidates as c\n"
        "g = c.CandidateCache.get\n"
        "def slow(self, key):\n"
        "    r = g(self, key)\n"
        "    if r is not None and '--in-export' in sys.argv[-1:]:\n"
        "        print('LOOKUP', flush=True); time.sleep(0.5)\n"
        "    return r\n"
        "c.CandidateCache.get = slow\n"
        "import voodoo.pipeline as p\n"
        "e = p.export\n"
        "def export(*a, **k):\n"
        "    print('EXPORTING', flush=True); sys.argv.append('--in-export'); return e(*a, **k)\n"
        "p.export = export\n"
        "from voodoo.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    argv = [sys.executable, "-c", code, "export", "--model", str(tiny_fixed), "--output_dir",
            str(out), "--seq_len", "64", "--n_train_blocks", "8", "--n_eval_blocks", "2",
            "--imatrix_blocks", "4", "--no_ray", "--assignment", str(asg)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    line = proc.stdout.readline()
    assert "EXPORTING" in line, proc.communicate()[1][-2000:]
    # signal once the export is inside its (slowed) tensor loop, whatever the machine's load:
    # a fixed sleep let a loaded machine's export finish first
    for _ in range(3):
        line = proc.stdout.readline()
        assert "LOOKUP" in line, (line, proc.communicate()[1][-2000:])
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err[-2000:]
    assert f"voodoo export: {word}" in err and "Traceback" not in err
    assert not (out / "x.gguf").exists()
    left = sorted(p.name for p in out.iterdir())
    # the stages before export (the run folder's provenance record, the imatrix's sha256
    # memo), nothing of it
    assert left == ["data", "imatrix.gguf", "imatrix.gguf.sha256", "provenance.json"], left


# ------------------------------------------------------------------------------- serve
def test_serve_on_a_port_in_use_says_so_and_leaves_the_other_server_alone(tmp_path, capsys):
    """A second `voodoo serve` on a busy port used to be answered by the first server's
    /health, print "serving ... at" and then fail with "llama-server exited with code 1",
    after truncating the first server's log. Now: one line naming the port and --port,
    before anything starts or any log is opened."""
    import socket

    from voodoo import cli
    from gguf import GGUFWriter
    gguf = tmp_path / "m.gguf"   # a GGUF with an architecture: past the --gguf check
    w = GGUFWriter(str(gguf), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        log = Path(__import__("tempfile").gettempdir()) / f"llama-server-{port}.log"
        log.write_text("the other server's log\n")
        try:
            rc = cli.main(["serve", "--gguf", str(gguf), "--port", str(port)])
            out, err = capsys.readouterr()
            line = error_line(rc, err, "serve")
            assert f"127.0.0.1:{port} is already in use" in line and "--port" in line
            assert "serving" not in out
            assert log.read_text() == "the other server's log\n"
        finally:
            log.unlink()


# ------------------------------------------------------------------------------- export
def test_export_uses_the_assignments_folder_and_refuses_another_imatrix(
        tiny_fixed, tmp_path, monkeypatch):  # noqa: F811
    """`voodoo export --assignment A` without --output_dir works in A's folder (its data and
    imatrix; it used to make data and an imatrix anew in runs/<model>/ of the working folder),
    and keeps A's imatrix even when the calibration flags differ. Pointed at another folder
    without the imatrix A was trained with, it refuses in one line (it used to write
    a GGUF of other bytes than the gates chose between, silently); pointed at another folder
    while its own folder still holds that imatrix, it takes that one."""
    out = tmp_path / "run"
    rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                          *SMALL])
    assert rc == 0, err[-3000:]
    asg = next(out.glob("*.assignment.json"))
    imatrix = (out / "imatrix.gguf").read_bytes()
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rc, stdout, err = run_cli(["export", "--assignment", str(asg), "--imatrix_blocks", "2"])
    assert rc == 0, err[-3000:]
    g = out / asg.name.replace(".assignment.json", ".gguf")
    assert g.is_file(), stdout
    assert f"wrote {g} ({g.stat().st_size / 2**20:.1f} MiB)" in stdout, stdout  # as the skill says
    assert not (elsewhere / "runs").exists()
    assert (out / "imatrix.gguf").read_bytes() == imatrix        # neither rebuilt nor replaced
    # another --output_dir: the assignment's own folder still holds its imatrix, which is taken
    other = tmp_path / "other"
    rc, stdout, err = run_cli(["export", "--assignment", str(asg), "--output_dir", str(other),
                               *SMALL[:6], "--imatrix_blocks", "2"])
    assert rc == 0, err[-3000:]
    assert (other / asg.name.replace(".assignment.json", ".gguf")).is_file(), stdout
    assert not (other / "imatrix.gguf").exists()
    # ... and, with no dataset flags, its calibration data too, read where it is (it was rebuilt
    # from the defaults in the new folder, and then refused as other calibration tokens)
    fourth = tmp_path / "fourth"
    rc, stdout, err = run_cli(["export", "--assignment", str(asg), "--output_dir", str(fourth)])
    assert rc == 0, err[-3000:]
    assert f"calibration data: {out.resolve() / 'data'}, the assignment's run folder's" in err
    assert (fourth / g.name).read_bytes() == g.read_bytes()
    assert not (fourth / "data").exists() and not (out / "data.previous").exists()
    # ... and once that one is gone, the fresh imatrix of other calibration flags is refused
    (out / "imatrix.gguf").unlink()
    third = tmp_path / "third"
    rc, _, err = run_cli(["export", "--assignment", str(asg), "--output_dir", str(third),
                          *SMALL[:6], "--imatrix_blocks", "2"])
    line = error_line(rc, err, "export")
    assert "trained with another imatrix" in line and "--imatrix" in line
    assert not list(third.glob("*.Voodoo*.gguf"))


def test_export_refuses_error_feedback_bytes_of_other_calibration_tokens(
        tiny_fixed, tmp_path):  # noqa: F811
    """The run folder's data remade with other flags after training: `export --assignment`
    remade the input Hessians from the new tokens and wrote other error-feedback bytes than
    the gates chose between, with the same metadata, silently. Now one line before the
    Hessians are touched; --rounding ggml (llama-quantize's bytes) still exports."""
    out = tmp_path / "run"
    rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                          *SMALL])
    assert rc == 0, err[-3000:]
    asg = next(out.glob("*.assignment.json"))
    assert json.loads(asg.read_text())["provenance"]["rounding"] != "ggml"
    hessians = (out / "hessians.npz").read_bytes()
    rc, _, err = run_cli(["data", "--model", str(tiny_fixed), "--output_dir", str(out),
                          "--seq_len", "64", "--n_train_blocks", "6", "--n_eval_blocks", "2"])
    assert rc == 0, err[-3000:]
    rc, _, err = run_cli(["export", "--assignment", str(asg), "--output_name", "again"])
    line = error_line(rc, err, "export")
    assert "trained on other calibration tokens" in line and "--rounding ggml" in line
    assert not (out / "again.gguf").exists()
    assert (out / "hessians.npz").read_bytes() == hessians
    rc, _, err = run_cli(["export", "--assignment", str(asg), "--output_name", "again",
                          "--rounding", "ggml"])
    assert rc == 0, err[-3000:]
    assert (out / "again.gguf").is_file()


def test_a_file_where_a_cache_folder_goes_is_refused_first(tiny_fixed, tmp_path,  # noqa: F811
                                                           monkeypatch):
    """`--cache_dir F` (F a file, or a path under one) failed after the imatrix and Hessians
    with "Not a directory"; `VOODOO_CACHE=F` blamed an unbuilt llama.cpp. Both now one line
    naming the flag, before any stage."""
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    out = tmp_path / "run"
    for where in (blocker, blocker / "candidates"):
        rc, _, err = run_cli(["precache", "--model", str(tiny_fixed), "--output_dir", str(out),
                              "--cache_dir", str(where), "--no_ray"])
        line = error_line(rc, err, "precache")
        assert f"--cache_dir {where}" in line and "is a file, not a folder" in line
        nothing_written(out)
    monkeypatch.setenv("VOODOO_CACHE", str(blocker))
    rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                          *SMALL])
    line = error_line(rc, err, "train")
    assert f"VOODOO_CACHE {blocker}" in line and "is a file, not a folder" in line
    nothing_written(out)


def test_a_file_where_a_run_subfolder_goes_is_refused_first(tiny_fixed, tmp_path):  # noqa: F811
    """A file named `train` (or `eval`, `data`, ...) in the run folder failed only when the
    stage that writes there came, after the stages before it; now one line before any stage."""
    out = tmp_path / "run"
    out.mkdir()
    for sub in ("train", "eval"):
        (out / sub).write_text("x")
        rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                              *SMALL])
        line = error_line(rc, err, "train")
        assert f"{out / sub} is a file" in line and "--output_dir" in line
        assert sorted(p.name for p in out.iterdir()) == [sub]   # no stage ran
        (out / sub).unlink()


def test_ray_student_factory_paths_are_absolute(tmp_path, monkeypatch):
    """`train --ray --output_dir runs/x` (relative) failed after every expensive stage: the
    Ray Train worker, in its own working directory, could not find runs/x/imatrix.gguf. The
    factory handed to the workers now holds absolute paths."""
    from types import SimpleNamespace

    import torch

    from voodoo import cli
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "x").mkdir(parents=True)
    a = SimpleNamespace(model=str(tmp_path / "model-dir"), teacher_quant="BF16",
                        teacher_checkpoint=None, dtype=None, lazy=False)
    run = SimpleNamespace(a=a, menus={"t": ["Q8_0"]}, imatrix_path=Path("runs/x/imatrix.gguf"),
                          cache=SimpleNamespace(root=Path("cache")), out=Path("runs/x"),
                          train_blocks=torch.zeros(1, 4, dtype=torch.long), eval_blocks=None,
                          budget=1, hessians=object())
    f = cli.Run.student_factory(run)
    for p in (f.imatrix, f.cache_dir, f.hessians):
        assert Path(p).is_absolute() and str(p).startswith(str(tmp_path)), p
    assert f.imatrix == str(tmp_path / "runs" / "x" / "imatrix.gguf")


def test_eval_assignment_reuses_the_runs_data_settings(tmp_path):
    """`eval --assignment` of a run trained with --seq_len 64 --n_train_blocks 8 rebuilt the
    run's data folder with the defaults (512 x 48), over the blocks the gates were trained on.
    The flags not given now come from the run's data/meta.json; given ones win."""
    from types import SimpleNamespace

    from voodoo import cli
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text(json.dumps(
        {"source_arg": "cal.jsonl", "seq_len": 64, "n_train_blocks": 8, "n_eval_blocks": 2,
         "seed": 3}))
    a = SimpleNamespace(data_dir=None, output_dir=str(tmp_path), data_name=None, seq_len=None,
                        n_train_blocks=None, n_eval_blocks=4, seed=None)
    cli._data_of_run(a)
    assert (a.data_name, a.seq_len, a.n_train_blocks, a.n_eval_blocks, a.seed) == \
        ("cal.jsonl", 64, 8, 4, 3)


@pytest.mark.parametrize("content", ['{"a": 1}', '{"tensors": {"x": 1}}', "{\n", b"GGUF\x80\x00"])
def test_a_file_that_is_no_assignment_is_refused_before_any_work(tmp_path, content):
    """export/eval --assignment with a readable file that is not an assignment (no "tensors",
    cut off, a GGUF) used to load the default model, write data and an imatrix beside it, and
    then end in a traceback or a JSON message without the file's name."""
    f = tmp_path / "x.assignment.json"
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    for cmd in ("export", "eval"):
        rc, _, err = run_cli([cmd, "--assignment", str(f)])
        line = error_line(rc, err, cmd)
        assert str(f) in line and "assignment.json that voodoo train wrote" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.assignment.json"]


def test_budget_device_and_eval_text_mistakes_fail_before_the_model_loads(tmp_path):
    """--match_size with --compression_ratio (the ratio was silently ignored), a CUDA device
    on a torch without one, and a folder as --eval_text: one line each, nothing written."""
    import torch
    out = tmp_path / "out"
    base = ["--model", str(tmp_path / "not-loaded"), "--output_dir", str(out), *SMALL]
    rc, _, err = run_cli(["train", *base, "--match_size", "Q4_K_M", "--compression_ratio", "0.5"])
    line = error_line(rc, err)
    assert "--match_size and --compression_ratio both set a budget" in line, line
    rc, _, err = run_cli(["run", *base, "--eval_text", str(tmp_path)])
    assert "a folder; give a text file" in error_line(rc, err, "run")
    rc, _, err = run_cli(["train", *base, "--device", "banana"])
    assert "--device banana" in error_line(rc, err)
    if not torch.cuda.is_available():
        rc, _, err = run_cli(["train", *base, "--device", "cuda"])
        line = error_line(rc, err)
        assert "sees no CUDA device" in line and "--device cpu" in line, line
    nothing_written(out)


def test_run_refuses_an_eval_text_too_short_before_training(tiny_fixed, tmp_path):  # noqa: F811
    """run --eval_text with fewer tokens than llama-perplexity's 2 x --ctx: refused after the
    tokenizer loads, before data, candidates and training (it failed at the very end)."""
    short = tmp_path / "short.txt"
    short.write_text("hello world")
    out = tmp_path / "out"
    rc, _, err = run_cli(["run", "--model", str(tiny_fixed), "--output_dir", str(out), *SMALL,
                          "--eval_text", str(short), "--ctx", "128", "--chunks", "2"])
    line = error_line(rc, err, "run")
    assert "short.txt" in line and "needs at least 256" in line, line
    assert not (out / "data").exists() and not (out / "train").exists()


def test_menu_and_upgrade_file_mistakes_name_the_flag_before_the_model_loads(tmp_path):
    """An empty or unknown --candidate_types (the error named neither flag nor fix, and came
    after the model was converted) and a missing --tensor_upgrades file (reported as bad JSON)."""
    out = tmp_path / "out"
    base = ["--model", str(tmp_path / "not-loaded"), "--output_dir", str(out), *SMALL]
    rc, _, err = run_cli(["train", *base, "--candidate_types", ""])
    line = error_line(rc, err)
    assert "--candidate_types ''" in line and "leave the flag out" in line, line
    rc, _, err = run_cli(["train", *base, "--non_attention_candidates", "Q8_0,Q4_X"])
    line = error_line(rc, err)
    assert "--non_attention_candidates" in line and "'Q4_X'" in line, line
    rc, _, err = run_cli(["train", *base, "--tensor_upgrades", str(tmp_path / "tu.json")])
    line = error_line(rc, err)
    assert "tu.json: no such file" in line, line
    nothing_written(out)


def test_voodoo_warnings_are_one_log_line():
    """A warning raised in Voodoo's code during a command prints as ``[voodoo] warning: ...``
    (not Python's ``path:line: UserWarning:`` form with the source line); other libraries'
    warnings keep Python's form. (A subprocess: pytest records warnings itself.)"""
    code = """if True:
        import warnings
        from voodoo import cli, bake
        def cmd(argv):
            warnings.warn_explicit("bake: 10 bytes is 1.00% under the budget", UserWarning,
                                   bake.__file__, 1)
            warnings.warn_explicit("something else", UserWarning, "/elsewhere/lib.py", 7)
            return 0
        cli.COMMANDS["doctor"] = (cmd, "")
        raise SystemExit(cli.main(["doctor"]))
    """
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "[voodoo] warning: bake: 10 bytes is 1.00% under the budget\n" in p.stderr
    assert "lib.py:7: UserWarning: something else" in p.stderr
    assert "bake.py:1" not in p.stderr


def _calibration_text(path: Path) -> Path:
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
    rng = np.random.default_rng(0)
    path.write_text("\n\n\n".join(" ".join(rng.choice(words, 120)) for _ in range(40)))
    return path


def _data_from_text(model, tmp_path):
    """``voodoo data`` from a small text file into ``tmp_path/run``: (run folder, text)."""
    out = tmp_path / "run"
    txt = _calibration_text(tmp_path / "calib.txt")
    rc, _, err = run_cli(["data", "--model", str(model), "--output_dir", str(out),
                          "--data_name", str(txt), "--seq_len", "64", "--n_train_blocks", "4",
                          "--n_eval_blocks", "2"])
    assert rc == 0, err[-2000:]
    return out, txt


def test_data_keeps_the_run_folders_corpus(tiny_fixed, tmp_path):  # noqa: F811
    """``voodoo data --seq_len 32`` on a run folder built from a text file rebuilds the blocks
    from that file (the flags not given are the folder's), not from the default corpus."""
    out, txt = _data_from_text(tiny_fixed, tmp_path)
    rc, _, err = run_cli(["data", "--model", str(tiny_fixed), "--output_dir", str(out),
                          "--seq_len", "32"])
    assert rc == 0, err[-2000:]
    meta = json.loads((out / "data" / "meta.json").read_text())
    assert meta["seq_len"] == 32 and meta["n_train_blocks"] == 4, meta
    assert meta["source_arg"] == str(txt), meta
    assert "taken from the run's data/meta.json" in err


def test_corrupt_data_meta_is_not_replaced_by_the_defaults(tiny_fixed, tmp_path):  # noqa: F811
    """A run folder whose data/meta.json is unreadable: a command without --data_name stops
    (rebuilding from the defaults would silently change the corpus) and names the way out."""
    out, txt = _data_from_text(tiny_fixed, tmp_path)
    (out / "data" / "meta.json").write_text("{not json")
    rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                          "--no_ray", "--max_steps", "2"])
    line = error_line(rc, err)
    assert "meta.json is corrupt" in line and "--data_name" in line and "delete" in line, line


def test_too_few_tokens_for_the_preflight(tiny_fixed, tmp_path):  # noqa: F811
    """One 64-token block is too little for the pre-flight's KLD: the error names the flags
    that fix it, and --skip_preflight does skip it."""
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_fixed), "--output_dir", str(out), "--seq_len", "64",
            "--n_train_blocks", "1", "--n_eval_blocks", "1", "--imatrix_blocks", "1",
            "--no_ray", "--max_steps", "1", "--compression_ratio", "0.6"]
    rc, _, err = run_cli(argv)
    line = error_line(rc, err)
    assert "pre-flight" in line and "--n_train_blocks" in line and "--skip_preflight" in line
    rc, _, err = run_cli(argv + ["--skip_preflight"])
    assert rc == 0, err[-2000:]
    assert "pre-flight check skipped (--skip_preflight)" in err


def test_hand_edited_assignment_is_named():
    """An assignment with a tensor removed or one the model lacks: a UsageError naming it
    (export and eval used to end in a KeyError traceback)."""
    from types import SimpleNamespace

    from voodoo.cli import UsageError, _check_assignment_tensors
    specs = [SimpleNamespace(gguf_name=f"blk.{i}.attn_v.weight", n_per_row=256) for i in range(3)]
    full = {"tensors": {s.gguf_name: {"type": "Q8_0"} for s in specs}}
    _check_assignment_tensors("a.json", full, specs)
    less = {"tensors": dict(list(full["tensors"].items())[1:])}
    with pytest.raises(UsageError, match=r"does not cover: blk\.0\.attn_v\.weight"):
        _check_assignment_tensors("a.json", less, specs)
    more = {"tensors": {**full["tensors"], "blk.9.attn_q.weight": {"type": "Q8_0"}}}
    with pytest.raises(UsageError, match=r"does not have: blk\.9\.attn_q\.weight"):
        _check_assignment_tensors("a.json", more, specs)


def test_seq_len_beyond_the_models_context(tiny_fixed, tmp_path):  # noqa: F811
    """--seq_len longer than max_position_embeddings is refused, naming both numbers (for a
    learned position table llama-imatrix used to crash with a backtrace)."""
    import json as _json
    n = _json.loads((tiny_fixed / "config.json").read_text())["max_position_embeddings"]
    out = tmp_path / "run"
    for cmd in ("data", "train"):
        rc, _, err = run_cli([cmd, "--model", str(tiny_fixed), "--output_dir", str(out),
                              "--seq_len", str(2 * n)] + (["--no_ray"] if cmd == "train" else []))
        line = error_line(rc, err, cmd)
        assert f"--seq_len {2 * n}" in line and f"max_position_embeddings = {n}" in line, line
        nothing_written(out)


def test_changed_run_imatrix_is_recomputed(tiny_fixed, tmp_path):  # noqa: F811
    """A run folder's imatrix.gguf whose bytes changed since Voodoo wrote it (same size, some
    bytes flipped) is computed again, said in one line, not used."""
    out = tmp_path / "run"
    argv = ["precache", "--model", str(tiny_fixed), "--output_dir", str(out), "--seq_len", "64",
            "--n_train_blocks", "8", "--n_eval_blocks", "2", "--imatrix_blocks", "4",
            "--no_ray", "--cache_dir", str(tmp_path / "cache"), "--candidate_types", "Q8_0"]
    rc, _, err = run_cli(argv)
    assert rc == 0, err[-2000:]
    im = out / "imatrix.gguf"
    good = im.read_bytes()
    bad = bytearray(good)
    bad[-200:-100] = bytes(100)
    im.write_bytes(bytes(bad))
    rc, _, err = run_cli(argv)
    assert rc == 0, err[-2000:]
    assert "bytes changed since Voodoo wrote it" in err, err[-2000:]
    assert im.read_bytes() == good


def test_relative_output_dir_in_a_ray_job_copy(tmp_path, monkeypatch):
    """Under ``ray job submit --working-dir`` the job's cwd is Ray's temporary copy of that
    folder: a relative (or default) output folder is refused before any work, naming the fix;
    an absolute one is fine."""
    from types import SimpleNamespace

    from voodoo.cli import UsageError, _out_dir
    job = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_ab"
    job.mkdir(parents=True)
    monkeypatch.chdir(job)
    for out in ("runs/x", None):
        with pytest.raises(UsageError, match="absolute --output_dir"):
            _out_dir(SimpleNamespace(output_dir=out))
    assert not (job / "runs").exists()
    assert _out_dir(SimpleNamespace(output_dir=str(tmp_path / "abs"))) == tmp_path / "abs"


# ------------------------------------------------- cheap checks that run before any model loads
@pytest.mark.parametrize("argv, words", [
    (["serve", "--gguf", "x.gguf", "--stop_after", "0"], "--stop_after 0"),
    (["serve", "--gguf", "x.gguf", "--stop_after", "-1"], "seconds > 0"),
    (["serve", "--gguf", "x.gguf", "--ctx", "16"], "--ctx 16"),
    (["chat", "--gguf", "x.gguf", "--ctx", "-5"], "at least 64 tokens"),
    (["tune", "--num_samples", "0"], "--num_samples must be >= 1"),
    (["tune", "--size_tolerance_range", "-1", "2"], "--size_tolerance_range"),
    (["tune", "--size_weight_range", "0", "10"], "log-uniformly"),
    (["tune", "--size_weight", "5"], "--size_weight 5.0 would be ignored: voodoo tune samples"),
    (["tune", "--size_tolerance", "0.01"], "give --size_tolerance_range LO HI"),
    (["tune", "--lr", "0.1", "--lr_range", "0.01", "0.5"], "(--lr_range): leave --lr out"),
    (["tune", "--stop_after", "3"], "every trial trains --max_steps steps"),
    (["train", "--match_size", "0"], "must be > 0"),
    (["train", "--size", "Voodoo5x"], "is not a size: give a percent of the Q8_0 bytes, e.g. 55"),
    (["train", "--imatrix_blocks", "0"], "--imatrix_blocks: must be an integer >= 1"),
    (["train", "--hessian_blocks", "-1"], "--hessian_blocks: must be an integer >= 1"),
    (["train", "--n_train_blocks", "0"], "--n_train_blocks: must be 'auto' or an integer >= 1"),
    (["train", "--seq_len", "1"], "--seq_len: must be an integer >= 2"),
    (["train", "--seed", "-1"], "--seed: must be an integer >= 0"),
    (["train", "--size_tolerance", "-1"], "--size_tolerance: must be a finite number >= 0"),
    (["train", "--size_weight", "nan"], "--size_weight: must be a finite number >= 0"),
    (["run", "--kl_weight", "-1"], "--kl_weight: must be a finite number >= 0"),
    (["train", "--output_name", "../elsewhere/x"], "not a plain file name"),
    (["chat", "--gguf", "x.gguf", "--threads", "0"], "--threads: must be an integer >= 1"),
])
def test_bad_numbers_refused_before_any_work(argv, words, tmp_path):
    """Numbers that can never work fail in the argument checks: one line, exit code 2, no
    model loaded (the model path does not exist) and nothing written."""
    out = tmp_path / "out"
    extra = [] if argv[0] in ("serve", "chat") else [
        "--model", str(tmp_path / "model-not-needed"), "--output_dir", str(out), *SMALL]
    rc, _, err = run_cli([*argv, *extra])
    line = error_line(rc, err, argv[0])
    assert words in line, line
    nothing_written(out)


def test_imatrix_not_an_imatrix_refused_before_any_work(tmp_path):
    """``--imatrix`` naming a text file fails before data, preflight and candidates."""
    bad = tmp_path / "notes.txt"
    bad.write_text("these are my notes, not an imatrix\n" * 20)
    out = tmp_path / "out"
    rc, _, err = run_cli(["run", "--model", str(tmp_path / "model-not-needed"), "--output_dir",
                          str(out), *SMALL, "--imatrix", str(bad)])
    line = error_line(rc, err, "run")
    assert "--imatrix" in line and "neither a GGUF nor a legacy imatrix" in line, line
    nothing_written(out)


def test_dashed_flag_names_the_underscore_one(tmp_path):
    """``--output-dir`` (llama.cpp's spelling) is not a Voodoo flag: the error names
    ``--output_dir``; a flag that is not Voodoo's in any spelling gets no such hint."""
    rc, _, err = run_cli(["train", "--output-dir", str(tmp_path / "x")])
    line = error_line(rc, err, "train")
    assert "unrecognized arguments: --output-dir" in line and "underscores: --output_dir" in line
    rc, _, err = run_cli(["train", "--no-such-flag", "1"])
    line = error_line(rc, err, "train")
    assert "--no-such-flag" in line and "underscores" not in line, line


def test_a_flag_of_another_command_names_that_command():
    """``voodoo export --tensor_upgrades ...`` said only "unrecognized arguments" (a new user's
    report: the guardrails are baked by train/run/tune); the error names the commands that take
    the flag."""
    rc, _, err = run_cli(["export", "--assignment", "x.json", "--tensor_upgrades", "[]"])
    line = error_line(rc, err, "export")
    assert "--tensor_upgrades is a flag of voodoo run, voodoo train, voodoo tune, not of " \
           "voodoo export" in line, line
    assert "on a finished run, `voodoo train` with the same --output_dir" in line, line
    rc, _, err = run_cli(["train", "--nproc", "2"])
    assert "--nproc is a flag of voodoo tp, not of voodoo train" in error_line(rc, err, "train")


def test_eval_text_read_only_as_far_as_the_check_needs(tmp_path):
    """``run --eval_text``: a binary file is refused as not text, and a large corpus is read and
    tokenized only as far as the length check needs (a 64 MB file is not read whole)."""
    from types import SimpleNamespace

    from voodoo.cli import UsageError, _check_eval_text_tokens, _perplexity_tokens_needed

    seen = []

    def tokenizer(text):
        seen.append(len(text))
        return SimpleNamespace(input_ids=text.split())

    a = SimpleNamespace(eval_text=str(tmp_path / "bin.txt"), ctx=512, chunks=8)
    Path(a.eval_text).write_bytes(b"GGUF\0\0\0\3" + bytes(4096))
    with pytest.raises(UsageError, match="not a text file"):
        _check_eval_text_tokens(a, tokenizer)
    big = tmp_path / "big.txt"
    with open(big, "w") as f:
        for _ in range(64):
            f.write("word " * (1 << 18))   # 1.25 MiB a write, 80 MiB in all
    a.eval_text = str(big)
    _check_eval_text_tokens(a, tokenizer)   # long enough: no error
    need = _perplexity_tokens_needed(512, 8)
    assert seen and max(seen) <= max(1 << 20, 32 * need) < big.stat().st_size // 10


# ------------------------------------------------------------------------------ Ray guards
def test_a_run_folder_in_use_is_refused(tiny_fixed, tmp_path, monkeypatch):  # noqa: F811
    """Two training commands in one run folder shared its journal, imatrix and Ray run name; two
    `train --ray` runs there once baked one run's gates as the other's (exit 0, a Voodoo50
    file from a 0.6 run). The folder is now locked while a command trains in it; the second
    is refused in one line naming the holder, before it converts or loads the model, and the
    lock goes with the first command."""
    from voodoo.cli import Run

    def no_model(self):
        raise AssertionError("the model was loaded before the folder lock was checked")
    monkeypatch.setattr(Run, "context", no_model)
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from voodoo.cli import _lock_run_folder; _lock_run_folder(Path(sys.argv[1]), 'train');"
         " print('locked', flush=True); time.sleep(600)", str(out)],
        stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "locked"
        rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                              *SMALL])
        line = error_line(rc, err)
        assert f"{out} is in use by another Voodoo run" in line and str(holder.pid) in line
        assert "--output_dir" in line
        assert not (out / "data").exists()
        monkeypatch.undo()
        # `voodoo precache` too (two made every candidate twice, at half the speed each)
        rc, _, err = run_cli(["precache", "--model", str(tiny_fixed), "--output_dir", str(out),
                              "--seq_len", "64", "--n_train_blocks", "4", "--no_ray"])
        line = error_line(rc, err, "precache")
        assert f"{out} is in use by another Voodoo run" in line and str(holder.pid) in line
        assert not (out / "data").exists()
        # `voodoo data` into that folder too (it rewrote data/ under a running train)
        rc, _, err = run_cli(["data", "--model", str(tiny_fixed), "--output_dir", str(out),
                              "--seq_len", "64", "--n_train_blocks", "4"])
        line = error_line(rc, err, "data")
        assert f"{out} is in use by another Voodoo run" in line and str(holder.pid) in line
        assert not (out / "data").exists()
        # `voodoo export` of that folder's assignment is not refused but warned (the running
        # train replaces the assignment when it bakes): it sees the holder
        from voodoo.cli import _run_folder_holder
        assert f"voodoo train, pid {holder.pid}" in (_run_folder_holder(out) or "")
    finally:
        holder.kill()
        holder.wait()
    assert _run_folder_holder(out) is None
    rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                          *SMALL])
    assert rc == 0, err[-3000:]
    assert not (out / ".voodoo.lock").exists()


def test_a_ray_address_where_nothing_answers_is_refused_first(tiny_fixed, tmp_path,  # noqa: F811
                                                              monkeypatch):
    """RAY_ADDRESS=host:port with no cluster there made `train --ray` run data, imatrix and
    Fisher, then retry Ray's GCS connection forever. Now one line before any stage."""
    import socket
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    out = tmp_path / "run"
    # `train --ray`, `tune`, and (since 2026-12-05) `run`/`precache` whose candidates go to Ray
    # actors (no --no_ray): that one hung at the candidates on a fresh cache
    for cmd, extra in (("train", ["--ray"]), ("tune", []), ("run", []), ("precache", [])):
        argv = [cmd, "--model", str(tiny_fixed), "--output_dir", str(out),
                *[x for x in SMALL if x != "--no_ray"]]
        if cmd == "precache":
            argv = argv[:argv.index("--max_steps")]
        rc, _, err = run_cli(argv + extra)
        line = error_line(rc, err, cmd)
        assert f"RAY_ADDRESS=127.0.0.1:{port}" in line and "ray start --head" in line
        nothing_written(out)
    # a Ray Client address where nothing answers, and the job server's http:// address
    # (ray.init rejects it): both failed only after data, pre-flight, imatrix and Hessians
    argv = ["run", "--model", str(tiny_fixed), "--output_dir", str(out),
            *[x for x in SMALL if x != "--no_ray"]]
    for addr, words in ((f"ray://127.0.0.1:{port}", "no Ray cluster answers there"),
                        (f"http://127.0.0.1:{port}", "job server's address")):
        monkeypatch.setenv("RAY_ADDRESS", addr)
        line = error_line(*run_cli(argv)[::2], "run")
        assert f"RAY_ADDRESS={addr}" in line and words in line, line
        nothing_written(out)


def test_a_ray_address_where_a_web_server_answers_is_refused(tiny_fixed, tmp_path,  # noqa: F811
                                                             monkeypatch):
    """RAY_ADDRESS=127.0.0.1:8265 (the dashboard's port without http://) passed the TCP check
    and ray.init then waited on it forever, after the data and candidate stages (a new user's
    report). A server answering HTTP/1 is refused before any stage; one answering in HTTP/2 (a
    GCS's gRPC: a SETTINGS frame) passes the check."""
    import http.server
    import socketserver
    import threading

    from cluster.session import check_address
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)

    class Grpc(socketserver.BaseRequestHandler):  # what a GCS sends first: SETTINGS
        def handle(self):
            self.request.sendall(bytes.fromhex("000018040000000000"))
    grpc = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Grpc)
    for srv in (web, grpc):
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{grpc.server_address[1]}")
        check_address()
        addr = f"127.0.0.1:{web.server_address[1]}"
        monkeypatch.setenv("RAY_ADDRESS", addr)
        out = tmp_path / "run"
        rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                              *[x for x in SMALL if x != "--no_ray"], "--ray"])
        line = error_line(rc, err, "train")
        assert f"RAY_ADDRESS={addr} answers HTTP" in line and "host:6379" in line, line
        nothing_written(out)
    finally:
        for srv in (web, grpc):
            srv.shutdown()
            srv.server_close()


def test_a_worker_request_this_machine_cannot_hold_is_refused_first(tiny_fixed, tmp_path,  # noqa: F811
                                                                    monkeypatch):
    """Without RAY_ADDRESS the run starts a local Ray of this machine's CPUs: `train --ray
    --cpus_per_worker N` (or `tune --cpus_per_trial N`) beyond them is refused before any stage
    (it was refused only once Ray was up, after data, imatrix and candidates)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("VOODOO_ALLOW_PENDING", raising=False)
    n = 4096  # more CPUs than any one node here (this machine, or a Ray an earlier test left up)
    out = tmp_path / "run"
    base = ["--model", str(tiny_fixed), "--output_dir", str(out),
            *[x for x in SMALL if x != "--no_ray"]]
    for cmd, extra, flag in (("train", ["--ray", "--num_workers", "1", "--cpus_per_worker"],
                              "--cpus_per_worker"),
                             ("tune", ["--cpus_per_trial"], "--cpus_per_trial")):
        rc, _, err = run_cli([cmd, *base, *extra, str(n)])
        line = error_line(rc, err, cmd)
        assert f"needs CPU {n}" in line and flag in line, line
        if not __import__("ray").is_initialized():  # the local Ray's would-be node: this machine
            assert f"has CPU {os.cpu_count():g} (this machine's)" in line, line
        nothing_written(out)
    rc, _, err = run_cli(["train", *base, "--ray", "--num_workers", "1", "--cpus_per_worker",
                          "-1"])  # nonsense on any machine
    assert "--cpus_per_worker must be >= 0, got -1" in error_line(rc, err)
    nothing_written(out)
    monkeypatch.setenv("VOODOO_ALLOW_PENDING", "1")  # an autoscaling cluster: not refused here
    from cluster.session import check_feasible_here
    check_feasible_here({"CPU": n}, "one Ray Train worker", "lower --cpus_per_worker")


def test_an_infeasible_worker_request_is_refused(monkeypatch):
    """`--cpus_per_worker 4` (or `--cpus_per_trial 4`) on a cluster whose nodes have 2 CPUs made
    Ray print 'infeasible' warnings forever. The request is checked against the alive nodes."""
    import ray

    from cluster.session import check_feasible
    nodes = [{"Alive": True, "Resources": {"CPU": 2.0}},
             {"Alive": False, "Resources": {"CPU": 8.0, "GPU": 1.0}},
             {"Alive": True, "Resources": {"CPU": 1.0, "GPU": 1.0}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.delenv("VOODOO_ALLOW_PENDING", raising=False)
    check_feasible({"CPU": 2}, "one Ray Train worker", "lower --cpus_per_worker")
    check_feasible({"CPU": 1, "GPU": 1}, "one Ray Train worker", "lower --cpus_per_worker")
    with pytest.raises(ValueError) as e:
        check_feasible({"CPU": 4, "GPU": 0}, "one Ray Tune trial", "lower --cpus_per_trial")
    assert "one Ray Tune trial needs CPU 4" in str(e.value)
    assert "the most on one node: CPU 2" in str(e.value) and "--cpus_per_trial" in str(e.value)
    with pytest.raises(ValueError, match="needs CPU 2, GPU 1"):  # no alive node has both
        check_feasible({"CPU": 2, "GPU": 1}, "one Ray Train worker", "lower --cpus_per_worker")
    monkeypatch.setenv("VOODOO_ALLOW_PENDING", "1")
    check_feasible({"CPU": 4}, "one Ray Train worker", "lower --cpus_per_worker")


def test_a_worker_group_the_cluster_cannot_hold_together_is_refused(monkeypatch):
    """`--num_workers 3` (or `voodoo tp --nproc 2 -- --cpus_per_worker 2`) on 2 CPUs: each
    worker fit a node, the group did not, and Ray Train retried the group's start every minute
    forever (a new user's report). The group is checked against the alive nodes, each worker on
    one node."""
    import ray

    from cluster.session import check_feasible
    nodes = [{"Alive": True, "Resources": {"CPU": 3.0}},
             {"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}},
             {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.delenv("VOODOO_ALLOW_PENDING", raising=False)
    check_feasible({"CPU": 1}, "one Ray Train worker", "x", count=5)
    check_feasible({"CPU": 2}, "one Ray Train worker", "x", count=2)   # 1 on each node
    with pytest.raises(ValueError) as e:  # 3 + 2 CPUs, but 2-CPU workers fit only 1 + 1
        check_feasible({"CPU": 2}, "one Ray Train worker", "lower --cpus_per_worker", count=3,
                       count_fix="lower --num_workers")
    msg = str(e.value)
    assert "3 Ray Train workers need CPU 2 each" in msg and "holds 2 such at once" in msg, msg
    assert "lower --num_workers" in msg and "2 nodes" in msg, msg
    with pytest.raises(ValueError, match="holds 1 such"):  # one alive GPU
        check_feasible({"GPU": 1}, "one Ray Train worker", "x", count=2)
    monkeypatch.setenv("VOODOO_ALLOW_PENDING", "1")
    check_feasible({"CPU": 2}, "one Ray Train worker", "x", count=9)


def test_too_many_workers_for_the_local_ray_are_refused_before_any_work(tmp_path, tiny_fixed,
                                                                         monkeypatch):
    """Without RAY_ADDRESS the local Ray has this machine's CPUs: one more 1-CPU worker than
    that is refused before the data stage (it hung after the candidates)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("VOODOO_ALLOW_PENDING", raising=False)
    from cluster.session import running_local_cluster
    if running_local_cluster():
        pytest.skip("a `ray start` cluster runs on this machine: ray.init() joins it, so its "
                    "nodes are checked once Ray is up, not before the data")
    import ray
    n = (int(sum(nd["Resources"].get("CPU", 0) for nd in ray.nodes() if nd.get("Alive")))
         if ray.is_initialized() else (os.cpu_count() or 1)) + 1  # Ray up already: its nodes
    out = tmp_path / "run"
    rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                          *[x for x in SMALL if x != "--no_ray"], "--ray", "--num_workers",
                          str(n)])
    line = error_line(rc, err, "train")
    assert f"{n} Ray Train workers need CPU 1 each" in line and "--num_workers" in line, line
    nothing_written(out)


@pytest.mark.parametrize("fn, flag, prefix", [("_ray_run_name", "run_name", "voodoo-train-r"),
                                               ("_sweep_name", "sweep_name", "voodoo-tune-r")])
def test_ray_names_of_two_folders_of_one_name_differ_on_shared_storage(tmp_path, fn, flag,
                                                                        prefix):
    """Two output folders named alike (/x/r, /y/r) under one --storage_path shared the Ray Train
    run name voodoo-train-r (the second was refused as 'made by an older Voodoo'), and `voodoo
    tune` the sweep name voodoo-tune-r (one sweep's trials). With a --storage_path the default
    name also hashes the folder's full path; without one (checkpoints in <output_dir>/ray) it
    stays <prefix>-<folder name>; --run_name / --sweep_name win."""
    from types import SimpleNamespace

    import voodoo.cli as cli
    name = getattr(cli, fn)
    x, y = tmp_path / "x" / "r", tmp_path / "y" / "r"
    shared = SimpleNamespace(**{flag: None}, storage_path="/mnt/s")
    own = SimpleNamespace(**{flag: None}, storage_path=None)
    assert name(own, x) == name(own, y) == prefix
    nx, ny = name(shared, x), name(shared, y)
    assert nx.startswith(prefix + "-") and ny.startswith(prefix + "-") and nx != ny
    assert nx == name(shared, x)        # the same command resumes the same run
    assert name(SimpleNamespace(**{flag: "mine"}, storage_path="/s"), x) == "mine"


def test_eval_gguf_in_a_run_folder_uses_that_folder(tmp_path, capsys):
    """``voodoo eval --gguf runs/main/X.gguf`` measured in that run folder (its data and eval
    split), not in a new ``runs/<model name>``; a GGUF elsewhere leaves the default."""
    from types import SimpleNamespace

    from voodoo.cli import _gguf_run_folder
    run, other = tmp_path / "run", tmp_path / "other"
    (run / "data").mkdir(parents=True)
    (run / "data" / "meta.json").write_text("{}")
    other.mkdir()
    for d in (run, other):
        (d / "x.gguf").write_bytes(b"GGUF")
    a = SimpleNamespace(gguf=[str(other / "x.gguf"), str(run / "x.gguf")], output_dir=None)
    _gguf_run_folder(a)
    assert a.output_dir == str(run.resolve())
    assert "run folder" in capsys.readouterr().err
    a = SimpleNamespace(gguf=[str(other / "x.gguf")], output_dir=None)
    _gguf_run_folder(a)
    assert a.output_dir is None


def test_data_default_takes_what_a_short_text_holds(tiny_fixed, tmp_path):  # noqa: F811
    """``--n_train_blocks`` defaults to ``auto``: a text too short for the cap (192 blocks)
    gives every block it holds instead of being refused, and the run reuses that folder until
    the text changes; an explicit number is still a demand, and a bad value is refused at parse
    time."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from voodoo import cli
    from voodoo.models import prepare_model
    from voodoo.pipeline import ensure_dataset
    out = tmp_path / "run"
    txt = _calibration_text(tmp_path / "calib.txt")
    rc, _, err = run_cli(["data", "--model", str(tiny_fixed), "--output_dir", str(out),
                          "--data_name", str(txt), "--seq_len", "64"])
    assert rc == 0, err[-2000:]
    meta = json.loads((out / "data" / "meta.json").read_text())
    n = meta["n_train_blocks"]
    assert 4 < n < cli.AUTO_TRAIN_BLOCKS and meta["n_eval_blocks"] == 16, meta
    assert meta["n_train_blocks_asked"] == f"up to {cli.AUTO_TRAIN_BLOCKS}", meta
    ctx = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(
        prepare_model(str(tiny_fixed)).hf_dir))
    before = (out / "data" / "train.pt").stat().st_mtime_ns
    tr, ev, _ = ensure_dataset(ctx, out / "data", str(txt), 64, cli.AUTO_TRAIN_BLOCKS, 16, 0,
                               up_to=True)
    assert tr.shape == (n, 64) and ev.shape == (16, 64)
    assert (out / "data" / "train.pt").stat().st_mtime_ns == before  # reused, not rebuilt
    rc, _, err = run_cli(["data", "--model", str(tiny_fixed), "--output_dir", str(tmp_path / "b"),
                          "--data_name", str(txt), "--seq_len", "64",
                          "--n_train_blocks", str(n + 1)])
    assert rc != 0 and "--n_train_blocks" in err, err[-2000:]
    rc, _, err = run_cli(["data", "--model", str(tiny_fixed), "--n_train_blocks", "0"])
    assert rc == 2 and "must be 'auto' or an integer >= 1, got '0'" in err, err[-2000:]
    text = txt.read_text()
    txt.write_text(text + "\n\n" + text)  # the user's text grows: the folder is rebuilt
    old_train = (out / "data" / "train.pt").read_bytes()
    tr, _, meta = ensure_dataset(ctx, out / "data", str(txt), 64, cli.AUTO_TRAIN_BLOCKS, 16, 0,
                                 up_to=True)
    assert tr.shape[0] > n and meta["n_train_blocks"] == tr.shape[0], meta
    # what was made from the old blocks stays exportable: the old folder is kept beside it
    # (a refused retrain with another --data_name had replaced the run's data for good)
    assert (out / "data.previous" / "train.pt").read_bytes() == old_train
    new_train = (out / "data" / "train.pt").read_bytes()
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(Exception, match="no documents"):  # a failed rebuild: data/ as it was
        ensure_dataset(ctx, out / "data", str(empty), 64, cli.AUTO_TRAIN_BLOCKS, 16, 0,
                       up_to=True)
    assert (out / "data" / "train.pt").read_bytes() == new_train
    # `voodoo data` keeps one generation too: the same blocks again move nothing (the older
    # data.previous survives), other blocks push the current ones to data.previous
    data = ["data", "--model", str(tiny_fixed), "--output_dir", str(out), "--seq_len", "64"]
    rc, _, err = run_cli([*data, "--data_name", str(txt)])
    assert rc == 0, err[-2000:]
    assert (out / "data.previous" / "train.pt").read_bytes() == old_train
    assert (out / "data" / "train.pt").read_bytes() == new_train
    other = tmp_path / "other.txt"
    other.write_text(text)
    rc, _, err = run_cli([*data, "--data_name", str(other)])
    assert rc == 0, err[-2000:]
    assert (out / "data.previous" / "train.pt").read_bytes() == new_train
    assert json.loads((out / "data" / "meta.json").read_text())["source_arg"] == str(other)
    rc, _, err = run_cli([*data, "--data_name", str(empty)])  # refused: nothing moves
    assert rc != 0 and "no documents" in err, err[-2000:]
    assert (out / "data.previous" / "train.pt").read_bytes() == new_train
    assert json.loads((out / "data" / "meta.json").read_text())["source_arg"] == str(other)
    assert not (out / "data.new").exists()


def test_an_imatrix_of_another_model_is_named(tiny_fixed, tmp_path):  # noqa: F811
    """An --imatrix whose names miss most of this model's matmul weights (another model's, of
    the same hidden size) ran silently, and the menus' cut was blamed on get_rows-only
    tensors."""
    import warnings

    from voodoo.imatrix import read_imatrix_raw, write_imatrix_gguf
    out = tmp_path / "run"
    argv = ["precache", "--model", str(tiny_fixed), "--output_dir", str(out),
            "--seq_len", "64", "--n_train_blocks", "8", "--n_eval_blocks", "2",
            "--imatrix_blocks", "4", "--no_ray", "--candidate_types", "Q8_0,Q4_K,IQ2_XXS",
            "--rounding", "ggml"]
    rc, _, err = run_cli(argv)
    assert rc == 0, err[-2000:]
    raw = read_imatrix_raw(out / "imatrix.gguf")
    sums = {n: v for n, v in raw["sums"].items() if n.startswith("blk.0.")}  # layer 0 only
    counts = {n: raw["counts"][n] for n in sums}
    other = tmp_path / "other-imatrix.gguf"
    write_imatrix_gguf(other, sums, counts, datasets=["other"], chunk_count=4, chunk_size=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc, so, err = run_cli([*argv, "--imatrix", str(other)])
    assert rc == 0, err[-2000:]
    msgs = [str(w.message) for w in caught if "has no entry for" in str(w.message)]
    assert msgs and "made for another model" in msgs[0] and "blk.1." in msgs[0], msgs
    assert "the --imatrix file has no entry for them" in so


def test_a_hand_edited_assignment_names_the_tensor_and_the_fix():
    """A type llama.cpp does not have, or one whose blocks do not fit the tensor's rows, was
    refused by the candidate cache without naming the tensor or the file."""
    from types import SimpleNamespace

    from voodoo.cli import UsageError, _check_assignment_tensors
    specs = [SimpleNamespace(gguf_name="blk.0.attn_q.weight", n_per_row=128),
             SimpleNamespace(gguf_name="blk.0.ffn_down.weight", n_per_row=512)]

    def asg(q, d="Q4_K"):
        return {"tensors": {"blk.0.attn_q.weight": {"type": q},
                            "blk.0.ffn_down.weight": {"type": d}}}
    _check_assignment_tensors("a.json", asg("Q5_0"), specs)
    with pytest.raises(UsageError, match=r"a.json: blk.0.attn_q.weight has type 'FOO': "
                                         r"unknown or unsupported ggml type"):
        _check_assignment_tensors("a.json", asg("FOO"), specs)
    with pytest.raises(UsageError, match=r"blk.0.attn_q.weight has type 12; give a ggml type"):
        _check_assignment_tensors("a.json", asg(12), specs)   # not read as ggml type id 12
    with pytest.raises(UsageError, match=r"blk.0.attn_q.weight has type Q4_K, whose 256-weight "
                                         r"blocks do not fit its rows of 128 weights; llama.cpp "
                                         r"writes Q5_0 there instead"):
        _check_assignment_tensors("a.json", asg("Q4_K"), specs)


def test_a_hand_edited_assignment_records_the_bytes_its_types_take(monkeypatch):
    """A tensor's type changed by hand left ``total_bytes`` stale, and the GGUF's
    ``voodoo.selectable_bytes`` copied it (8,108,032 recorded, 8,103,936 held: a new user's
    report). With the model's tensor specs the bytes are recomputed from the types."""
    from types import SimpleNamespace

    import voodoo.cli as cli
    import voodoo.export as vexport
    from voodoo.quants import tensor_nbytes
    monkeypatch.setattr(vexport, "record_model", lambda prepared: "m@sha256:0")
    specs = [SimpleNamespace(gguf_name="a.weight", n_rows=64, n_per_row=256),
             SimpleNamespace(gguf_name="b.weight", n_rows=32, n_per_row=512)]
    held = tensor_nbytes("Q4_K", 64, 256) + tensor_nbytes("Q8_0", 32, 512)
    asg = {"budget_bytes": 10**6, "total_bytes": held + 4096,   # stale: edited by hand
           "tensors": {"a.weight": {"type": "Q4_K"}, "b.weight": {"type": "Q8_0"}}}
    kv = cli._provenance(SimpleNamespace(), asg, prepared=object(), specs=specs)
    assert kv["voodoo.selectable_bytes"] == held == 64 * 144 + 32 * 16 * 34
    assert cli._provenance(SimpleNamespace(), asg, prepared=object())[
        "voodoo.selectable_bytes"] == held + 4096   # without specs: the JSON's own figure


def test_a_config_without_architectures_is_named_by_run_and_export(tiny_fixed, tmp_path):  # noqa: F811
    """`voodoo run`/`export` check the model folder before any stage; a config.json without
    "architectures" got the converter's traceback there ("Failed to detect model
    architecture"), not the line to add."""
    import shutil
    m = tmp_path / "m"
    shutil.copytree(tiny_fixed, m)
    cfg = json.loads((m / "config.json").read_text())
    cfg.pop("architectures")
    (m / "config.json").write_text(json.dumps(cfg))
    asg = tmp_path / "m.assignment.json"
    asg.write_text(json.dumps({"tensors": {"blk.0.attn_q.weight": {"type": "Q8_0"}}}))
    for cmd in (["run", "--no_ray"], ["export", "--assignment", str(asg)]):
        rc, _, err = run_cli([cmd[0], "--model", str(m), "--output_dir", str(tmp_path / "o"),
                              *cmd[1:]])
        line = error_line(rc, err, cmd[0])
        assert 'names no "architectures"' in line and '["LlamaForCausalLM"]' in line, line
        assert "Traceback" not in err


def test_printed_recipe_is_shell_quoted(tmp_path, capsys):
    """The llama-quantize command printed after export pastes into a shell as it is, also for
    paths with spaces and non-ASCII letters (`--output_dir "out/dir with space ü"`)."""
    import shlex

    from voodoo import cli
    d = tmp_path / "dir with space ü"
    d.mkdir()
    gguf = d / "m.Voodoo55.gguf"
    gguf.write_bytes(b"")   # unreadable as a GGUF: the recipe then names the same tensors
    (d / "m.Voodoo55.tensor-types.txt").write_text("blk.0.attn_q.weight=q8_0\n")
    base = _model_gguf(tmp_path / "base f32.gguf")
    cli._print_recipe(gguf, base, d / "imatrix.gguf")
    out = capsys.readouterr().out.splitlines()
    talk = shlex.split(out[0].split(":", 1)[1])
    assert talk[talk.index("--gguf") + 1] == str(gguf)
    cmd = shlex.split(out[-1])
    assert cmd[cmd.index("--imatrix") + 1] == str(d / "imatrix.gguf")
    assert cmd[cmd.index("--tensor-type-file") + 1] == str(d / "m.Voodoo55.tensor-types.txt")
    assert cmd[-3:] == [str(base), "out.gguf", "Q8_0"]


def test_eval_text_is_read_as_data_name_reads_it(tmp_path):
    """--eval_text: a .jsonl is scored on its "text" fields (not on the JSON around them); a
    file that is not UTF-8 is refused with the iconv line (Latin-1 was scored as it was, and
    UTF-16 got "holds NUL bytes"), as --data_name does (breaker 4)."""
    import json
    from types import SimpleNamespace

    from voodoo import cli
    from voodoo.llamatext import readable_text

    class Tok:   # one token a word
        def __call__(self, text):
            return SimpleNamespace(input_ids=text.split())

    docs = [f"Document {i} says something about the weather in town. " * 40 for i in range(4)]
    jl = tmp_path / "eval.jsonl"
    jl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    a = SimpleNamespace(eval_text=str(jl), ctx=64, chunks=2)
    cli._check_eval_text_tokens(a, Tok())   # enough words in its texts
    plain = readable_text(_model_gguf(tmp_path / "m.gguf"), jl, cache_dir=tmp_path / "texts")
    assert plain.suffix == ".txt" and plain.read_text() == "\n\n".join(docs) + "\n"
    latin = tmp_path / "latin.txt"
    latin.write_bytes(("Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e. " * 400).encode("latin-1"))
    with pytest.raises(cli.UsageError, match="not UTF-8 text.*iconv -f latin1 -t utf-8"):
        cli._check_eval_text_tokens(SimpleNamespace(eval_text=str(latin), ctx=64, chunks=2),
                                    Tok())
    u16 = tmp_path / "u16.txt"
    u16.write_bytes(("Some text. " * 400).encode("utf-16"))
    with pytest.raises(cli.UsageError, match="UTF-16 text .*iconv -f UTF-16 -t utf-8"):
        cli._check_eval_text_tokens(SimpleNamespace(eval_text=str(u16), ctx=64, chunks=2),
                                    Tok())


def test_eval_of_a_run_folder_takes_its_recorded_ctx_and_chunks(tmp_path):
    """``voodoo eval --gguf`` of a run folder, on the text the run scored its report on, uses
    the run's --ctx/--chunks (eval/eval-text.json) unless they are given: with the defaults
    (512 x 8) a run made with --ctx 128 --chunks 4 was refused as too short for its own text."""
    import json
    from types import SimpleNamespace

    from voodoo.cli import EVAL_TEXT_RECORD, _recorded_ctx_chunks
    text = tmp_path / "eval-split.txt"
    text.write_text("some text\n")
    (tmp_path / EVAL_TEXT_RECORD).parent.mkdir()
    (tmp_path / EVAL_TEXT_RECORD).write_text(json.dumps({"path": str(text), "ctx": 128,
                                                         "chunks": 4}))
    g = [str(tmp_path / "m.gguf")]
    a = SimpleNamespace(gguf=g, eval_text=str(text), ctx=512, chunks=8)
    _recorded_ctx_chunks(a, ["--gguf", g[0]])
    assert (a.ctx, a.chunks) == (128, 4)
    a = SimpleNamespace(gguf=g, eval_text=str(text), ctx=256, chunks=8)
    _recorded_ctx_chunks(a, ["--gguf", g[0], "--ctx", "256"])   # given: kept
    assert (a.ctx, a.chunks) == (256, 4)
    a = SimpleNamespace(gguf=g, eval_text=str(tmp_path / "other.txt"), ctx=512, chunks=8)
    _recorded_ctx_chunks(a, ["--gguf", g[0]])                    # another text: the defaults
    assert (a.ctx, a.chunks) == (512, 8)


def test_an_f32_menu_trains_and_torch_eval_without_eval_blocks_is_refused(tmp_path,
                                                                          tiny_fixed):
    """Two reports of a new user, one run: `--candidate_types F32,Q8_0` went through every stage
    to the prior's costs and failed there (libggml's F32 traits have no to_float); and `voodoo
    eval --assignment` of a run made with `--n_eval_blocks 0` died of a ZeroDivisionError. F32
    candidates are now read as stored, and the torch eval is refused, naming the llama.cpp
    route."""
    out = tmp_path / "run"
    flags = [x for x in SMALL]
    flags[flags.index("--n_eval_blocks") + 1] = "0"
    rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out), *flags,
                          "--candidate_types", "F32,Q8_0", "--compression_ratio", "1.5"])
    assert rc == 0, err[-3000:]
    asg = next(out.glob("*.assignment.json"))
    types = {v["type"] for v in json.loads(asg.read_text())["tensors"].values()}
    assert "F32" in types, types
    rc, _, err = run_cli(["eval", "--assignment", str(asg)])
    line = error_line(rc, err, "eval")
    assert "no eval blocks" in line and "--n_eval_blocks 0" in line and "--gguf" in line, line


@pytest.mark.parametrize("value", ["abc", "0"])
def test_a_bad_quant_workers_cap_is_refused_before_any_stage(tiny_fixed, tmp_path,  # noqa: F811
                                                             monkeypatch, value):
    """VOODOO_QUANT_WORKERS=0 was refused only at the candidates, after the data and imatrix
    stages, and =abc once a local Ray had started (a new user's report)."""
    monkeypatch.setenv("VOODOO_QUANT_WORKERS", value)
    out = tmp_path / "run"
    argv = ["precache", "--model", str(tiny_fixed), "--output_dir", str(out),
            *SMALL[:SMALL.index("--no_ray")]]
    line = error_line(*run_cli(argv)[::2], "precache")
    assert f"VOODOO_QUANT_WORKERS='{value}': give a whole number >= 1" in line, line
    nothing_written(out)
    assert run_cli(argv + ["--no_ray", "--rounding", "ggml"])[0] == 0  # not asked: no Ray


def test_eval_rows_of_two_files_of_one_name_are_told_apart():
    """`voodoo eval --gguf runs/a/m.gguf runs/b/m.gguf` labelled both rows `m.gguf` (a new
    user's report); the folder is added where names repeat."""
    from voodoo.cli import _row_label
    ggufs = ["runs/a/m.gguf", "runs/b/m.gguf", "runs/b/stock.gguf"]
    assert [_row_label(g, ggufs) for g in ggufs] == ["a/m.gguf", "b/m.gguf", "stock.gguf"]


def test_a_compressed_eval_text_is_named_as_compressed(tmp_path):
    """A gzip file as --eval_text was refused as 'not a text file (it holds NUL bytes)'; it
    is named as compressed, with the command that decompresses it."""
    import gzip
    from types import SimpleNamespace

    from voodoo.cli import UsageError, _check_eval_text_tokens
    f = tmp_path / "wiki.test.raw.gz"
    f.write_bytes(gzip.compress(b"some text\n" * 1000))
    with pytest.raises(UsageError, match=r"wiki.test.raw.gz is a gzip-compressed file, not "
                                         r"text; decompress it first \(`gunzip -c ") as e:
        _check_eval_text_tokens(SimpleNamespace(eval_text=str(f), ctx=512, chunks=8), None)
    # the command as printed works from anywhere: the path as given, quoted
    cmd = re.search(r"\(`(.+)`\)", str(e.value)).group(1)
    subprocess.run(["bash", "-c", cmd], cwd="/", check=True)
    assert (tmp_path / "wiki.test.raw").read_bytes() == b"some text\n" * 1000


def test_ray_runs_sharing_a_run_folder_or_an_unwritable_storage_path(tiny_fixed, tmp_path):  # noqa: F811,E501
    """``--ray`` with a --storage_path and --run_name that another command is training in (its
    --output_dir another): refused before any work, naming the holder and --run_name (a new
    user's second job failed mid-run, the first's pruning having deleted its checkpoint
    files). A --storage_path under a file: refused before any work (it failed at Ray's start
    with a traceback)."""
    from voodoo.cli import _lock_run_folder, _release_run_folders
    storage = tmp_path / "shared_ray"
    (storage / "same").mkdir(parents=True)
    _lock_run_folder(storage / "same", "train --ray")   # the other job, here
    try:
        out = tmp_path / "second"
        rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                              "--ray", "--storage_path", str(storage), "--run_name", "same",
                              *SMALL[:-3], "--max_steps", "2"])
        line = error_line(rc, err)
        assert "is in use by another Voodoo run (voodoo train --ray, pid" in line, line
        assert "pass another --run_name" in line, line
        assert not (out / "data").exists()
    finally:
        _release_run_folders()
    (tmp_path / "afile").write_text("x")
    for cmd in ("train", "tune"):
        out = tmp_path / f"bad-{cmd}"
        argv = [cmd, "--model", str(tiny_fixed), "--output_dir", str(out), "--storage_path",
                str(tmp_path / "afile" / "ray"), *SMALL[:-3], "--max_steps", "2"]
        rc, _, err = run_cli(argv + (["--ray"] if cmd == "train" else []))
        line = error_line(rc, err, cmd)
        assert "--storage_path" in line and "afile is a file, not a folder" in line, line
        assert not (out / "data").exists()


def test_size_takes_the_voodoo_name():
    """``--size Voodoo55`` (the README's and the file names' spelling) is ``--size 55``."""
    from voodoo.cli import _voodoo_size
    assert _voodoo_size("Voodoo55") == _voodoo_size("55") == _voodoo_size("voodoo55") == 55.0
    assert _voodoo_size("Voodoo42.5") == 42.5


def test_eval_text_that_is_the_calibration_text_is_warned(tmp_path, capsys):
    """A new user ran `voodoo run --data_name calib.txt --eval_text calib.txt`: the table scored
    the first documents of the training split, silently. Now one warning names both flags;
    a copy of the same bytes counts too, another text does not."""
    from types import SimpleNamespace

    from voodoo.cli import _warn_eval_is_calibration
    calib = tmp_path / "calib.txt"
    calib.write_text("some calibration text\n" * 100)
    copy = tmp_path / "copy.txt"
    copy.write_bytes(calib.read_bytes())
    other = tmp_path / "other.txt"
    other.write_text("some evaluation texts\n" * 100)   # the same size, other bytes
    for ev, want in ((calib, True), (copy, True), (other, False)):
        a = SimpleNamespace(eval_text=str(ev), data_name=str(calib))
        assert _warn_eval_is_calibration(a) is want, ev
        err = capsys.readouterr().err
        assert ("is the calibration text (--data_name" in err) is want, err
    assert not _warn_eval_is_calibration(SimpleNamespace(eval_text=str(calib),
                                                         data_name="enwiki"))


def test_a_short_eval_text_scores_fewer_chunks_and_says_so(tmp_path, capsys):
    """llama-perplexity scores min(--chunks, tokens // ctx) chunks: a new user's 3,281-token
    text got 6 chunks while the header and the run's record said --chunks 8. The check now
    says so and sets --chunks to what will be scored; a long text keeps --chunks."""
    from types import SimpleNamespace

    from voodoo.cli import _check_eval_text_tokens

    def tokenizer(text):
        return SimpleNamespace(input_ids=text.split())
    short = tmp_path / "short.txt"
    short.write_text("word " * 3281)
    a = SimpleNamespace(eval_text=str(short), ctx=512, chunks=8)
    _check_eval_text_tokens(a, tokenizer)
    assert a.chunks == 6
    assert "holds 3281 tokens: llama-perplexity scores 6 chunks of 512 on it, not --chunks 8" \
        in capsys.readouterr().err
    long = tmp_path / "long.txt"
    long.write_text("word " * 5000)
    a = SimpleNamespace(eval_text=str(long), ctx=512, chunks=8)
    _check_eval_text_tokens(a, tokenizer)
    assert a.chunks == 8 and "llama-perplexity scores" not in capsys.readouterr().err


def test_a_gguf_path_that_is_not_there_names_the_files_beside_it(tmp_path):
    """``--gguf runs/main/X.Voodoo55.gguf`` (the name without its file-type badge) names the
    exported ``X.Voodoo55_Q4_K_S.gguf`` beside it; a folder without GGUFs adds nothing."""
    from voodoo import cli
    (tmp_path / "X.Voodoo55_Q4_K_S.gguf").write_bytes(b"GGUF")
    (tmp_path / "stock.IQ4_XS.gguf").write_bytes(b"GGUF")
    with pytest.raises(cli.UsageError) as ei:
        cli._check_model_gguf(tmp_path / "X.Voodoo55.gguf")
    msg = str(ei.value)
    assert "no such file; did you mean" in msg and "X.Voodoo55_Q4_K_S.gguf?" in msg, msg
    assert "stock.IQ4_XS" not in msg, msg
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(cli.UsageError) as ei:
        cli._check_model_gguf(empty / "X.gguf")
    assert str(ei.value).endswith("X.gguf: no such file"), str(ei.value)


def test_no_wikitext_inside_a_ray_job_says_why(monkeypatch):
    """Under `ray job submit` the package runs from Ray's copy of --working-dir (under
    ``runtime_resources``), where ../shared beside the user's checkout is not: the line that
    says no WikiText-2 was found says so and names --eval_text; elsewhere it does not."""
    from voodoo import cli
    assert "ray job submit" not in cli._no_wikitext()
    monkeypatch.setattr(cli, "__file__", "/tmp/ray/session_1/runtime_resources/"
                        "working_dir_files/_ray_pkg_0123/voodoo/cli.py")
    line = cli._no_wikitext()
    assert line.startswith("no --eval_text and no ../shared/data/wikitext-2-raw-test.txt (this "
                           "`ray job submit` job runs from Ray's copy of --working-dir"), line
    assert "--eval_text with an absolute path" in line


def test_match_size_takes_a_file_to_match(tmp_path):
    """``--match_size FILE``: a llama.cpp user matches a GGUF they have (a tester's
    ``--match_size llama-Q4_K_M.gguf`` was refused as neither bytes nor a type); a missing file
    or an empty one is refused naming it; type names still win over a file of the same name."""
    from voodoo.cli import UsageError, _match_size_target
    f = tmp_path / "llama-Q4_K_M.gguf"
    f.write_bytes(b"GGUF" + bytes(12_340))
    assert _match_size_target(str(f)) == 12_344
    assert _match_size_target("q4_k_m") == "Q4_K_M"
    for bad, words in ((tmp_path / "gone.gguf", "no such file"),
                       (tmp_path, "no such file")):
        with pytest.raises(UsageError, match=words):
            _match_size_target(str(bad))
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(UsageError, match="the file is empty"):
        _match_size_target(str(tmp_path / "empty.gguf"))


def test_output_name_drops_a_gguf_ending_in_any_case():
    """``--output_name out.GGUF`` wrote ``out.GGUF.gguf`` (only ``.gguf`` was taken off)."""
    import argparse

    from voodoo.cli import _file_stem
    assert _file_stem("out.GGUF") == "out" and _file_stem("my.gguf") == "my"
    assert _file_stem("my.model") == "my.model"
    with pytest.raises(argparse.ArgumentTypeError, match="not a plain file name"):
        _file_stem(".gguf")


def test_a_read_only_cache_is_named_with_the_way_out(tmp_path, monkeypatch, capsys):
    """A write the file system refuses (read-only: EROFS; no permission) in the Voodoo cache is
    one line naming the cache and VOODOO_CACHE, not a bare errno; elsewhere, the folder and
    --output_dir. (Root ignores chmod, so the refusal is raised where a write would be.)"""
    import errno

    from voodoo import cli
    cache = tmp_path / "cache"
    monkeypatch.setenv("VOODOO_CACHE", str(cache))
    where = {"file": cache / "candidates" / "Q5_1" / "ab.arrow"}

    def refused(args):
        raise OSError(errno.EROFS, "Read-only file system", str(where["file"]))
    monkeypatch.setitem(cli.COMMANDS, "precache", (refused, "test"))
    line = error_line(cli.main(["precache"]), capsys.readouterr().err, "precache")
    assert f"in the Voodoo cache {cache}" in line and "VOODOO_CACHE=" in line, line
    assert "Read-only file system" in line and "rerun the same command" in line
    where["file"] = tmp_path / "out" / "x.json"
    line = error_line(cli.main(["precache"]), capsys.readouterr().err, "precache")
    assert "--output_dir" in line and "Voodoo cache" not in line and str(tmp_path / "out") in line
