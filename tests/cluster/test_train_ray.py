"""cluster.train: gate training on Ray Train V2 -- in-process runs and their resume, the
layer-wise device map, a worker killed mid-run on a loaded machine resuming from the newest
complete checkpoint on storage, incomplete checkpoints skipped, and errors that no retry can fix
raised once. Tiny random Llama (cluster.toy), a few steps."""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

from ray_session import cpu_hog, local_ray  # noqa: E402
from cluster.toy import KillOnce, RaiseAt, TinyLlamaFactory  # noqa: E402
from cluster.train import (TrainingFailed, checkpoint_complete, dispatch_layers,  # noqa: E402
                           newest_checkpoint, parse_device_map, run_training)
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


def test_gradient_checkpointing_gives_the_same_gates(tmp_path, reference, monkeypatch):
    """``--gradient_checkpointing`` in Ray Train's loop: the decoder layers really recompute
    (transformers' checkpointing is on, through :func:`voodoo.train.enable_checkpointing` as in
    the single-process trainer) and the gates come out as without it (fp32, same seed)."""
    import transformers
    calls = []
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        orig = getattr(transformers.PreTrainedModel, name, None)
        if orig is not None:
            def spy(self, *a, _orig=orig, **kw):
                calls.append(kw)
                return _orig(self, *a, **kw)
            monkeypatch.setattr(transformers.PreTrainedModel, name, spy)
    out = run_training(TinyLlamaFactory(), _cfg(gradient_checkpointing=True), num_workers=0,
                       run_name="ckpt", storage_path=tmp_path)
    assert out.finished and out.step == 6
    assert calls, "transformers' checkpointing was not turned on"
    _same_gates(out.gates, reference.gates, atol=1e-5)


def test_cli_refuses_another_runs_checkpoint_before_any_work(tmp_path):
    """`voodoo train --ray` with other settings than the Ray run it would resume: refused by
    the driver (the CLI's early check, before data, imatrix, candidates, Fisher and Ray's
    start), with what differs and the way out; the same settings pass."""
    from types import SimpleNamespace

    from voodoo.cli import _check_ray_checkpoint_early
    first = run_training(TinyLlamaFactory(), _cfg(), num_workers=0, run_name="r",
                         storage_path=tmp_path, stop_after=2)
    assert not first.finished and newest_checkpoint(tmp_path / "r") is not None

    def run(cfg, budget=first.budget_bytes):
        return SimpleNamespace(a=SimpleNamespace(run_name="r", storage_path=str(tmp_path)),
                               out=tmp_path / "out", budget=budget, train_config=lambda: cfg)
    _check_ray_checkpoint_early(run(_cfg()))                 # the same run: resumes
    with pytest.raises(ValueError, match=r"different run \(differs in \['lr \(0\.\d+ there, "
                                         r"0\.2 now\)'\]\).*--run_name"):
        _check_ray_checkpoint_early(run(_cfg(lr=0.2)))
    with pytest.raises(ValueError, match="budget_bytes"):
        _check_ray_checkpoint_early(run(_cfg(), first.budget_bytes + 1000))
    _check_ray_checkpoint_early(SimpleNamespace(               # another name: nothing to resume
        a=SimpleNamespace(run_name="other", storage_path=str(tmp_path)), out=tmp_path / "out",
        budget=1, train_config=lambda: _cfg(lr=0.2)))


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


def _newest_at_kill(marker) -> int:
    """The newest complete checkpoint's step that KillOnce read from storage when it killed."""
    return int(marker.read_text().splitlines()[1])


def test_killed_worker_resumes_from_newest_complete_checkpoint(tmp_path, reference, ray_up):
    """Killed right after the step-4 checkpoint was written, on a loaded machine: Ray Train's
    controller has usually not taken in that report yet (it then offers the step-2 one), and
    the run must still go on from the newest complete checkpoint on storage."""
    marker, log, runs = tmp_path / "killed", tmp_path / "steps", tmp_path / "runs"
    hook = KillOnce(str(marker), at_step=4, steps_log=str(log), run_dir=str(runs / "kill"))
    with cpu_hog(nice=10, until=marker):
        res = run_training(TinyLlamaFactory(), _cfg(), num_workers=1, run_name="kill",
                           storage_path=runs, max_failures=1, step_hook=hook,
                           resources_per_worker={"CPU": 0.5})
    newest = _newest_at_kill(marker)
    assert newest == 4  # the step-4 checkpoint was complete on storage before the kill
    # steps 1..4, killed after 4, resumed after the newest complete checkpoint: no step redone
    assert [int(s) for s in log.read_text().split()] == [1, 2, 3, 4, *range(newest + 1, 7)]
    assert res.finished and res.step == 6 and len(res.history) == 6
    _same_gates(res.gates, reference.gates, atol=1e-6)
    # every checkpoint left is complete, num_to_keep (2) of them, the last one the result
    left = sorted(p.name for p in (runs / "kill").glob("checkpoint_0*"))
    assert left == ["checkpoint_000004", "checkpoint_000006"]
    assert all(checkpoint_complete(runs / "kill" / n) for n in left)
    assert res.checkpoint_path == str(runs / "kill" / "checkpoint_000006")


