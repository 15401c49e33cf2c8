"""A run folder reused for another model (issue 13, item 1): every artifact records what it was
made from (``provenance.json``), and no stage consumes one made from other inputs. A training
journal of another model is refused before any expensive stage, naming both models; an
imatrix of another model is rebuilt, and the log says so; stock files are quantized again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_cli_errors import error_line
from test_pipeline import run_cli, tiny_fixed  # noqa: F401  (fixture)
from voodoo.fsutil import sha256_file

SMALL = ["--seq_len", "64", "--n_train_blocks", "8", "--n_eval_blocks", "2",
         "--imatrix_blocks", "4", "--no_ray", "--max_steps", "1"]


@pytest.fixture(scope="module")
def tiny_other(tiny_fixed) -> Path:  # noqa: F811
    """A second tiny llama, same shapes and tokenizer, other weights (seed 1)."""
    from voodoo.models import make_tiny_model
    return make_tiny_model(tiny_fixed.parent / "tiny-llama-s1", seed=1)


def test_unit_records(tmp_path):
    from voodoo import provenance as pv
    (tmp_path / "a.bin").write_bytes(b"x")
    assert pv.check(tmp_path, "missing.bin", {"model": "m"}) is None
    assert pv.check(tmp_path, "a.bin", {"model": "m"}) == ["origin unknown"]
    pv.record(tmp_path, "a.bin", {"model": "m", "tokens": "t"})
    assert pv.check(tmp_path, "a.bin", {"model": "m", "tokens": "t"}) == []
    assert pv.check(tmp_path, "a.bin", {"model": "n", "tokens": "t"}) == ["model"]
    assert pv.tokens_sha256([[1, 2]]) != pv.tokens_sha256([[1, 3]])
    # the base GGUF's hash is remembered beside it, keyed by size and mtime
    assert pv.file_sha256(tmp_path / "a.bin") == sha256_file(tmp_path / "a.bin")
    assert (tmp_path / "a.bin.sha256").read_text().split()[2] == sha256_file(tmp_path / "a.bin")


def test_second_model_in_the_same_folder(tiny_fixed, tiny_other, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    rc, so, se = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out), *SMALL])
    assert rc == 0, se[-3000:]
    im1 = sha256_file(out / "imatrix.gguf")
    journal = out / "train" / "partial.pt"
    j1 = sha256_file(journal)
    man = json.loads((out / "provenance.json").read_text())
    assert man["imatrix.gguf"]["model"].startswith("tiny-llama-s0@sha256:")
    assert man["train/partial.pt"]["model"] == man["imatrix.gguf"]["model"]

    # model 2, same folder: M1's journal is refused, naming both models and the way out,
    # before the data/imatrix/candidate stages (nothing changed)
    rc, so, se = run_cli(["train", "--model", str(tiny_other), "--output_dir", str(out), *SMALL])
    line = error_line(rc, se)
    assert "tiny-llama-s0" in line and "tiny-llama-s1" in line, line
    assert "partial.pt" in line and "--output_dir" in line and "delete" in line, line
    assert sha256_file(out / "imatrix.gguf") == im1 and sha256_file(journal) == j1
    assert not list(out.glob("tiny-llama-s1.*"))
    # a model of other shapes (so also another budget): named as another model, not as a
    # budget that differs
    from voodoo.models import make_tiny_model
    wider = make_tiny_model(tiny_fixed.parent / "tiny-llama-3l-s2", seed=2, num_hidden_layers=3)
    rc, so, se = run_cli(["train", "--model", str(wider), "--output_dir", str(out), *SMALL])
    line = error_line(rc, se)
    assert "tiny-llama-s0" in line and "tiny-llama-3l-s2" in line, line
    assert "budget" not in line, line
    assert sha256_file(journal) == j1

    # the way out taken (journal deleted): M1's imatrix is not reused but rebuilt, and the log
    # says so; the new assignment and journal record model 2
    journal.unlink()
    rc, so, se = run_cli(["train", "--model", str(tiny_other), "--output_dir", str(out), *SMALL])
    assert rc == 0, se[-3000:]
    assert "imatrix.gguf was not made for this run (model tiny-llama-s0" in se, se[-3000:]
    assert "rebuilding it" in se
    assert sha256_file(out / "imatrix.gguf") != im1
    man = json.loads((out / "provenance.json").read_text())
    assert man["imatrix.gguf"]["model"].startswith("tiny-llama-s1@sha256:")
    assert man["train/partial.pt"]["model"] == man["imatrix.gguf"]["model"]
    assert man["train/partial.pt"]["imatrix"] == sha256_file(out / "imatrix.gguf")
    (asg,) = out.glob("tiny-llama-s1.*.assignment.json")
    assert json.loads(asg.read_text())["provenance"]["model"] == man["imatrix.gguf"]["model"]

    # voodoo export of M1's assignment with model 2 is refused
    (asg1,) = out.glob("tiny-llama-s0.*.assignment.json")
    rc, so, se = run_cli(["export", "--model", str(tiny_other), "--output_dir", str(out),
                          "--assignment", str(asg1), "--no_ray"])
    if "provenance" in json.loads(asg1.read_text()):
        line = error_line(rc, se, "export")
        assert "tiny-llama-s0" in line and "tiny-llama-s1" in line, line
    # and so is voodoo eval of it, before the run folder's data is looked at (it was rebuilt
    # with the other model's tokenizer first, its own moved to data.previous)
    data = {f.name: sha256_file(f) for f in (out / "data").iterdir() if f.is_file()}
    rc, so, se = run_cli(["eval", "--model", str(tiny_other), "--assignment", str(asg1),
                          "--no_ray"])
    line = error_line(rc, se, "eval")
    assert "was made for tiny-llama-s0" in line and "tiny-llama-s1" in line, line
    assert "--model" in line and not (out / "data.previous").exists(), line
    assert {f.name: sha256_file(f) for f in (out / "data").iterdir() if f.is_file()} == data


def test_stock_file_requantized_for_another_imatrix(tiny_prepared, tmp_path):
    """runner.stock_file reuses a stock GGUF only when made from the same base and imatrix."""
    import numpy as np

    from voodoo.imatrix import write_imatrix_gguf
    from voodoo.llamacpp import LlamaCppNotBuilt, tool_path
    from voodoo.runner import stock_file
    try:
        tool_path("llama-quantize")
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    from voodoo.ggufio import read_gguf
    names = {t.name: int(t.shape[0]) for t in read_gguf(str(tiny_prepared.base_gguf)).tensors
             if len(t.shape) == 2}
    ims = []
    for k in range(2):
        rng = np.random.default_rng(k)
        sums = {n: (rng.random(w) + 0.01).astype(np.float32) * 4 for n, w in names.items()}
        ims.append(write_imatrix_gguf(tmp_path / f"im{k}.gguf", sums, {n: 4 for n in names},
                                      datasets=["t"], chunk_count=4, chunk_size=64))
    f = stock_file(tiny_prepared.base_gguf, "Q4_K_M", tmp_path / "im0.gguf", tmp_path / "s")
    b0, t0 = sha256_file(f), f.stat().st_mtime_ns
    assert stock_file(tiny_prepared.base_gguf, "Q4_K_M", tmp_path / "im0.gguf",
                      tmp_path / "s").stat().st_mtime_ns == t0  # same inputs: reused
    f = stock_file(tiny_prepared.base_gguf, "Q4_K_M", tmp_path / "im1.gguf", tmp_path / "s")
    assert f.stat().st_mtime_ns != t0 and sha256_file(f) != b0
    # a damaged file of the same inputs (a full disk, a bad copy) was reused forever and every
    # rerun died in llama-perplexity: quantized again
    b1 = sha256_file(f)
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    f = stock_file(tiny_prepared.base_gguf, "Q4_K_M", tmp_path / "im1.gguf", tmp_path / "s")
    assert sha256_file(f) == b1


def test_a_journal_of_other_candidate_bytes_names_them_and_the_way_to_resume(
        tiny_fixed, tmp_path):  # noqa: F811
    """A folder trained with llama-quantize's bytes (the default before 2026-12-05), trained
    again without --rounding (now auto): refused before any stage, naming the setting as the
    user would type it and how to resume; with --rounding ggml the same folder trains on."""
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_fixed), "--output_dir", str(out), *SMALL]
    rc, so, se = run_cli(argv + ["--rounding", "ggml"])
    assert rc == 0, se[-3000:]
    rc, so, se = run_cli(argv)
    line = error_line(rc, se)
    assert "rounding ggml, not auto" in line and "resume it with --rounding ggml" in line, line
    assert "None" not in line, line
    assert "input Hessians" not in se  # refused before the stages
    rc, so, se = run_cli(argv + ["--rounding", "ggml"])
    assert rc == 0, se[-3000:]


def test_a_journal_of_other_hessian_blocks_names_the_way_to_resume(tiny_fixed, tmp_path):  # noqa: F811,E501
    """A folder trained with other input-Hessian blocks (e.g. the default of 64 before
    2026-12-05, now 192), trained again without --hessian_blocks: refused, naming the flag and
    the value to resume with; with it the folder trains on."""
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_fixed), "--output_dir", str(out), *SMALL,
            "--rounding", "gptq"]
    rc, so, se = run_cli(argv + ["--hessian_blocks", "4"])
    assert rc == 0, se[-3000:]
    rc, so, se = run_cli(argv)
    line = error_line(rc, se)
    assert "hessian_blocks" in line and "resume it with --hessian_blocks 4" in line, line
    rc, so, se = run_cli(argv + ["--hessian_blocks", "4"])
    assert rc == 0, se[-3000:]


def test_a_journal_of_other_menus_names_the_menu_flags(tiny_fixed, tmp_path):  # noqa: F811
    """A folder trained with other --candidate_types: the refusal named two sha256s (menus,
    rounding_feedback), not the flags a user changed (a tester's report)."""
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_fixed), "--output_dir", str(out), *SMALL,
            "--rounding", "ggml"]
    rc, so, se = run_cli(argv)
    assert rc == 0, se[-3000:]
    rc, so, se = run_cli(argv + ["--candidate_types", "Q8_0,Q4_K,IQ4_XS"])
    line = error_line(rc, se)
    assert "training journal" in line and "candidate menus are not this run's" in line \
        and "--candidate_types" in line, line


