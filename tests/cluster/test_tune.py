"""cluster.tune: a 4-trial sweep on the tiny Llama completes and reports the best trial; a
sweep stopped by Ctrl-C continues where it stopped when called again."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import threading

import pytest

ray = pytest.importorskip("ray")

from ray_session import local_ray  # noqa: E402
from cluster.toy import KillOnce, TinyLlamaFactory  # noqa: E402
from cluster.train import WorkerInfo  # noqa: E402
from cluster.tune import (FAIL_OBJECTIVE, OBJECTIVE, SweepInterrupted,  # noqa: E402
                          evaluate_assignment, run_sweep)
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


def test_eval_kl_feeds_the_blocks_to_the_device_of_the_students_embedding():
    """A GPU trial keeps its token blocks on the CPU (its training batches are moved per step),
    so its evaluation moves each batch to the student's input-embedding device (the H100 run
    that found it: benchmarks/results/gpu_cli/README.md, run4). No second device here: the
    device is read off a model built on the meta device, and a module without embeddings."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cluster.tune import _input_device, eval_kl
    job = TinyLlamaFactory()(WorkerInfo())
    assert _input_device(job.student) == torch.device("cpu")
    with torch.device("meta"):
        m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         vocab_size=64))
    assert _input_device(m).type == "meta"
    assert _input_device(torch.nn.Linear(2, 2, device="meta")).type == "meta"
    kl = eval_kl(job.student, job.teacher, job.eval_blocks)
    assert 0 <= kl < 10


def test_evaluate_assignment_bakes_as_the_export_does():
    """``bake_options`` reach the bake the objective scores: with the run's fill costs the
    bytes the gates leave under the budget are spent (what ``voodoo tune --export`` and
    ``voodoo train`` write), without them they are not; the tolerance comes from them too."""
    import torch
    job = TinyLlamaFactory()(WorkerInfo())
    gates = gate_state(job.student)
    low = {n: torch.tensor([0.0] * (len(g) - 1) + [10.0]) for n, g in gates.items()}
    plain = evaluate_assignment(job, low, 67020, bake_options={"tolerance": 0.2})
    costs = {n: [float(k) for k in range(len(g))] for n, g in gates.items()}
    filled = evaluate_assignment(job, low, 67020, bake_options={
        "tolerance": 0.2, "fill_costs": costs, "fill_margin": 0})
    assert plain["ok"] and filled["ok"]
    assert plain["total_bytes"] < 67020 * 0.9 < filled["total_bytes"] <= 67020, (plain, filled)
    assert filled["assignment"] != plain["assignment"]


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


def _final_trials(sweep_dir) -> dict[str, float]:
    """trial folder -> objective of the trials whose final (baked) result is on storage."""
    out = {}
    for res in sweep_dir.glob("*/result.json"):
        for line in res.read_text().splitlines():
            row = json.loads(line)
            if row.get("final"):
                out[res.parent.name] = row[OBJECTIVE]
    return out


