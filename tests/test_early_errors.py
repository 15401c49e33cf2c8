"""Errors found early and in one line (issue 13, item 4): a tensor-parallel split that cuts
quantization blocks, or an architecture without a tensor-parallel policy, fails right after the
menus are known (no data, imatrix, precache or Fisher); a Q8_0-only menu at compression ratio
1.0 works (the Fisher prior's knapsack no longer asks for a "resolution" no flag reaches); the
in-process precache names the tensor holding NaN/Inf weights."""

from __future__ import annotations

import numpy as np
import pytest

from test_cli_errors import SMALL, error_line, nothing_written
from test_pipeline import run_cli, tiny_fixed  # noqa: F401  (fixture)


def test_tp_split_cutting_blocks_fails_before_data(tiny_fixed, tmp_path):  # noqa: F811
    # hidden 256: attn_output's 256 columns split 2 ways are 128-column shards, which cut
    # the 256-weight blocks of the K-quants in the default menus
    out = tmp_path / "run"
    rc, _, err = run_cli(["tp", "--nproc", "2", "--", "--model", str(tiny_fixed),
                          "--output_dir", str(out), "--seq_len", "64", "--n_train_blocks", "8"])
    line = error_line(rc, err, "tp")
    assert "--tensor_parallel 2" in line and ".weight" in line and "block size 256" in line, line
    assert "use tensor parallel 1" in line and "drop that type" in line, line
    nothing_written(out)


def test_tp_without_adapter_points_to_device_map(tmp_path):
    from voodoo.llamacpp import LlamaCppNotBuilt, source_dir
    try:
        source_dir()
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    from zoo import make_tiny
    model = make_tiny("qwen3")
    out = tmp_path / "run"
    rc, _, err = run_cli(["tp", "--nproc", "2", "--", "--model", str(model),
                          "--output_dir", str(out), "--candidate_types", "Q8_0,Q4_0"])
    line = error_line(rc, err, "tp")
    assert "no tensor-parallel policy" in line and "--device_map" in line, line
    nothing_written(out)


def test_knapsack_exact_fit():
    """Sizes that fill the budget exactly (a one-type menu at ratio 1.0) overflow once rounded
    up to the DP's units; the choice must still be found (it used to say 'raise resolution')."""
    from voodoo.sensitivity import fisher_gate_logits, knapsack_choice
    dist = {f"t{i}": [0.0] for i in range(50)}
    nbytes = {f"t{i}": [1_000_003 + i] for i in range(50)}
    budget = sum(v[0] for v in nbytes.values())
    assert knapsack_choice(dist, nbytes, budget) == {n: 0 for n in dist}
    assert set(fisher_gate_logits(dist, nbytes, budget)) == set(dist)


def test_q8_0_only_at_ratio_one_trains(tiny_fixed, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    rc, so, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                           *SMALL, "--candidate_types", "Q8_0", "--compression_ratio", "1.0"])
    assert rc == 0, err[-3000:]
    assert "resolution" not in err
    (asg,) = out.glob("*.assignment.json")
    import json
    a = json.loads(asg.read_text())
    assert {t["type"] for t in a["tensors"].values()} == {"Q8_0"}
    assert a["total_bytes"] == a["budget_bytes"]


def test_no_ray_precache_names_the_nonfinite_tensor(tmp_path):
    from voodoo.candidates import CandidateCache, CandidateJob, precache_local
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    w[3, 9] = np.inf
    with pytest.raises(ValueError, match=r"blk\.1\.attn_v\.weight: 1 NaN/Inf weights \(first "
                                         r"at row 3, column 9\)"):
        precache_local([CandidateJob("blk.1.attn_v.weight", w, "Q8_0", None)],
                       CandidateCache(tmp_path), progress=False)


@pytest.mark.parametrize("flags, words", [
    (["--stock_types", "Q4_K_M,BOGUS"], ["--stock_types: BOGUS", "Q4_K_M", "IQ2_XXS"]),
    (["--ctx", "0"], ["--ctx 0", "positive"]),
    (["--chunks", "0"], ["--chunks 0", "positive"]),
])
def test_run_refuses_eval_settings_that_fail_only_at_the_end(tiny_fixed, tmp_path, flags,
                                                              words):  # noqa: F811
    """A stock file type llama-quantize does not know (its QUANT_OPTIONS, parsed from the
    pinned source) or a non-positive --ctx/--chunks would fail after training: refused first."""
    out = tmp_path / "run"
    rc, _, err = run_cli(["run", "--model", str(tiny_fixed), "--output_dir", str(out), *SMALL,
                          *flags])
    line = error_line(rc, err, "run")
    assert all(w in line for w in words), line
    nothing_written(out)


