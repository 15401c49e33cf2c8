"""cluster.train: gate training on Ray Train V2 -- in-process runs and their resume, the
layer-wise device map, and a worker killed mid-run resuming from its last checkpoint.
Tiny random Llama (cluster.toy), a few steps."""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

from ray_session import local_ray  # noqa: E402
from cluster.toy import KillOnce, TinyLlamaFactory  # noqa: E402
from cluster.train import dispatch_layers, parse_device_map, run_training  # noqa: E402
from voodoo.train import TrainConfig  # noqa: E402

pytestmark = pytest.mark.ray


def _cfg(**kw):
    base = dict(compression_ratio=0.7, max_steps=6, seq_len=16, batch_size=2, lr=0.1,
                partial_save_interval=2, t_end=0.2, size_weight=10.0, seed=3)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted in-process run."""
    return run_training(TinyLlamaFactory(), _cfg(), num_workers=0, run_name="ref",
                        storage_path=tmp_path_factory.mktemp("ref"))


def _same_gates(a, b, atol=0.0):
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


def test_in_process_run_resumes_from_checkpoint(tmp_path, reference):
    assert reference.finished and reference.step == 6 and len(reference.history) == 6
    first = run_training(TinyLlamaFactory(), _cfg(), num_workers=0, run_name="r",
                         storage_path=tmp_path, stop_after=3)
    assert (first.step, first.finished) == (3, False)
    assert first.checkpoint_path.endswith("checkpoint_000003")
    again = run_training(TinyLlamaFactory(), _cfg(), num_workers=0, run_name="r",
                         storage_path=tmp_path)
    assert again.finished and again.step == 6 and len(again.history) == 6
    assert again.history[:3] == first.history
    _same_gates(again.gates, reference.gates)  # resume == uninterrupted, bit for bit
    done = run_training(TinyLlamaFactory(), _cfg(), num_workers=0, run_name="r",
                        storage_path=tmp_path)  # a finished run stays finished
    assert done.step == 6
    _same_gates(done.gates, reference.gates)
    with pytest.raises(ValueError, match="different run"):
        run_training(TinyLlamaFactory(), _cfg(lr=0.2), num_workers=0, run_name="r",
                     storage_path=tmp_path)


def test_device_map_cpu_cpu(tmp_path, reference):
    assert parse_device_map("cpu, cpu") == ["cpu", "cpu"]
    with pytest.raises(ValueError):
        parse_device_map("cpu,,cpu")
    job = TinyLlamaFactory()(__import__("cluster.train").train.WorkerInfo())
    ids = job.train_blocks[:2]
    want = job.student(input_ids=ids).logits
    assert dispatch_layers(job.student, ["cpu", "cpu"]) == {0: "cpu", 1: "cpu"}
    torch.testing.assert_close(job.student(input_ids=ids).logits, want, atol=0, rtol=0)
    res = run_training(TinyLlamaFactory(), _cfg(), num_workers=0, run_name="dm",
                       storage_path=tmp_path, device_map="cpu,cpu")
    _same_gates(res.gates, reference.gates)


@pytest.fixture(scope="module")
def ray_up():
    with local_ray():
        yield


def test_killed_worker_resumes_from_checkpoint(tmp_path, reference, ray_up):
    marker, log = tmp_path / "killed", tmp_path / "steps"
    hook = KillOnce(str(marker), at_step=5, steps_log=str(log))
    res = run_training(TinyLlamaFactory(), _cfg(), num_workers=1, run_name="kill",
                       storage_path=tmp_path / "runs", max_failures=1, step_hook=hook,
                       resources_per_worker={"CPU": 0.5})
    assert marker.exists()
    # Steps 1..5, killed after 5 (checkpoint at 4), resumed: 5 and 6 again.
    assert [int(s) for s in log.read_text().split()] == [1, 2, 3, 4, 5, 5, 6]
    assert res.finished and res.step == 6 and len(res.history) == 6
    _same_gates(res.gates, reference.gates, atol=1e-6)


def test_failure_beyond_max_failures_raises(tmp_path, ray_up):
    from ray.train import TrainingFailedError
    hook = KillOnce(str(tmp_path / "killed"), at_step=1)
    with pytest.raises(TrainingFailedError):
        run_training(TinyLlamaFactory(), _cfg(max_steps=2), num_workers=1, run_name="fail",
                     storage_path=tmp_path / "runs", max_failures=0, step_hook=hook,
                     resources_per_worker={"CPU": 0.5})
