"""cluster.tune: a 4-trial sweep on the tiny Llama completes and reports the best trial."""

from __future__ import annotations

import math

import pytest

ray = pytest.importorskip("ray")

from ray_session import local_ray  # noqa: E402
from cluster.toy import TinyLlamaFactory  # noqa: E402
from cluster.train import WorkerInfo  # noqa: E402
from cluster.tune import FAIL_OBJECTIVE, evaluate_assignment, run_sweep  # noqa: E402
from voodoo.gates import gate_state  # noqa: E402
from voodoo.train import TrainConfig  # noqa: E402

pytestmark = pytest.mark.ray

CFG = TrainConfig(compression_ratio=0.7, max_steps=6, seq_len=16, batch_size=2, lr=0.1,
                  partial_save_interval=3, t_end=0.2, size_weight=10.0, seed=3)


@pytest.fixture(scope="module")
def ray_up():
    with local_ray():
        yield


def test_evaluate_assignment_counts_a_missed_budget_as_failure():
    job = TinyLlamaFactory()(WorkerInfo())
    gates = gate_state(job.student)
    ok = evaluate_assignment(job, gates, 67020)
    assert ok["ok"] and 0 < ok["kl"] < 1 and ok["total_bytes"] <= 67020 * 1.005
    bad = evaluate_assignment(job, gates, 1000)  # below the smallest types: unreachable
    assert not bad["ok"] and bad["objective"] == FAIL_OBJECTIVE


def test_sweep_of_four_trials(tmp_path, ray_up, capsys):
    f = TinyLlamaFactory()
    best = run_sweep(f, CFG, num_samples=4, name="sweep", storage_path=tmp_path,
                     shared=f.make_shared(), lr=(0.01, 0.3), cpus_per_trial=0.5,
                     max_concurrent_trials=4, seed=0)
    out = capsys.readouterr().out
    assert len(best["results"]) == 4
    assert set(best["config"]) == {"size_weight", "size_tolerance", "lr"}
    assert 1.0 <= best["config"]["size_weight"] <= 1000.0
    finished = [r for r in best["results"] if r["finished"] and r["ok"]]
    assert finished and best["objective"] == min(r["objective"] for r in finished)
    assert math.isfinite(best["kl"]) and best["total_bytes"] <= best["budget_bytes"] * 1.005
    assert "best: trial" in out and best["trial_id"] in out
