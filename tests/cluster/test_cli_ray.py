"""The CLI's Ray layer on the tiny model: ``voodoo train --ray`` (in-process and tensor
parallel over gloo), ``voodoo tp`` and ``voodoo tune``.

The tiny random llama (hidden 256, 4 heads / 2 KV heads, intermediate 512) sits at a fixed
path in the Voodoo cache and the data/imatrix settings are those of ``tests/test_pipeline.py``,
so the content-addressed candidate cache hits. Tensor parallel splits attn_output's 256
columns in two: 128-column shards, so the attention menu holds 32-block types only.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from voodoo import cli  # noqa: E402
from voodoo.llamacpp import LlamaCppNotBuilt, cache_root, source_dir  # noqa: E402

pytestmark = pytest.mark.ray

DATA = ["--seq_len", "64", "--n_train_blocks", "8", "--n_eval_blocks", "2",
        "--imatrix_blocks", "4", "--no_ray", "--seed", "0"]
#: Small menus (cached types; block-32 attention types so that TP=2 can cut attn_output).
MENU = ["--attention_candidates", "Q8_0,Q5_0,Q4_0",
        "--non_attention_candidates", "Q8_0,Q5_K,Q4_K,IQ2_S", "--compression_ratio", "0.6"]
TRAIN = ["--max_steps", "3", "--partial_save_interval", "3", "--batch_size", "2", "--lr", "0.1",
         "--size_weight", "10"]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def tiny_fixed() -> Path:
    try:
        source_dir()
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    from conftest import SMOL_GGUF
    from voodoo.models import make_tiny_model
    return make_tiny_model(cache_root() / "test-models" / "tiny-llama-s0", seed=0,
                           tokenizer_gguf=SMOL_GGUF if SMOL_GGUF.is_file() else None)


@pytest.fixture(scope="module")
def ray_up():
    owned = not ray.is_initialized()
    if owned:
        ray.init(num_cpus=4, include_dashboard=False, address="local")
    yield
    if owned and ray.is_initialized():
        ray.shutdown()


def train(model, out, *extra) -> tuple[dict, str, float]:
    t0 = time.perf_counter()
    rc, stdout, err = run_cli(["train", "--model", str(model), "--output_dir", str(out),
                               *DATA, *MENU, *TRAIN, *extra])
    wall = time.perf_counter() - t0
    assert rc == 0, (stdout + err)[-4000:]
    (asg,) = Path(out).glob("*.assignment.json")
    assert (Path(out) / asg.name.replace(".assignment.json", ".gates.pt")).is_file()
    return json.loads(asg.read_text()), stdout, wall


def types(asg: dict) -> dict[str, str]:
    return {n: v["type"] for n, v in asg["tensors"].items()}


@pytest.fixture(scope="module")
def reference(tiny_fixed, tmp_path_factory):
    """The in-process (no Ray) run."""
    asg, _, wall = train(tiny_fixed, tmp_path_factory.mktemp("ref"))
    print(f"\n[in-process voodoo train: {wall:.1f} s]")
    return asg


@pytest.fixture(scope="module")
def one_worker(tiny_fixed, tmp_path_factory, reference):
    out = tmp_path_factory.mktemp("ray0")
    asg, stdout, wall = train(tiny_fixed, out, "--ray", "--num_workers", "0")
    print(f"\n[voodoo train --ray --num_workers 0: {wall:.1f} s]")
    return asg, out, stdout


def test_ray_in_process_matches_in_process_path(one_worker, reference):
    asg, out, stdout = one_worker
    assert types(asg) == types(reference)
    assert asg["total_bytes"] == reference["total_bytes"]
    assert asg["budget_bytes"] == reference["budget_bytes"]
    assert "baked:" in stdout
    # fixed run name under <output_dir>/ray: the checkpoints live there
    assert list((out / "ray").glob("voodoo-train-*/checkpoint_*"))


def test_ray_tensor_parallel_2_workers(tiny_fixed, tmp_path, one_worker, ray_up):
    asg, stdout, wall = train(tiny_fixed, tmp_path / "tp2", "--ray", "--tensor_parallel", "2",
                              "--num_workers", "2", "--cpus_per_worker", "1")
    print(f"\n[voodoo train --ray --tensor_parallel 2 --num_workers 2: {wall:.1f} s]")
    assert types(asg) == types(one_worker[0])


def test_tensor_parallel_without_ray_is_an_error(tmp_path):
    rc, _, err = run_cli(["train", "--model", str(tmp_path / "nope"), "--output_dir",
                          str(tmp_path / "o"), "--tensor_parallel", "2"])
    assert rc == 2 and "voodoo tp" in err and "--ray" in err


def test_voodoo_tp(tiny_fixed, tmp_path, one_worker, ray_up, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "7")  # the user's setting is kept
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    import os
    t0 = time.perf_counter()
    rc, stdout, err = run_cli(["tp", "--nproc", "2", "--", "--model", str(tiny_fixed),
                               "--output_dir", str(tmp_path / "tp"), *DATA, *MENU, *TRAIN,
                               "--cpus_per_worker", "1"])
    print(f"\n[voodoo tp --nproc 2: {time.perf_counter() - t0:.1f} s]")
    assert rc == 0, (stdout + err)[-4000:]
    assert "NCCL_NVLS_ENABLE=7" in stdout and os.environ["NVSHMEM_DISABLE_NVLS"] == "1"
    (asg,) = (tmp_path / "tp").glob("*.assignment.json")
    assert types(json.loads(asg.read_text())) == types(one_worker[0])


def test_voodoo_tune(tiny_fixed, tmp_path, ray_up):
    """A sweep in a folder that already holds an in-process journal (`train/partial.pt`, e.g.
    after `voodoo run` there): every trial once failed at its start ("gate_init 'fisher'
    needs init_logits"), because the prior was skipped as if a journal would be resumed."""
    out = tmp_path / "tune"
    rc, stdout, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                               *DATA, *MENU, *TRAIN, "--stop_after", "1"])
    assert rc == 0 and (out / "train" / "partial.pt").is_file(), (stdout + err)[-4000:]
    t0 = time.perf_counter()
    tune_train = TRAIN[: TRAIN.index("--size_weight")]  # the sweep samples it (refused)
    rc, stdout, err = run_cli(["tune", "--model", str(tiny_fixed), "--output_dir", str(out),
                               *DATA, *MENU, *tune_train, "--num_samples", "4",
                               "--size_weight_range", "1", "100", "--cpus_per_trial", "1",
                               "--max_concurrent_trials", "4", "--max_steps", "2", "--export"])
    print(f"\n[voodoo tune --num_samples 4 --export: {time.perf_counter() - t0:.1f} s]")
    assert rc == 0, (stdout + err)[-4000:]
    print(stdout[-1500:])
    assert "best: trial" in stdout
    best = json.loads((out / "tune_best.json").read_text())
    assert set(best["config"]) == {"size_weight", "size_tolerance"}
    assert 1.0 <= best["config"]["size_weight"] <= 100.0
    (asg,) = out.glob("*.assignment.json")
    assert asg.with_name(asg.name.replace(".assignment.json", ".gguf")).is_file()
    # the objective scored the assignment that was exported (same bake, fill included)
    assert json.loads(asg.read_text())["total_bytes"] == best["total_bytes"], best


def test_ray_run_in_a_folder_holding_an_in_process_journal(tiny_fixed, tmp_path, reference):
    """An in-process journal (`train/partial.pt`, e.g. a stopped run without --ray) made
    `train --ray` in the same folder skip the Fisher prior, as if resuming, though the Ray run
    had no checkpoint: its worker then died with StopIteration. The prior is now skipped only
    for a Ray checkpoint, and the Ray run starts from it as a fresh in-process run does."""
    out = tmp_path / "both"
    rc, stdout, err = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                               *DATA, *MENU, *TRAIN, "--stop_after", "1"])
    assert rc == 0, (stdout + err)[-4000:]
    assert (out / "train" / "partial.pt").is_file()
    asg, _, _ = train(tiny_fixed, out, "--ray", "--num_workers", "0")
    assert types(asg) == types(reference)