def test_incomplete_checkpoint_is_not_resumed(tmp_path, reference):
    """A checkpoint folder whose files are not all there (or changed) is skipped."""
    first = run_training(TinyLlamaFactory(), _cfg(), num_workers=0, run_name="r",
                         storage_path=tmp_path, stop_after=4)
    run = tmp_path / "r"
    assert newest_checkpoint(run) == (run / "checkpoint_000004", 4)
    man = checkpoint_complete(run / "checkpoint_000004")
    assert man["step"] == 4 and man["world_size"] == 1
    assert set(man["files"]) == {"state.pt", "meta.json", "rank-0000.pt"}
    (run / "checkpoint_000004" / "rank-0000.pt").write_bytes(b"truncated")
    assert checkpoint_complete(run / "checkpoint_000004") is None
    assert newest_checkpoint(run) == (run / "checkpoint_000002", 2)
    (run / "checkpoint_000002" / "complete.json").unlink()  # died before the manifest
    assert newest_checkpoint(run) is None
    assert first.step == 4


def test_failure_beyond_max_failures_raises(tmp_path, ray_up):
    hook = KillOnce(str(tmp_path / "killed"), at_step=1)
    with pytest.raises(TrainingFailed, match="died"):
        run_training(TinyLlamaFactory(), _cfg(max_steps=2), num_workers=1, run_name="fail",
                     storage_path=tmp_path / "runs", max_failures=0, step_hook=hook,
                     resources_per_worker={"CPU": 0.5})


def test_terminal_error_is_not_retried(tmp_path, ray_up):
    """A ValueError from the training function (bad input, non-finite weights) can never
    succeed: raised once, no restart despite max_failures=2, the worker's own error."""
    log = tmp_path / "raised"
    with pytest.raises(ValueError, match="non-finite weights in blk.0.ffn_down.weight"):
        run_training(TinyLlamaFactory(), _cfg(max_steps=3), num_workers=1, run_name="bad",
                     storage_path=tmp_path / "runs", max_failures=2,
                     step_hook=RaiseAt(str(log), at_step=1), resources_per_worker={"CPU": 0.5})
    assert log.read_text().count("raised") == 1  # Ray's default would have run it 3 times
    # a checkpoint of another run is the same kind of error: refused at once, not retried
    run_training(TinyLlamaFactory(), _cfg(max_steps=2), num_workers=0, run_name="other",
                 storage_path=tmp_path / "runs")
    with pytest.raises(ValueError, match="different run"):
        run_training(TinyLlamaFactory(), _cfg(max_steps=2, lr=0.2), num_workers=1,
                     run_name="other", storage_path=tmp_path / "runs", max_failures=2,
                     resources_per_worker={"CPU": 0.5})


def test_command_line_names_the_command_to_rerun():
    from cluster.train import command_line
    assert command_line(["/usr/local/bin/voodoo", "tp", "--nproc", "2", "--", "--model",
                         "my model"]) == "voodoo tp --nproc 2 -- --model 'my model'"


def test_rerun_after_more_checkpoints_than_kept(tmp_path, reference, ray_up):
    """A run that wrote more checkpoints than it keeps (6 reports, 2 kept) is run again with
    the same name: Ray Train's record still names the pruned folders, which Ray 2.60 refuses
    to start from; the record is set aside and the rerun resumes from storage (it used to end
    in CheckpointManagerInitializationError)."""
    from cluster.train import RAY_SNAPSHOT
    runs = tmp_path / "runs"
    cfg = _cfg(partial_save_interval=1)
    first = run_training(TinyLlamaFactory(), cfg, num_workers=1, run_name="again",
                         storage_path=runs, resources_per_worker={"CPU": 0.5})
    assert first.finished
    snap = (runs / "again" / RAY_SNAPSHOT).read_text()
    assert "checkpoint_000001" in snap and not (runs / "again" / "checkpoint_000001").exists()
    again = run_training(TinyLlamaFactory(), cfg, num_workers=1, run_name="again",
                         storage_path=runs, resources_per_worker={"CPU": 0.5})
    assert again.finished and again.step == 6
    _same_gates(again.gates, first.gates)
    assert (runs / "again" / (RAY_SNAPSHOT + ".pruned")).is_file()