def test_interrupted_sweep_resumes_without_rerunning_finished_trials(tmp_path, ray_up, capsys):
    """Ctrl-C after the first trial finished; the same call continues the sweep (finished
    trials kept, not trained again); once more, the finished sweep is only reported."""
    calls = tmp_path / "calls"
    f = TinyLlamaFactory(calls_log=str(calls))
    cfg = dataclasses.replace(CFG, max_steps=4, partial_save_interval=2)
    kw = dict(num_samples=3, name="resume", storage_path=tmp_path / "ray",
              shared=f.make_shared(), cpus_per_trial=0.5, max_concurrent_trials=1, seed=0)
    sweep = tmp_path / "ray" / "resume"
    stop = threading.Event()

    def ctrl_c_after_first_final():
        while not stop.wait(0.2):
            if _final_trials(sweep):
                os.kill(os.getpid(), signal.SIGINT)
                return

    t = threading.Thread(target=ctrl_c_after_first_final, daemon=True)
    t.start()
    try:
        with pytest.raises(SweepInterrupted) as ei:
            run_sweep(f, cfg, **kw)
    finally:
        stop.set()
        t.join()
    first = _final_trials(sweep)
    started_first = len(calls.read_text().splitlines())
    assert 1 <= ei.value.finished < 3 and ei.value.total == 3 and first
    assert "run the same command again to continue" in capsys.readouterr().err

    best = run_sweep(f, cfg, **kw)
    out = capsys.readouterr().out
    assert best["resumed"] and f"{ei.value.finished} of 3 trials finished and kept" in out
    assert len(best["results"]) == 3 and all(r["finished"] for r in best["results"])
    by_id = {r["trial_id"]: r for r in best["results"]}
    for trial_dir, obj in first.items():  # the finished trials' results, reused as they were
        (tid,) = [i for i in by_id if i in trial_dir]
        assert by_id[tid][OBJECTIVE] == obj
    # trainings started by the resumed sweep: only the trials not finished before Ctrl-C
    assert len(calls.read_text().splitlines()) - started_first == 3 - ei.value.finished

    again = run_sweep(f, cfg, **kw)
    out = capsys.readouterr().out
    assert "is finished (3 of 3 trials)" in out and "without running anything" in out
    assert len(calls.read_text().splitlines()) - started_first == 3 - ei.value.finished
    assert again["trial_id"] == best["trial_id"] and again["objective"] == best["objective"]
    with pytest.raises(ValueError, match="other settings.*num_samples"):
        run_sweep(f, cfg, **{**kw, "num_samples": 4})
    # the same check, before any expensive stage (voodoo tune calls it before the Fisher prior)
    from cluster.tune import check_sweep_early
    ranges = ((1.0, 1000.0), (0.001, 0.02))
    check_sweep_early(tmp_path / "ray", "resume", cfg, 3, *ranges, None, 0)   # the same: passes
    check_sweep_early(tmp_path / "ray", "no-such-sweep", cfg, 5, *ranges, None, 0)
    with pytest.raises(ValueError, match=r"other settings.*train_config.max_steps \(\d+ there, "
                                         r"5 now\)"):
        check_sweep_early(tmp_path / "ray", "resume", dataclasses.replace(cfg, max_steps=5), 3,
                          *ranges, None, 0)


SWEEP_SCRIPT = """
import sys
sys.path[:0] = [{root!r}]
from cluster.toy import TinyLlamaFactory
from cluster.tune import run_sweep
from voodoo.train import TrainConfig
f = TinyLlamaFactory(calls_log={calls!r})
cfg = TrainConfig(compression_ratio=0.7, max_steps=4, seq_len=16, batch_size=2, lr=0.1,
                  partial_save_interval=2, t_end=0.2, size_weight=10.0, seed=3)
best = run_sweep(f, cfg, num_samples=3, name="killed", storage_path={storage!r},
                 shared=f.make_shared(), cpus_per_trial=0.5, max_concurrent_trials=1, seed=0)
print("SWEEP_DONE", best["trial_id"], flush=True)
"""


