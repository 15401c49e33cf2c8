"""The tiny model through every stage of ``voodoo run`` (data -> imatrix -> candidates -> train
-> bake -> export -> eval), run once per module through the CLI's ``main()``, then checked:

1. the exported GGUF's tensors are byte-identical to llama-quantize with the written
   ``<stem>.tensor-types.txt`` and the same imatrix on the base F32 GGUF;
2. the size the budget predicted is the size written, and within 0.5% of the budget;
3. an interrupted-and-resumed ``voodoo train`` bakes the same assignment as an uninterrupted
   run;
5. ``voodoo eval --gguf X --report R`` prints PPL / KLD / same-top-p and writes the JSON;
plus the candidates built by Ray actors equal the in-process ones.

(Check 4, torch PPL of the baked student vs llama-perplexity on the GGUF, needs the real model:
it is in ``test_e2e_smollm2.py``, which shares that model's run.)

The tiny model is made with a fixed seed at a fixed place under the Voodoo cache, so the base
F32 GGUF and the content-addressed candidate cache are reused across sessions.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from voodoo.ggufio import read_gguf

from voodoo import cli
from voodoo.llamacpp import LlamaCppNotBuilt, cache_root, source_dir, tool_path

#: Settings of the module's run (small: seq_len 64, 8 train blocks, 6 steps, in-process
#: candidates). 5 eval blocks (320 tokens): without ../shared's WikiText the eval split is
#: llama-perplexity's text, and -c 128 needs at least 256 tokens.
COMMON = ["--seq_len", "64", "--n_train_blocks", "8", "--n_eval_blocks", "5",
          "--imatrix_blocks", "4", "--compression_ratio", "0.5", "--no_ray", "--seed", "0"]
TRAIN = ["--max_steps", "6", "--partial_save_interval", "2"]
EVAL = ["--ctx", "128", "--chunks", "2"]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``voodoo.cli.main(argv)`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="session")
def tiny_fixed() -> Path:
    """The tiny random llama (``make_tiny_model``, seed 0) at a fixed path in the Voodoo cache:
    the same folder (same mtimes) every session, so ``prepare_model`` reuses its base F32 GGUF
    and the candidate cache hits."""
    try:
        source_dir()
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    from voodoo.models import make_tiny_model
    from conftest import SMOL_GGUF
    return make_tiny_model(cache_root() / "test-models" / "tiny-llama-s0", seed=0,
                           tokenizer_gguf=SMOL_GGUF if SMOL_GGUF.is_file() else None)


@pytest.fixture(scope="module")
def tiny_run(tiny_fixed, tmp_path_factory):
    """``voodoo run`` on the tiny model, once: returns a dict of the run's files and output."""
    try:
        tool_path("llama-perplexity")
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("tiny-run")
    t0 = time.perf_counter()
    rc, stdout, stderr = run_cli(["run", "--model", str(tiny_fixed), "--output_dir", str(out),
                                  *COMMON, *TRAIN, *EVAL, "--stock_types", ""])
    wall = time.perf_counter() - t0
    assert rc == 0, stderr[-3000:]
    print(f"\n[tiny voodoo run: {wall:.1f} s]")
    (asg,) = out.glob("*.assignment.json")
    stem = asg.name.removesuffix(".assignment.json")
    from voodoo.models import prepare_model
    return {"out": out, "stem": stem, "assignment": asg, "gguf": out / f"{stem}.gguf",
            "types": out / f"{stem}.tensor-types.txt", "imatrix": out / "imatrix.gguf",
            "base": prepare_model(tiny_fixed).base_gguf, "stdout": stdout, "stderr": stderr,
            "model": tiny_fixed}