def test_serve_port_out_of_range(tmp_path):
    rc, _, err = run_cli(["serve", "--gguf", str(tmp_path / "x.gguf"), "--port", "99999"])
    line = error_line(rc, err, "serve")
    assert "--port 99999" in line and "1 to 65535" in line, line


def test_output_dir_that_is_a_file(tiny_fixed, tmp_path):  # noqa: F811
    f = tmp_path / "fake.gguf"
    f.write_bytes(b"x")
    rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(f), *SMALL])
    line = error_line(rc, err, "train")
    assert "is a file, not a folder" in line, line


@pytest.mark.parametrize("flags, words", [
    (["--compression_ratio", "0.5", "--target_bits", "4"],
     ["--compression_ratio and --target_bits both set a budget"]),
    (["--imatrix", "no-such.imatrix.gguf"], ["--imatrix no-such.imatrix.gguf: no such file",
                                             "leave --imatrix out"]),
    (["--compression_ratio", "-0.5"], ["--compression_ratio -0.5: must be positive"]),
    (["--target_bits", "0"], ["--target_bits 0: must be positive"]),
    (["--compression_ratio", "nan"], ["--compression_ratio nan: must be positive (a number"]),
    (["--target_bits", "20"], ["--target_bits 20: more bits per weight", "give at most 16"]),
    (["--budget_reduction", "1.5"], ["--budget_reduction 1.5:", "[0, 1)"]),
    (["--compression_ratio", "1.7"], ["a budget above the Q8_0 size", "at most 1.0"]),
    (["--compression_ratio", "55"], ["a budget above the Q8_0 size",
                                     "--compression_ratio 0.55 for Voodoo55?"]),
    (["--size", "55", "--compression_ratio", "0.5"],
     ["--size and --compression_ratio both set a budget"]),
    (["--size", "0"], ["--size 0:", "in (0, 100]", "--size 55 for Voodoo55"]),
    (["--size", "120"], ["--size 120:", "in (0, 100]"]),
    # --size 55 is --compression_ratio 0.55, and the message names the flag given
    (["--size", "55", "--target_bits", "4"],
     ["--size and --target_bits both set a budget"]),
    (["--size", "55", "--match_size", "Q4_K_M"],
     ["--match_size and --size both set a budget"]),
    # data parallel: 2 workers cannot share a batch of 1 (found by the workers, once, only after
    # every preparation stage)
    (["--ray", "--num_workers", "2", "--batch_size", "1"],
     ["--batch_size 1 does not divide over 2 data-parallel workers", "--batch_size 2"]),
    (["--ray", "--num_workers", "2", "--tensor_parallel", "3"],
     ["--num_workers 2 is not a multiple of --tensor_parallel 3"]),
])
def test_train_refuses_conflicting_or_missing_inputs_first(tiny_fixed, tmp_path, flags,
                                                           words):  # noqa: F811
    out = tmp_path / "run"
    rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                          *flags])
    line = error_line(rc, err, "train")
    assert all(w in line for w in words), line
    assert "--- load model" not in err
    nothing_written(out)
    assert not out.exists(), "a refused command left its new --output_dir behind"


def test_failed_command_keeps_an_output_dir_it_did_not_make(tmp_path):
    """The empty new --output_dir of a failed command is removed; one that existed before
    (empty or not) is left alone."""
    for out in (tmp_path / "new", tmp_path / "old"):
        if out.name == "old":
            out.mkdir()
        rc, _, err = run_cli(["train", "--model", str(tmp_path / "no-such-model"),
                              "--output_dir", str(out)])
        assert rc == 2 and "no such file or folder" in err, err[-2000:]
        assert out.exists() == (out.name == "old")


def test_a_ratio_just_above_one_gets_no_percent_hint(tiny_fixed, tmp_path):  # noqa: F811
    """1.5 is no percentage: the message does not suggest --compression_ratio 0.015 (far below
    any menu's reach), it says how low a budget can go."""
    rc, _, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir",
                          str(tmp_path / "run"), "--compression_ratio", "1.5"])
    line = error_line(rc, err, "train")
    assert "at most 1.0" in line and "0.015" not in line and "how low" in line, line


def test_a_misspelt_flag_names_the_one_meant():
    rc, _, err = run_cli(["train", "--compresion_ratio", "0.5"])
    line = error_line(rc, err, "train")
    assert "(did you mean --compression_ratio?)" in line, line