def test_sigkilled_sweep_leaves_no_ray_behind_and_resumes(tmp_path):
    """`voodoo tune`'s driver SIGKILLed after a trial finished: the local Ray it started is
    gone within seconds (cluster.session's watchdog), and the same command continues the
    sweep without training the trials that Tune had saved as finished."""
    import subprocess
    import sys
    import time

    import psutil
    from cluster.session import _is_ray
    from cluster.tune import _progress, _trial

    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    calls, storage = tmp_path / "calls", tmp_path / "ray"
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP_SCRIPT.format(root=root, calls=str(calls), storage=str(storage)))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    p = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 600   # generous: CI's machine may be loaded
        while not _final_trials(storage / "killed") and time.time() < deadline:
            assert p.poll() is None, p.stdout.read()[-3000:]
            time.sleep(0.3)
        assert _final_trials(storage / "killed"), "no trial finished in 600 s"
        time.sleep(3)  # past TUNE_GLOBAL_CHECKPOINT_S (2 s): Tune saved the finished trial
        ray_procs = [c for c in psutil.Process(p.pid).children(recursive=True) if _is_ray(c)]
        assert any(c.name() == "raylet" for c in ray_procs)
        p.kill()
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
    gone_by = time.time() + 60
    while time.time() < gone_by:
        alive = [c for c in ray_procs if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            break
        time.sleep(0.5)
    assert not alive, f"Ray processes alive 60 s after SIGKILL: {[c.name() for c in alive]}"

    from ray import tune
    done, total = _progress(tune.Tuner.restore(str(storage / "killed"), _trial).get_results(), 3)
    assert 1 <= done < 3 and total == 3
    before = len(calls.read_text().splitlines())
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=900).stdout
    assert f"resuming sweep killed ({storage / 'killed'}): {done} of 3 trials finished" in out
    assert "SWEEP_DONE" in out
    assert len(calls.read_text().splitlines()) - before == 3 - done


def test_a_sweep_whose_trials_fail_says_why(tmp_path, ray_up, capsys):
    """A trial that raises is one "error" row in the table, and the sweep's error quotes the
    trials' reason (once only Ray's "Should not have reached here" was shown: `voodoo tune`
    in a folder holding a journal started Fisher-init trials without the prior's logits).
    Here every trial is handed starting logits of the wrong length."""
    import torch
    f = TinyLlamaFactory()
    names = list(gate_state(f(WorkerInfo()).student))
    bad = {n: torch.zeros(99) for n in names}
    with pytest.raises(RuntimeError) as ei:
        run_sweep(f, dataclasses.replace(CFG, max_steps=2), num_samples=2, name="failing",
                  storage_path=tmp_path, shared=f.make_shared(), cpus_per_trial=0.5,
                  max_concurrent_trials=2, seed=0, init_logits=bad)
    out = capsys.readouterr().out
    msg = str(ei.value)
    assert "no trial of sweep failing" in msg and "2 trials failed" in msg, msg
    assert "99" in msg, msg   # the trials' own reason, not Ray's
    assert out.count("error") >= 2, out


def test_a_killed_trial_is_retried_from_its_checkpoint_by_the_same_call(tmp_path, ray_up,
                                                                        capsys):
    """A trial whose process dies (here ``os._exit(1)`` after step 3, its checkpoint at step 2
    on storage) fails the sweep; the same call again resumes that trial from step 2, and the
    sweep finishes and reports. Before, Tune restored the failed trial as done: every later
    call said "is finished ... without running anything" and "no trial finished" (a new
    user's ``voodoo tune`` with a trial killed could never be resumed or exported)."""
    f = TinyLlamaFactory()
    cfg = dataclasses.replace(CFG, max_steps=4, partial_save_interval=2)
    steps = tmp_path / "steps"
    hook = KillOnce(marker=str(tmp_path / "killed"), at_step=3, steps_log=str(steps))
    kw = dict(num_samples=1, name="dies", storage_path=tmp_path / "ray", shared=f.make_shared(),
              cpus_per_trial=0.5, max_concurrent_trials=1, seed=0, step_hook=hook)
    with pytest.raises(RuntimeError) as ei:
        run_sweep(f, cfg, **kw)
    assert "1 trial failed" in str(ei.value), str(ei.value)
    assert "the same command again retries the failed trials" in str(ei.value)
    assert (tmp_path / "killed").is_file()
    assert steps.read_text().split() == ["1", "2", "3"]
    capsys.readouterr()
    best = run_sweep(f, cfg, **kw)
    out = capsys.readouterr().out
    assert "0 of 1 trials finished and kept, 1 failed to retry from its last checkpoint" in out
    assert best["resumed"] and len(best["results"]) == 1 and best["results"][0]["finished"]
    assert math.isfinite(best["kl"])
    assert steps.read_text().split() == ["1", "2", "3", "3", "4"]  # resumed after step 2