def test_run_writes_every_stage(tiny_run):
    out = tiny_run["out"]
    for p in (out / "data" / "train.pt", out / "data" / "eval.pt", tiny_run["imatrix"],
              out / "train" / "partial.pt", tiny_run["assignment"], tiny_run["gguf"],
              tiny_run["types"], out / "eval" / "report.json", out / "eval" / "report.md",
              out / "eval" / "timing.json"):
        assert p.is_file(), p
    assert not list(out.glob(".*partial*")), "temporary files left behind"
    # the default candidate bytes: --rounding auto, its choices scored on held-out blocks
    asg = json.loads(tiny_run["assignment"].read_text())
    assert asg["provenance"]["rounding"] == "auto", asg["provenance"]
    choices = json.loads((out / "rounding.json").read_text())["tensors"]
    assert set(choices) <= set(asg["tensors"]) and choices
    # the pre-flight check ran before training: llama.cpp on the F32 GGUF == transformers
    pre = json.loads((out / "preflight.json").read_text())
    assert pre["ok"] and pre["kld_mean"] < 1e-3 and pre["same_top_p"] > 0.99, pre
    assert pre["n_ctx"] == 64 and pre["n_tokens"] == 8 * 31, pre  # chunks of --seq_len
    # and llama.cpp's tokenizer cuts the calibration text as transformers' did
    tok = pre["tokenizer"]
    assert tok["same"] and tok["n_differ"] == 0 and tok["n_llama"] >= 100, tok
    assert "llama.cpp's tokenizer agrees with transformers'" in tiny_run["stderr"]
    rows = json.loads((out / "eval" / "report.json").read_text())
    assert [r["file"] for r in rows] == ["Voodoo"]
    timing = json.loads((out / "eval" / "timing.json").read_text())
    assert any(k.startswith("gate training") and v > 0 for k, v in timing["stages"].items())
    assert isinstance(timing["history"], list), timing
    # report.md says what was measured, and holds the table the run printed
    md = (out / "eval" / "report.md").read_text().splitlines()
    assert md[0].startswith("llama-perplexity -c ") and " on " in md[0] and "KLD vs" in md[0]
    assert md[0] in tiny_run["stdout"] and md[2] in tiny_run["stdout"], md[:3]
    # the default gate init is the Fisher knapsack; its report covers every tensor and its
    # choice fits the budget
    sens = json.loads((out / "train" / "sensitivity.json").read_text())
    asg = json.loads(tiny_run["assignment"].read_text())
    assert set(sens["tensors"]) == set(asg["tensors"])
    assert sens["choice_bytes"] <= sens["budget_bytes"] == asg["budget_bytes"]
    assert sens["predicted_kl"] > 0 and sens["mu_nats_per_byte"] > 0
    for t in sens["tensors"].values():
        assert len(t["dkl"]) == len(t["menu"]) == len(t["bytes"]) and t["choice"] in t["menu"]
    assert rows[0]["ppl"] > 0 and rows[0]["kld"] >= 0 and 0 <= rows[0]["same_top_p"] <= 1
    assert "baked:" in tiny_run["stdout"] and "| Voodoo |" in tiny_run["stdout"]
    # the imatrix the candidates were quantized with, named as llama-quantize names it (by
    # its file name: the same run in another folder writes the same file)
    from voodoo.imatrix import read_imatrix_raw
    kv = {k: f.contents() for k, f in read_gguf(tiny_run["gguf"]).fields.items()
          if k.startswith("quantize.imatrix.")}
    assert kv["quantize.imatrix.file"] == tiny_run["imatrix"].name, kv
    assert kv["quantize.imatrix.entries_count"] == len(
        read_imatrix_raw(tiny_run["imatrix"])["sums"]) > 0, kv
    assert kv["quantize.imatrix.chunks_count"] > 0, kv


@pytest.mark.slow
def test_export_matches_llama_quantize(tiny_run, tmp_path):
    """1. llama-quantize --imatrix <run imatrix> --tensor-type-file <stem>.tensor-types.txt on the
    base F32 GGUF writes the very tensors of the exported GGUF, except those the export holds
    as error-feedback bytes (--rounding auto, counted in ``voodoo.rounding.tensor_count``):
    those have the same type and shape."""
    from voodoo.export import quantize_with_llama
    ref = quantize_with_llama(tiny_run["base"], tmp_path / "llama-quantize.gguf",
                              tensor_type_file=tiny_run["types"],
                              imatrix_file=tiny_run["imatrix"], default_type="Q8_0")
    ours = {t.name: t for t in read_gguf(tiny_run["gguf"]).tensors}
    theirs = {t.name: t for t in read_gguf(ref).tensors}
    assert sorted(ours) == sorted(theirs)  # llama-quantize writes them in its own order
    full = json.loads(tiny_run["assignment"].read_text())
    asg = full["tensors"]
    # --rounding auto (the default): the tensors whose error-feedback bytes won hold those;
    # the GGUF counts them, and llama-quantize reproduces every other tensor exactly
    won = full.get("rounding_feedback") or {}
    own = {n for n, v in asg.items() if v["type"] in won.get(n, ())}
    f = read_gguf(tiny_run["gguf"]).fields.get("voodoo.rounding.tensor_count")
    assert (int(f.parts[-1][0]) if f is not None else 0) == len(own)
    assert len(own) < len(asg)
    for name, t in ours.items():
        u = theirs[name]
        assert t.tensor_type == u.tensor_type, name
        assert [int(x) for x in t.shape] == [int(x) for x in u.shape], name
        if name in asg:
            assert GGMLQuantizationType(t.tensor_type).name == asg[name]["type"], name
        if name not in own:
            assert np.asarray(t.data).tobytes() == np.asarray(u.data).tobytes(), \
                f"{name}: bytes differ from llama-quantize"