class _CountingBackend:
    """run_loop's backend for one rank with no Ray: records the step of every report."""

    def __init__(self):
        self.steps = []

    def world(self):
        return 0, 1

    def get_checkpoint(self):
        return None

    def report(self, metrics, checkpoint_dir=None, name=None):
        self.steps.append((int(metrics["step"]), checkpoint_dir is not None))


@pytest.mark.parametrize("poll, expected", [
    ("0", [(1, False), (2, False), (3, False), (4, True), (5, False), (6, True)]),
    # a report interval longer than any step: past step 2, reports only with checkpoints
    ("1000", [(1, False), (4, True), (6, True)]),
])
def test_auto_report_interval_reports_less_often_than_ray_takes_reports(
        tmp_path, monkeypatch, poll, expected):
    """``report_every="auto"`` (run_training's default): after the second step a worker reports
    only every k steps, k the steps that take Ray Train's report interval
    (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S), since a report made sooner blocks the worker until the
    controller takes the last one in; checkpoints and the last step still report."""
    from cluster.train import run_loop
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", poll)
    b = _CountingBackend()
    out = run_loop({"factory": TinyLlamaFactory(), "cfg": _cfg().to_dict(),
                    "local_dir": str(tmp_path), "checkpoint_every": 4,
                    "report_every": "auto"}, b)
    assert out["step"] == 6
    assert b.steps == expected


class _Died(BaseException):
    """The worker's process ending (a lost node) inside Ray's report."""


class _CopyingBackend(_CountingBackend):
    """run_loop's backend for one rank, storage as Ray Train's report leaves it: the checkpoint
    folder copied to ``storage/name``; ``die_at``: the worker dies right after that copy, before
    the report returns (before the loop's own manifest write), as a lost node did."""

    def __init__(self, storage, die_at=None):
        super().__init__()
        self.storage, self.die_at = storage, die_at

    def report(self, metrics, checkpoint_dir=None, name=None):
        import shutil
        super().report(metrics, checkpoint_dir, name)
        if checkpoint_dir is not None:
            shutil.copytree(checkpoint_dir, self.storage / name, dirs_exist_ok=True)
            if int(metrics["step"]) == self.die_at:
                raise _Died


def test_checkpoint_copied_before_the_worker_died_is_resumed(tmp_path, reference, capsys):
    """A node lost after Ray copied the step-4 checkpoint to storage and before the loop wrote
    its manifest (a tester's run: checkpoint_000010 on storage, resumed from 000005, five
    steps redone): the manifest travels with the files, so the copy is known complete and
    resumed; the result equals the uninterrupted run's."""
    from cluster.train import run_loop
    storage = tmp_path / "run"
    storage.mkdir()
    cfg = {"factory": TinyLlamaFactory(), "cfg": _cfg().to_dict(), "run_dir": str(storage)}
    with pytest.raises(_Died):
        run_loop(cfg, _CopyingBackend(storage, die_at=4))
    assert newest_checkpoint(storage) == (storage / "checkpoint_000004", 4)
    b = _CopyingBackend(storage)
    out = run_loop(cfg, b)
    assert f"resuming from {storage / 'checkpoint_000004'} (step 4 of 6)" in \
        capsys.readouterr().err
    assert out["step"] == 6 and [s for s, _ in b.steps] == [5, 6]
    _same_gates(out["gates"], reference.gates, atol=1e-6)
    # a copy missing a file the manifest lists is not complete, and not resumed
    (storage / "checkpoint_000006" / "rank-0000.pt").unlink()
    assert newest_checkpoint(storage) == (storage / "checkpoint_000004", 4)


def test_ray_failing_under_the_run_is_one_line_with_the_way_to_resume(tmp_path, ray_up,
                                                                        monkeypatch):
    """Ray itself failing under fit() (the controller's node or the head crashed: an
    ActorDiedError, not a TrainingFailedError) ended in Ray's traceback; now it is the same
    TrainingFailed line as dead workers give: what happened, the checkpoint kept, the command."""
    import ray.exceptions
    from ray.train.torch import TorchTrainer

    def crash(self):
        raise ray.exceptions.ActorDiedError()
    monkeypatch.setattr(TorchTrainer, "fit", crash)
    with pytest.raises(TrainingFailed) as e:
        run_training(TinyLlamaFactory(), _cfg(max_steps=2), num_workers=1, run_name="crash",
                     storage_path=tmp_path / "runs", resources_per_worker={"CPU": 0.5})
    msg = str(e.value)
    assert "gate training run crash stopped: Ray Train failed (ActorDiedError" in msg, msg
    assert "no checkpoint was complete yet" in msg and "resume with: " in msg, msg