def test_an_edited_calibration_text_refuses_the_journal_before_the_stages(tiny_fixed, tmp_path):  # noqa: F811,E501
    """The --data_name text edited after a run: the data folder is rebuilt from it, and the
    journal of the old tokens is refused right after the data stage (before the imatrix, the
    Hessians and the candidates are made again for the new tokens), naming the likely cause;
    with the text as it was the folder trains on."""
    from test_cli_errors import _calibration_text
    out = tmp_path / "run"
    txt = _calibration_text(tmp_path / "calib.txt")
    argv = ["train", "--model", str(tiny_fixed), "--output_dir", str(out), *SMALL,
            "--rounding", "ggml", "--data_name", str(txt)]
    rc, so, se = run_cli(argv)
    assert rc == 0, se[-3000:]
    before = txt.read_text()
    txt.write_text("an added paragraph of new words.\n\n\n" + before)
    rc, so, se = run_cli(argv)
    line = error_line(rc, se)
    assert "training journal" in line and "the --data_name text changed" in line, line
    assert "as it was before an edit" in se  # the data stage saw it
    assert "--- imatrix" not in se, se[-3000:]  # refused before the next stage
    txt.write_text(before)
    rc, so, se = run_cli(argv)
    assert rc == 0, se[-3000:]


def test_written_record_tells_a_changed_file_from_a_touched_one(tmp_path):
    """The record of a file as written: a touch keeps it valid, a flipped byte or a truncation
    does not, and a truncated file is not hashed (the size is checked first)."""
    import os

    from voodoo.fsutil import changed_since_written, written_record
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 64)
    size, digest = written_record(p)
    assert size == 16384 and digest == sha256_file(p)
    os.utime(p, (1, 1))
    assert changed_since_written(p, size, digest) is None
    b = bytearray(p.read_bytes())
    b[5000] ^= 1
    p.write_bytes(bytes(b))
    why = changed_since_written(p, size, digest)
    assert why is not None and "sha256" in why and digest[:12] in why
    p.write_bytes(bytes(b[:100]))
    hashed = []
    why = changed_since_written(p, size, digest, sha256=lambda q: hashed.append(q) or "x")
    assert why == "it has 100 bytes, 16384 when written" and hashed == []