def test_sizes_predicted_equal_written(tiny_run):
    """2. assignment bytes == voodoo.quants.tensor_nbytes == the GGUF's tensor bytes; the total
    is within 0.5% of the budget (never above budget * 1.005)."""
    from voodoo.budget import budget_bytes
    from voodoo.quants import tensor_nbytes
    asg = json.loads(tiny_run["assignment"].read_text())
    tensors = {t.name: t for t in read_gguf(tiny_run["gguf"]).tensors}
    shapes = {}
    written = 0
    for name, v in asg["tensors"].items():
        t = tensors[name]
        n_per_row, n_rows = int(t.shape[0]), int(t.shape[1])
        shapes[name] = (n_rows, n_per_row)
        predicted = tensor_nbytes(v["type"], n_rows, n_per_row)
        assert v["bytes"] == predicted == int(t.n_bytes), name
        written += int(t.n_bytes)
    assert asg["total_bytes"] == sum(v["bytes"] for v in asg["tensors"].values()) == written
    budget = asg["budget_bytes"]
    assert budget == budget_bytes(shapes, compression_ratio=0.5)
    print(f"\n[tiny sizes: budget {budget}, predicted {asg['total_bytes']}, written {written}, "
          f"{100 * (written / budget - 1):+.3f}% of the budget]")
    assert written <= budget * 1.005
    assert abs(written / budget - 1) <= 0.005
    # every tensor not in the assignment is copied from the base unchanged
    base = {t.name: t for t in read_gguf(tiny_run["base"]).tensors}
    for name, t in tensors.items():
        if name not in asg["tensors"]:
            assert t.tensor_type == base[name].tensor_type
            assert np.asarray(t.data).tobytes() == np.asarray(base[name].data).tobytes()


def test_interrupted_train_resumes_to_the_same_assignment(tiny_run, tmp_path):
    """3. ``voodoo train --stop_after 3`` then the same command again (resuming from the
    journal, with another save interval) bakes exactly the assignment of the uninterrupted
    ``voodoo run``; the resume adds the tokenizer comparison to a ``preflight.json`` kept
    without one."""
    out = tmp_path / "resumed"
    argv = ["train", "--model", str(tiny_run["model"]), "--output_dir", str(out), *COMMON,
            *TRAIN, "--data_dir", str(tiny_run["out"] / "data"),
            "--imatrix", str(tiny_run["imatrix"])]
    rc, stdout, stderr = run_cli(argv + ["--stop_after", "3"])
    assert rc == 0, stderr[-3000:]
    assert "stopped after 3 of 6 steps" in stdout
    assert not list(out.glob("*.assignment.json"))
    import torch
    j = torch.load(out / "train" / "partial.pt", weights_only=True)
    assert j["step"] == 3
    # a preflight.json kept before the tokenizers were compared gets the comparison on resume
    pre = out / "preflight.json"
    old = json.loads(pre.read_text())
    pre.write_text(json.dumps({k: v for k, v in old.items() if k != "tokenizer"}))
    rc, stdout, stderr = run_cli(argv[:-4] + ["--partial_save_interval", "5"] + argv[-4:])
    assert rc == 0, stderr[-3000:]
    assert json.loads(pre.read_text()) == old, "the tokenizer comparison was not added"
    assert "llama.cpp's tokenizer agrees with transformers'" in stderr
    (asg,) = out.glob("*.assignment.json")
    resumed = json.loads(asg.read_text())
    straight = json.loads(tiny_run["assignment"].read_text())
    assert {n: v["type"] for n, v in resumed["tensors"].items()} == \
        {n: v["type"] for n, v in straight["tensors"].items()}
    assert resumed == straight  # probs too: the same gates
    assert torch.load(out / "train" / "partial.pt", weights_only=True)["step"] == 6


