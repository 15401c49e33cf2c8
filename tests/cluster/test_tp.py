"""cluster.tp: tensor parallel over gloo workers gives the 1-worker student's logits, gates
and baked assignment; refuses splits it cannot do, saying why; a dead rank ends the run in
one line and the same call resumes from the newest complete checkpoint."""

from __future__ import annotations

import dataclasses

import pytest
import torch

ray = pytest.importorskip("ray")

from ray_session import cpu_hog, local_ray  # noqa: E402
from cluster.toy import DumpLogits, KillOnce, TinyLlamaFactory  # noqa: E402
from cluster.tp import TensorParallelError, check_tp, tp_plan  # noqa: E402
from cluster.train import (TrainingFailed, WorkerInfo, checkpoint_complete,  # noqa: E402
                           run_training)
from cluster.tune import bake_student  # noqa: E402
from voodoo.train import TrainConfig  # noqa: E402

# 8 heads / 4 KV heads, hidden 128, intermediate 256: row shards of 64 (TP 2) or 32 (TP 4)
# columns, multiples of the toy menu's block size 32.
FACTORY = TinyLlamaFactory(hidden=128, intermediate=256, heads=8, kv_heads=4)
CFG = TrainConfig(compression_ratio=0.7, max_steps=6, seq_len=16, batch_size=2, lr=0.1,
                  partial_save_interval=3, t_end=0.2, size_weight=10.0, seed=3)
IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(9))


def test_refuses_without_tp_info_or_bad_split():
    job = TinyLlamaFactory()(WorkerInfo())
    with pytest.raises(TensorParallelError, match="TP policy"):
        tp_plan([dataclasses.replace(s, tp=None) for s in job.specs])
    with pytest.raises(TensorParallelError, match="row split"):
        tp_plan([s for s in job.specs if s.tp != "row"])
    with pytest.raises(TensorParallelError, match="heads"):
        check_tp(job.student, job.specs, 4, 4, 2)  # 2 KV heads do not split 4 ways
    job = TinyLlamaFactory(heads=4, kv_heads=4)(WorkerInfo())
    with pytest.raises(TensorParallelError, match="block size 32"):
        check_tp(job.student, job.specs, 4, 4, 4)  # o_proj: 64 / 4 = 16 columns per shard
    plan = check_tp(job.student, job.specs, 2, 4, 4)
    assert plan["model.layers.0.self_attn"] == {"q_proj": "column", "k_proj": "column",
                                                "v_proj": "column", "o_proj": "row"}
    assert plan["model.layers.1.mlp"]["down_proj"] == "row"


@pytest.fixture(scope="module")
def ray_up():
    with local_ray():
        yield


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    d = tmp_path_factory.mktemp("one")
    res = run_training(FACTORY, CFG, num_workers=0, run_name="one", storage_path=d,
                       step_hook=DumpLogits(str(d / "logits"), CFG.max_steps, IDS))
    return res, torch.load(d / "logits" / "rank-0.pt")


def _assignment(gates, budget):
    job = FACTORY(WorkerInfo())
    return {n: t["type"] for n, t in bake_student(job.student, gates, budget)["tensors"].items()}


@pytest.mark.ray
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_one_worker(tp, tmp_path, one_worker, ray_up):
    ref, ref_logits = one_worker
    res = run_training(FACTORY, CFG, num_workers=tp, tensor_parallel=tp, run_name=f"tp{tp}",
                       storage_path=tmp_path, resources_per_worker={"CPU": 2 / tp / 2},
                       step_hook=DumpLogits(str(tmp_path / "logits"), CFG.max_steps, IDS))
    assert res.finished and res.budget_bytes == ref.budget_bytes  # budget from full tensors
    for r in range(tp):  # every rank holds the full logits, equal to 1 worker's
        got = torch.load(tmp_path / "logits" / f"rank-{r}.pt")
        torch.testing.assert_close(got, ref_logits, atol=1e-4, rtol=1e-4)
    for k in ref.gates:
        torch.testing.assert_close(res.gates[k], ref.gates[k], atol=1e-4, rtol=0, msg=k)
    assert _assignment(res.gates, res.budget_bytes) == _assignment(ref.gates, ref.budget_bytes)
    for a, b in zip(res.history, ref.history):
        assert a["size_ratio"] == pytest.approx(b["size_ratio"], rel=1e-5)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-6)


@pytest.mark.ray
def test_dead_tp_worker_ends_in_one_line_and_the_same_call_resumes(tmp_path, one_worker,
                                                                     ray_up):
    """TP=2 on a loaded machine, rank 1 killed right after the step-3 checkpoint, no restart
    allowed: one line naming the death, the checkpoint kept and the command that resumes;
    that call then continues from the newest complete checkpoint (all ranks' shards)."""
    ref, _ = one_worker
    marker, log, runs = tmp_path / "killed", tmp_path / "steps", tmp_path / "runs"
    hook = KillOnce(str(marker), at_step=3, rank=1, steps_log=str(log),
                    run_dir=str(runs / "tpkill"))
    kw = dict(num_workers=2, tensor_parallel=2, run_name="tpkill", storage_path=runs,
              resources_per_worker={"CPU": 0.5}, step_hook=hook, max_failures=0,
              resume_command="voodoo tp --nproc 2 -- --output_dir out")
    with cpu_hog(nice=10, until=marker):
        with pytest.raises(TrainingFailed) as ei:
            run_training(FACTORY, CFG, **kw)
        newest = int(marker.read_text().splitlines()[1])
        msg = str(ei.value)
        print(msg)
        assert newest == 3 and ei.value.step == newest and "\n" not in msg
        assert "gate training run tpkill stopped: worker rank" in msg and "died" in msg
        assert f"kept checkpoint {runs / 'tpkill' / 'checkpoint_000003'} (step 3 of 6)" in msg
        assert "no restart allowed (--max_failures 0)" in msg
        assert "resume with: voodoo tp --nproc 2 -- --output_dir out" in msg
    man = checkpoint_complete(ei.value.checkpoint)
    assert man["world_size"] == 2 and {"rank-0000.pt", "rank-0001.pt"} <= set(man["files"])
    res = run_training(FACTORY, CFG, **kw)
    assert [int(s) for s in log.read_text().split()] == [1, 2, 3, *range(newest + 1, 7)]
    assert res.finished and res.step == 6
    for k in ref.gates:
        torch.testing.assert_close(res.gates[k], ref.gates[k], atol=1e-4, rtol=0, msg=k)