@pytest.mark.slow
def test_eval_prints_table_and_writes_report(tiny_run, tmp_path):
    """5. ``voodoo eval --gguf X --report R``: a table with PPL, KLD and same-top-p, R.json."""
    rep = tmp_path / "rep" / "report"
    rc, stdout, stderr = run_cli(["eval", "--model", str(tiny_run["model"]), "--gguf",
                                  str(tiny_run["gguf"]), "--report", str(rep), *EVAL])
    assert rc == 0, stderr[-3000:]
    header = next(ln for ln in stdout.splitlines() if ln.startswith("| file"))
    for col in ("ppl", "kld", "same_top_p"):
        assert col in header.split(" | ") or f"| {col} |" in header, header
    row = next(ln for ln in stdout.splitlines() if tiny_run["gguf"].name in ln)
    assert len(row.split("|")) == len(header.split("|"))
    rows = json.loads(rep.with_name("report.json").read_text())
    assert rows[0]["file"] == tiny_run["gguf"].name
    assert rows[0]["ppl"] > 0 and rows[0]["kld"] >= 0 and 0 <= rows[0]["same_top_p"] <= 1
    md = rep.with_name("report.md").read_text().splitlines()
    assert md[0].startswith("llama-perplexity -c ") and md[0] in stdout and md[2] == header, md


@pytest.mark.slow
def test_eval_in_a_run_folder_keeps_its_data(tiny_run, monkeypatch):
    """``eval --gguf X --output_dir RUN`` without WikiText scores the run's own eval split: the
    folder's data settings (data/meta.json), not the defaults rebuilt over the run's data."""
    monkeypatch.setattr(cli, "_default_eval_text", lambda: None)
    monkeypatch.setattr(cli, "_recorded_eval_text", lambda ggufs: None)  # as before `run` kept it
    meta = tiny_run["out"] / "data" / "meta.json"
    before = meta.read_bytes()
    rc, _, stderr = run_cli(["eval", "--model", str(tiny_run["model"]), "--gguf",
                             str(tiny_run["gguf"]), "--output_dir", str(tiny_run["out"]), *EVAL])
    assert rc == 0, stderr[-3000:]
    assert "(5 blocks)" in stderr and meta.read_bytes() == before


def test_eval_checks_its_text_and_ctx_as_run_does(tiny_run, tmp_path):
    """``voodoo eval --gguf`` refuses, before llama-perplexity runs, what ``voodoo run`` refuses
    before training: a text that is not UTF-8 text (UTF-16, binary: once a raw "invalid
    codepoint" abort, or a table of UTF-16 bytes), and a --ctx beyond the model's context (once
    minutes of llama-perplexity and gigabytes of base logits)."""
    from transformers import AutoConfig
    n_ctx = AutoConfig.from_pretrained(tiny_run["model"]).max_position_embeddings
    u16 = tmp_path / "u16.txt"
    u16.write_text("The quick brown fox jumps over the lazy dog. " * 400, encoding="utf-16")
    base = ["eval", "--model", str(tiny_run["model"]), "--gguf", str(tiny_run["gguf"])]
    rc, _, err = run_cli([*base, "--eval_text", str(u16), *EVAL])
    assert rc == 2 and "UTF-16 text" in err and "iconv -f UTF-16" in err, err[-2000:]
    assert "Traceback" not in err
    good = tmp_path / "good.txt"
    good.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    rc, _, err = run_cli([*base, "--eval_text", str(good), "--ctx", str(2 * n_ctx),
                          "--chunks", "1"])
    assert rc == 2 and f"--ctx {2 * n_ctx} is longer than the model's context" in err, \
        err[-2000:]


@pytest.mark.slow
def test_eval_header_names_the_chunks_a_short_text_gets(tiny_run, tmp_path):
    """A text that holds fewer than --chunks chunks: llama-perplexity scores what it holds,
    and the header (report.md's first line) says that number, not the --chunks asked for (a
    tester's report.md said --chunks 8 over 3 scored chunks)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_run["model"])
    text = tmp_path / "short.txt"
    line = "The quick brown fox jumps over the lazy dog. "
    text.write_text(line * 40)
    n = len(tok(text.read_text()).input_ids)
    want = n // 128
    assert 1 <= want < 8, n
    rc, stdout, stderr = run_cli(["eval", "--model", str(tiny_run["model"]), "--gguf",
                                  str(tiny_run["gguf"]), "--eval_text", str(text),
                                  "--ctx", "128", "--chunks", "8"])
    assert rc == 0, stderr[-3000:]
    assert f"llama-perplexity scores {want} chunks of 128 on it, not --chunks 8" in stderr
    header = next(ln for ln in stdout.splitlines() if ln.startswith("llama-perplexity -c"))
    assert header.startswith(f"llama-perplexity -c 128 --chunks {want} on "), header


def test_eval_of_a_run_folders_gguf_scores_the_runs_text(tiny_run, monkeypatch):
    """``voodoo eval --gguf runs/x/F.gguf`` without --eval_text (and no WikiText beside the
    checkout) measured on the calibration corpus's eval split, not on the text `voodoo run`
    scored the folder's report on: the run records that text (eval/eval-text.json), and eval
    scores it again, to the report's KLD. So it does when WikiText sits beside the checkout
    (a new user's eval scored WikiText, KLD 0.27, against the report's 0.33 on their text)."""
    other = tiny_run["out"] / "eval" / "not-the-report-text.txt"
    other.write_text("a different text\n" * 2000)
    monkeypatch.setattr(cli, "_default_eval_text", lambda: other)
    rec = json.loads((tiny_run["out"] / "eval" / "eval-text.json").read_text())
    assert Path(rec["path"]).is_file() and rec["ctx"] == 128 and rec["chunks"] == 2
    rc, stdout, stderr = run_cli(["eval", "--model", str(tiny_run["model"]), "--gguf",
                                  str(tiny_run["gguf"]), *EVAL])
    assert rc == 0, stderr[-3000:]
    assert f"measuring on {rec['path']}, the text `voodoo run` scored" in stderr
    row = next(ln for ln in stdout.splitlines() if tiny_run["gguf"].name in ln)
    cols = [c.strip() for c in row.strip("|").split("|")]
    header = next(ln for ln in stdout.splitlines() if ln.startswith("| file"))
    kld = float(cols[[c.strip() for c in header.strip("|").split("|")].index("kld")])
    report = json.loads((tiny_run["out"] / "eval" / "report.json").read_text())[0]["kld"]
    assert abs(kld - report) <= 1e-4 + 0.02 * report, (kld, report)


def test_a_changed_eval_text_is_named(tmp_path, capsys):
    """The record of the text `voodoo run` scored holds its sha256: when the file has changed
    since, eval still scores it but says its numbers will not match the report."""
    from voodoo.fsutil import sha256_file
    text = tmp_path / "t.txt"
    text.write_text("one two three\n")
    (tmp_path / "eval").mkdir()
    rec = {"path": str(text), "ctx": 128, "chunks": 2, "sha256": sha256_file(text)}
    (tmp_path / cli.EVAL_TEXT_RECORD).write_text(json.dumps(rec))
    gguf = tmp_path / "x.gguf"
    assert cli._recorded_eval_text([gguf]) == text
    assert "has changed" not in capsys.readouterr().err
    text.write_text("one two four\n")
    assert cli._recorded_eval_text([gguf]) == text
    assert "has changed since `voodoo run` scored" in capsys.readouterr().err


def test_another_budget_in_a_finished_run_folder_fails_first(tiny_run):
    """``voodoo train`` at another budget in a folder whose journal is finished: refused before
    the imatrix, candidates and Fisher stages, naming the budget and the way out."""
    rc, _, stderr = run_cli(["train", "--model", str(tiny_run["model"]), "--output_dir",
                             str(tiny_run["out"]), *COMMON[:8], "--compression_ratio", "0.6",
                             "--no_ray", "--seed", "0", *TRAIN])
    assert rc != 0
    assert "belongs to a different run" in stderr and "budget_bytes" in stderr, stderr[-2000:]
    assert "--- candidates" not in stderr and "--- fisher" not in stderr


def test_precache_after_data_keeps_its_data(tiny_fixed, tmp_path):
    """``voodoo data`` with its own settings, then ``voodoo precache`` in the same folder
    without them: the data is reused (taken from data/meta.json, said in one line), not
    rebuilt with the defaults (64 blocks of 512 tokens would not even fit the tiny corpus)."""
    out = tmp_path / "run"
    data = ["--seq_len", "64", "--n_train_blocks", "6", "--n_eval_blocks", "5"]
    rc, _, stderr = run_cli(["data", "--model", str(tiny_fixed), "--output_dir", str(out), *data])
    assert rc == 0, stderr[-3000:]
    meta = out / "data" / "meta.json"
    before = meta.read_bytes()
    rc, _, stderr = run_cli(["precache", "--model", str(tiny_fixed), "--output_dir", str(out),
                             "--imatrix_blocks", "2", "--no_ray", "--candidate_types", "Q8_0"])
    assert rc == 0, stderr[-3000:]
    assert meta.read_bytes() == before
    assert "taken from the run's data/meta.json: --seq_len 64, --n_train_blocks 6, " \
        "--n_eval_blocks 5" in stderr


@pytest.mark.slow
@pytest.mark.ray
def test_precache_through_ray_equals_local(tiny_run, tmp_path):
    """The candidates of one layer built by Ray actors (cluster.precache.precache_ray, a fresh
    cache) are byte-identical to those the in-process run cached."""
    ray = pytest.importorskip("ray")
    from cluster.precache import precache_ray
    from voodoo.candidates import CandidateCache
    from voodoo.imatrix import read_imatrix
    from voodoo.pipeline import candidate_jobs, load_context, make_menus
    ctx = load_context(tiny_run["model"], with_tokenizer=False)
    menus = make_menus(ctx.specs)
    jobs = [j for j in candidate_jobs(ctx, menus, read_imatrix(tiny_run["imatrix"]))
            if j.gguf_name.startswith("blk.0.attn_") and j.type_name in ("Q4_K", "IQ4_XS",
                                                                          "IQ2_S")]
    assert len(jobs) == 12
    fresh = CandidateCache(tmp_path / "ray-cache")
    # error-feedback candidates too: one Hessian shared by a k-quant and a 32-block type,
    # whose rounding tags differ
    from voodoo.candidates import CandidateJob, quantize_candidate
    j0 = jobs[0]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, j0.weights.shape[1]))
    hess = (x.T @ x).astype(np.float32)
    fb = [CandidateJob(j0.gguf_name, j0.weights, t, j0.imatrix_row, hess) for t in ("Q4_K",
                                                                                  "Q8_0")]
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, address="local")
    try:
        res = precache_ray(jobs, fresh, max_workers=2, progress=False)
        res_fb = precache_ray(fb, fresh, max_workers=2, progress=False)
    finally:
        if started:
            ray.shutdown()
    assert res_fb.misses == 2
    for j in fb:
        key = res_fb[(j.gguf_name, j.type_name)]
        assert key.rounding.startswith("gptq:")
        want = quantize_candidate(np.asarray(j.weights), j.type_name, j.imatrix_row,
                                  j.gguf_name, hessian=hess)
        assert fresh.get(key).tobytes() == want.tobytes(), j.type_name
    assert res.misses == 12 and res.hits == 0
    main = CandidateCache()
    for (name, t), key in res.items():
        mine = main.get(key)
        assert mine is not None, (name, t)
        assert fresh.get(key).tobytes() == mine.tobytes(), (name, t)


def test_untied_model_resumes(tmp_path):
    """An interrupted ``voodoo train`` of a model with an untied ``token_embd`` resumes: its
    menu loses the types that need an imatrix row (IQ1_S, IQ2_XXS) only once the imatrix is
    known, and the early journal check used to compare the menus before that and refuse."""
    try:
        source_dir()
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    from zoo import make_tiny
    model = make_tiny("llama")  # tie_word_embeddings=False
    out = tmp_path / "run"
    argv = ["train", "--model", str(model), "--output_dir", str(out), "--seq_len", "64",
            "--n_train_blocks", "8", "--n_eval_blocks", "2", "--imatrix_blocks", "4",
            "--no_ray", "--max_steps", "4", "--compression_ratio", "0.6"]
    rc, stdout, stderr = run_cli(argv + ["--stop_after", "2"])
    assert rc == 0, stderr[-3000:]
    assert "left out of the menu of token_embd.weight" in stdout + stderr
    assert not list(out.glob("*.assignment.json"))
    rc, stdout, stderr = run_cli(argv)
    assert rc == 0, stderr[-3000:]
    assert "other inputs" not in stderr
    (asg,) = out.glob("*.assignment.json")
    assert len(json.loads(asg.read_text())["tensors"]) > 0


def test_a_damaged_hessians_file_is_recomputed(tiny_fixed, tmp_path, monkeypatch):
    """A cut-off or byte-flipped ``hessians.npz`` made every rerun stop with a raw
    ``BadZipFile``/``Bad CRC-32`` until deleted by hand; it is now recomputed, to the same
    values, with one line naming the file (its cached hard link, damaged with it, too)."""
    import torch

    from voodoo.pipeline import ensure_hessians, load_context
    ctx = load_context(str(tiny_fixed), with_tokenizer=False)
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path / "cache"))
    vocab = int(ctx.model.config.vocab_size)
    blocks = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "hessians.npz"
    want = ensure_hessians(ctx, path, blocks, {"t": 1})
    good = path.read_bytes()
    flipped = bytearray(good)
    mid = len(good) // 2
    flipped[mid:mid + 16] = bytes(b ^ 0xFF for b in flipped[mid:mid + 16])
    for damaged in (good[:len(good) // 2], bytes(flipped)):
        path.write_bytes(damaged)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            got = ensure_hessians(ctx, path, blocks, {"t": 1})
        assert f"{path} is unreadable" in err.getvalue()
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)
        assert path.read_bytes() != damaged


def test_hessians_of_the_same_inputs_come_from_the_cache(tiny_fixed, tmp_path, monkeypatch):
    """The input Hessians (the largest stage of a CPU run) were computed again in every new
    run folder; the same model and tokens now take them from ``<cache>/hessians`` (a hard
    link: one copy on disk), other tokens do not."""
    import torch

    from voodoo.pipeline import ensure_hessians, load_context
    ctx = load_context(str(tiny_fixed), with_tokenizer=False)
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path / "cache"))
    vocab = int(ctx.model.config.vocab_size)
    blocks = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    a, b, c = (tmp_path / x / "hessians.npz" for x in "abc")
    want = ensure_hessians(ctx, a, blocks, {"model": "m", "tokens": "t1"})
    shared = list((tmp_path / "cache" / "hessians").glob("*.npz"))
    assert len(shared) == 1 and shared[0].stat().st_ino == a.stat().st_ino
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        got = ensure_hessians(ctx, b, None, {"model": "m", "tokens": "t1"})  # no blocks needed
    assert "taken from the cache" in err.getvalue()
    assert b.stat().st_ino == a.stat().st_ino
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="no calibration blocks"):
        ensure_hessians(ctx, c, None, {"model": "m", "tokens": "t2"})   # other tokens
    # a full run folder: no half-written file left there, the cache keeps them
    import errno
    real = np.savez

    def full(file, *a, **k):
        if Path(file).parent == tmp_path / "c":
            Path(file).write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real(file, *a, **k)
    monkeypatch.setattr(np, "savez", full)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        got = ensure_hessians(ctx, c, blocks, {"model": "m", "tokens": "t3"})
    assert "kept in the cache" in err.getvalue() and set(got) == set(want)
    assert not list((tmp_path / "c").iterdir())
    assert len(list((tmp_path / "cache" / "hessians").glob("*.npz"))) == 2


def test_a_damaged_cached_base_gguf_is_converted_again(tiny_fixed, tmp_path):
    """Flipped bytes in the cached ``base-f32.gguf`` were reported as a wrong tensor map ("the
    map is wrong for this model"); the model is now converted again: found by its
    ``.written.sha256`` record, or, for a base without one (a cache from before the records),
    by the map's check, after which a base that agrees says the cached one was damaged."""
    from voodoo.models import WRITTEN_SUFFIX
    from voodoo.pipeline import load_context
    ctx = load_context(str(tiny_fixed), work_dir=tmp_path / "w", with_tokenizer=False)
    base = Path(ctx.prepared.base_gguf)
    assert tmp_path in base.parents
    good = base.read_bytes()
    bad = bytearray(good)
    bad[-4096:-4000] = b"\xff" * 96            # inside the last tensor's F32 data: NaNs
    for record in (True, False):
        base.write_bytes(bytes(bad))
        if not record:
            base.with_name(base.name + WRITTEN_SUFFIX).unlink()
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            ctx2 = load_context(str(tiny_fixed), work_dir=tmp_path / "w", with_tokenizer=False)
        log = err.getvalue()
        if record:
            assert "has changed since it was written" in log, log[-2000:]
        else:
            assert "in case the cached" in log and "the cached one was damaged" in log
        assert Path(ctx2.prepared.base_gguf).read_bytes() == good


def test_an_imatrix_of_the_same_inputs_comes_from_the_cache(tiny_fixed, tmp_path):  # noqa: F811
    """Every new run folder computed the imatrix again (45-60 s for SmolLM2, byte-identical
    each time, a new user's report); the same model and calibration tokens now take it from
    ``<cache>/imatrix`` (a hard link), and other tokens do not."""
    args = ["precache", "--model", str(tiny_fixed), "--seq_len", "64", "--n_train_blocks", "8",
            "--n_eval_blocks", "2", "--imatrix_blocks", "4", "--no_ray",
            "--candidate_types", "Q8_0,Q4_K", "--rounding", "ggml"]
    rc, _, err = run_cli([*args, "--output_dir", str(tmp_path / "a")])
    assert rc == 0, err[-3000:]
    rc, _, err = run_cli([*args, "--output_dir", str(tmp_path / "b")])
    assert rc == 0, err[-3000:]
    assert "imatrix: taken from the cache" in err, err[-3000:]
    a, b = (tmp_path / x / "imatrix.gguf" for x in "ab")
    assert a.read_bytes() == b.read_bytes()
    shared = Path(err.split("imatrix: taken from the cache (", 1)[1].split(")", 1)[0])
    assert shared.stat().st_ino == b.stat().st_ino
    # a copy edited in place (the run folder's file is the cache's, hard-linked) is not served
    raw = b.read_bytes()
    with open(b, "r+b") as f:
        f.seek(len(raw) - 8)
        f.write(bytes(8) if raw[-8:] != bytes(8) else b"\1" * 8)
    rc, _, err = run_cli([*args, "--output_dir", str(tmp_path / "d")])
    assert rc == 0, err[-3000:]
    assert "could not be used (its bytes changed since it was kept)" in err, err[-3000:]
    assert (tmp_path / "d" / "imatrix.gguf").read_bytes() == raw
    b.unlink()
    rc, _, err = run_cli([*args, "--output_dir", str(tmp_path / "c"), "--seed", "1"])
    assert rc == 0, err[-3000:]
    # other calibration tokens: not that file (another entry, made by an earlier session's
    # run of this test, may serve: the cache outlives the tests)
    assert str(shared) not in err, err[-3000:]
    assert (tmp_path / "c" / "imatrix.gguf").read_bytes() != a.read_bytes()


def test_a_re_export_names_the_report_it_makes_stale(tmp_path):
    """A new user re-baked with guardrails and re-exported under the same name: the run's
    eval/report.md still showed the first file's KLD (0.0513) for a file that scored 0.0735.
    The replacement line now says so when the report names the file, and only then."""
    from voodoo.pipeline import _stale_report_note
    gguf = tmp_path / "M.Voodoo55_Q4_K_S.gguf"
    assert _stale_report_note(gguf) == ""                      # no report
    (tmp_path / "eval").mkdir()
    report = tmp_path / "eval" / "report.json"
    report.write_text(json.dumps([{"file": "Voodoo", "name": gguf.name, "kld": 0.0513}]))
    note = _stale_report_note(gguf)
    assert str(tmp_path / "eval" / "report.md") in note and f"voodoo eval --gguf {gguf}" in note
    report.write_text(json.dumps([{"file": "Voodoo", "name": "other.gguf"}]))
    assert _stale_report_note(gguf) == ""
    report.write_text("{not json")
    assert _stale_report_note(gguf) == ""


def test_a_full_run_folder_stops_before_the_imatrix_is_computed_again(tmp_path, monkeypatch):
    """The cache holds the imatrix, and the run folder has no room for it: that is said at
    once, naming the file, instead of computing the imatrix anew (a minute for SmolLM2) only to
    fail writing it to the same full folder."""
    import errno

    from voodoo import pipeline
    from voodoo.imatrix import write_imatrix_gguf
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path / "cache"))
    names = ("blk.0.attn_q.weight",)
    made = write_imatrix_gguf(tmp_path / "a" / "imatrix.gguf",
                              {n: np.ones((1, 8), np.float32) for n in names},
                              {n: np.array([64]) for n in names}, datasets=["t"],
                              chunk_count=1, chunk_size=8)
    inputs = {"model": "m", "tokens": "t" * 64}
    pipeline.shared_imatrix(made, inputs, keep=True)
    full = tmp_path / "b" / "imatrix.gguf"
    full.parent.mkdir()

    def no_room(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))
    monkeypatch.setattr(pipeline, "_link_or_copy", no_room)
    with pytest.raises(OSError) as ei:
        pipeline.shared_imatrix(full, inputs)
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == str(full)
    monkeypatch.undo()
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path / "cache"))
    assert pipeline.shared_imatrix(full, inputs) is not None and full.is_file()
