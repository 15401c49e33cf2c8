"""A Ray Tune sweep over the size penalty's weight and dead zone (and optionally the lr).

Each trial is a Tune function trainable that runs the same loop as Ray Train's workers
(:func:`cluster.train.run_loop`) in the trial's process, with a :class:`TuneBackend`: it reports
every ``report_every`` steps through ``ray.tune.report`` (with a checkpoint every
``checkpoint_every`` steps, so a restarted trial resumes) -- the intermediate ``objective`` is
the training proxy ``kl + penalty`` on the training batch (soft gates) -- and ASHA
(:class:`BakingASHA`, which never stops a trial on its last training step) stops weak trials
on it. A trial that finishes **bakes** its gates
(:func:`voodoo.bake.bake`) and reports the real objective once more:

    objective = KL(teacher || student with one-hot gates of the baked assignment)
                (mean per token over the job's eval blocks, nats)

or :data:`FAIL_OBJECTIVE` when the baked size misses the budget (above
``budget * (1 + tolerance)``, or bake cannot reach it). Why a function trainable and not a
``TorchTrainer`` per trial (RAY.md's Train-V2 recipe): trials are single-process, and Ray
Train's in-process mode does not forward reports to Tune; the loop is the same code either way.

Search: ``OptunaSearch`` when optuna is installed (else Tune's random search);
``size_weight`` log-uniform, ``size_tolerance`` uniform, ``lr`` log-uniform when given. Every
trial reads the same shared object (candidates, weights) from the object store: it is
``ray.put`` once by :func:`run_sweep`.

Resume: a sweep lives in ``storage_path/name`` (a fixed name: Tune cannot continue a sweep
without one, ray #36062) with :data:`SETTINGS_FILE` (what it sweeps, over which ranges, with
which TrainConfig). Run again with the same settings, :func:`run_sweep` continues it
(``Tuner.restore`` when ``Tuner.can_restore``) and says so in one line: finished trials keep
their results and are not rerun, trials cut off or failed (a killed trial process, a lost
node, an exception) resume from their last checkpoint, trials not started yet start. A
finished sweep is reported again without running anything. Other settings under the same name
are refused (use another name). Ctrl-C stops the sweep (Tune saves its
state) and :func:`run_sweep` raises :class:`SweepInterrupted` (a KeyboardInterrupt) with the
count of finished trials. Tune saves its experiment state at most every
``TUNE_GLOBAL_CHECKPOINT_S`` seconds (set to 2 here unless set): after a SIGKILL of the driver a
trial that finished in those last seconds resumes from its final checkpoint and only bakes and
measures again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from ray.tune.schedulers import ASHAScheduler, TrialScheduler

from voodoo.bake import DEFAULT_TOLERANCE, bake
from voodoo.gates import load_gate_state, mixed_weights
from voodoo.train import TrainConfig, distill_losses

from cluster.train import StudentJob, WorkerInfo, run_loop  # noqa: F401

__all__ = ["OBJECTIVE", "FAIL_OBJECTIVE", "TuneBackend", "bake_student", "set_one_hot",
           "eval_kl", "evaluate_assignment", "run_sweep", "SweepInterrupted", "SETTINGS_FILE"]

#: Written into the sweep's folder when it starts: what a resumed sweep must match.
SETTINGS_FILE = "voodoo_sweep.json"

#: The metric Tune minimises.
OBJECTIVE = "objective"
#: Reported instead of the KL when the baked size misses the budget.
FAIL_OBJECTIVE = 1.0e6


class SweepInterrupted(KeyboardInterrupt):
    """The sweep stopped before every trial finished (Ctrl-C); Tune saved its state and the
    same call continues it. Attributes: ``path`` (the sweep folder), ``finished``, ``total``."""

    def __init__(self, message: str, path: str, finished: int, total: int):
        super().__init__(message)
        self.path, self.finished, self.total = path, finished, total


class TuneBackend:
    """:func:`cluster.train.run_loop`'s backend inside a Tune function trainable (rank 0 of
    1; ``ray.tune.get_checkpoint`` / ``ray.tune.report``)."""

    def world(self):
        return 0, 1

    def get_checkpoint(self):
        from ray import tune
        return tune.get_checkpoint()

    def report(self, metrics: dict, checkpoint_dir: str | None = None,
               name: str | None = None) -> None:
        from ray import tune
        ck = None if checkpoint_dir is None else tune.Checkpoint.from_directory(checkpoint_dir)
        tune.report(metrics, checkpoint=ck)


# --------------------------------------------------------------------------- evaluation


def bake_student(student, gates: Mapping[str, torch.Tensor], budget: int,
                 tolerance: float = DEFAULT_TOLERANCE, temperature: float = 1.0,
                 tensor_upgrades=None, **bake_options) -> dict:
    """:func:`voodoo.bake.bake` with the menus and byte sizes read from ``student``'s gates
    (``MixedWeight.types``/``nbytes``); ``bake_options`` go to it as they are (``ceiling``,
    ``ceiling_ref``, ``fill_costs``, ``fill_margin``). Raises ValueError when a gate has no
    type names, or from bake (budget unreachable...)."""
    mws = mixed_weights(student)
    if any(m.types is None for m in mws.values()):
        raise ValueError("the student's gates have no type names; pass menus= to install_gates")
    menus = {n: list(m.types) for n, m in mws.items()}
    nb = {n: [int(b) for b in m.nbytes.tolist()] for n, m in mws.items()}
    return bake(gates, menus, nb, budget, tensor_upgrades, tolerance, temperature,
                **bake_options)


@torch.no_grad()
def set_one_hot(student, assignment: dict, big: float = 1.0e4) -> None:
    """Sets each gate's logits to 0 for its assigned type and ``-big`` elsewhere (softmax is
    exactly one-hot in float32 at any temperature <= 1). Raises KeyError for a tensor missing
    from ``assignment["tensors"]``."""
    for n, m in mixed_weights(student).items():
        k = list(m.types).index(assignment["tensors"][n]["type"])
        z = torch.full_like(m.logits, -big)
        z[k] = 0.0
        m.logits.copy_(z)


def _input_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s input ids must be: its input embedding's device (the first layer of a
    model spread over devices), else its first parameter's, else the CPU."""
    try:
        emb = model.get_input_embeddings()
        return next(emb.parameters()).device
    except (AttributeError, NotImplementedError, StopIteration, TypeError):
        pass
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


@torch.no_grad()
def eval_kl(student, teacher, blocks: torch.Tensor, batch_size: int = 4) -> float:
    """Mean KL(teacher || student) per token in nats over ``blocks`` (M, T) int64
    (:func:`voodoo.train.distill_losses`); each batch goes to the device of the student's
    input embedding (a GPU trial's blocks stay on the CPU, as its training batches do)."""
    dev = _input_device(student)
    tot, n = 0.0, 0
    for i in range(0, len(blocks), batch_size):
        ids = blocks[i:i + batch_size].to(dev)
        s = student(input_ids=ids, use_cache=False).logits
        t = teacher(input_ids=ids, use_cache=False).logits if isinstance(teacher, torch.nn.Module) \
            else teacher(ids)
        _, kl = distill_losses(s, t, ids)
        tot += float(kl) * ids.numel()
        n += ids.numel()
    return tot / n


def evaluate_assignment(job: StudentJob, gates: Mapping[str, torch.Tensor], budget: int,
                        tolerance: float = DEFAULT_TOLERANCE,
                        bake_options: Mapping | None = None) -> dict:
    """Bakes ``gates`` on the (un-sharded) ``job``'s student and measures it. ``bake_options``:
    keyword arguments of :func:`voodoo.bake.bake` (``tensor_upgrades``, ``ceiling``,
    ``ceiling_ref``, ``fill_costs``, ``fill_margin``), so that the objective scores the
    assignment the export would write (``voodoo tune`` passes its run's).

    Returns ``{"objective", "kl", "total_bytes", "budget_bytes", "ok", "assignment"}``:
    ``ok`` is False (and ``objective`` = :data:`FAIL_OBJECTIVE`, ``kl`` NaN) when bake raises
    or the baked total is above ``budget * (1 + tolerance)``. Raises ValueError when the job
    has no eval blocks."""
    if job.eval_blocks is None or len(job.eval_blocks) == 0:
        raise ValueError("the job has no eval_blocks to measure the baked assignment on")
    load_gate_state(job.student, gates)
    opts = dict(bake_options or {})
    tolerance = opts.pop("tolerance", tolerance)
    try:
        a = bake_student(job.student, gates, budget, tolerance, **opts)
    except ValueError as e:
        return {"objective": FAIL_OBJECTIVE, "kl": math.nan, "total_bytes": -1,
                "budget_bytes": int(budget), "ok": False, "assignment": None, "error": str(e)}
    ok = a["total_bytes"] <= budget * (1 + tolerance)
    kl = math.nan
    if ok:
        set_one_hot(job.student, a)
        job.student.eval()
        kl = eval_kl(job.student, job.teacher, job.eval_blocks)
    return {"objective": kl if ok else FAIL_OBJECTIVE, "kl": kl, "total_bytes": a["total_bytes"],
            "budget_bytes": int(budget), "ok": ok, "assignment": a}


# --------------------------------------------------------------------------- the sweep


def _trial(config: dict, *, factory, base_cfg: dict, shared, checkpoint_every: int,
           report_every: int, tolerance: float, init_logits=None, bake_options=None,
           step_hook=None) -> None:
    """One Tune trial: train (reporting the proxy objective), bake, report the objective.
    ``step_hook``: as in :func:`cluster.train.run_training` (failure tests)."""
    from ray import tune
    cfg = TrainConfig.from_dict(dict(base_cfg))
    cfg = dataclasses.replace(cfg, **{k: config[k] for k in ("size_weight", "size_tolerance",
                                                             "lr") if k in config})
    loop_cfg = {"factory": factory, "cfg": cfg.to_dict(), "shared": shared,
                "checkpoint_every": checkpoint_every, "report_every": report_every,
                "report_objective": True, "init_logits": init_logits, "step_hook": step_hook}
    try:
        out = run_loop(loop_cfg, TuneBackend())
    except StopIteration as e:  # escaping a trial, Tune reads it as the function's normal end
        raise RuntimeError(f"StopIteration in the trial's training loop: {e!r}") from e
    ev = evaluate_assignment(out["job"], out["gates"], out["budget_bytes"], tolerance,
                             bake_options)
    tune.report({OBJECTIVE: ev["objective"], "kl": ev["kl"], "total_bytes": ev["total_bytes"],
                 "budget_bytes": ev["budget_bytes"], "ok": ev["ok"], "step": out["step"],
                 "final": True})


class BakingASHA(ASHAScheduler):
    """ASHA (``ray.tune.schedulers.ASHAScheduler``) that never stops a trial on the report of
    its last training step (``step >= last_step``, not ``final``): the trial bakes and reports
    its real objective next, in seconds. Stopped there, all its training was thrown away
    unbaked whenever that report fell on a rung (a new user's report: a trial stopped at step
    40 of 40). ``last_step``: the trials' ``max_steps``."""

    def __init__(self, *, last_step: int, **kw):
        super().__init__(**kw)
        self.last_step = int(last_step)

    def on_trial_result(self, tune_controller, trial, result):
        decision = super().on_trial_result(tune_controller, trial, result)
        if decision == TrialScheduler.STOP and not result.get("final") and \
                (result.get("step") or 0) >= self.last_step:
            return TrialScheduler.CONTINUE
        return decision


def run_sweep(factory: Callable[[WorkerInfo], StudentJob], cfg: TrainConfig, *,
              num_samples: int = 8, size_weight: tuple[float, float] = (1.0, 1000.0),
              size_tolerance: tuple[float, float] = (0.001, 0.02),
              lr: tuple[float, float] | None = None, name: str = "voodoo-sweep",
              storage_path: str | os.PathLike | None = None, shared: Any = None,
              max_concurrent_trials: int = 2, grace_period: int | None = None,
              reduction_factor: int = 2, use_optuna: bool | None = None,
              cpus_per_trial: float = 1.0, gpus_per_trial: float = 0.0,
              checkpoint_every: int | None = None, report_every: int = 1,
              tolerance: float = DEFAULT_TOLERANCE, seed: int = 0,
              print_table: bool = True, init_logits: dict | None = None,
              bake_options: dict | None = None, step_hook: Callable | None = None) -> dict:
    """Sweeps ``size_weight`` (log-uniform over the range), ``size_tolerance`` (uniform) and,
    when ``lr`` is given, ``lr`` (log-uniform); minimises :data:`OBJECTIVE`.

    factory/cfg/shared: as in :func:`cluster.train.run_training` (``shared`` is ``ray.put``
    once and every trial reads it). ``cfg.max_steps`` steps per trial; ASHA
    (``max_t = max_steps + 1`` reports, ``grace_period`` default ``max_steps // 4``). OptunaSearch
    when ``use_optuna`` (default: when optuna imports). Trials run in their own processes with
    ``cpus_per_trial``/``gpus_per_trial``; a local Ray is started if none is up
    (:func:`cluster.session.ensure_ray`). ``name``: the sweep's folder under ``storage_path``;
    a sweep already there with the same settings is continued (the module docstring), one
    with other settings refused. Prints
    the trials and the best config when ``print_table``. ``init_logits``: every trial's
    starting gates (needed for ``cfg.gate_init == "fisher"``). ``bake_options``: keyword
    arguments of :func:`voodoo.bake.bake` for the bake that every finished trial's objective
    scores (:func:`evaluate_assignment`), e.g. the run's fill costs and ``--match_size`` ceiling.
    ``step_hook``: passed to every trial's training loop (failure tests).

    A trial that failed (its process killed, a node lost, an exception) is kept on storage with
    its checkpoints; the same call again retries it from its last checkpoint (Tune's
    ``resume_errored``) and reports the sweep only once no trial is left failed or unfinished.

    Returns ``{"config": best param dict, "objective", "kl", "total_bytes", "budget_bytes",
    "trial_id", "checkpoint": the best trial's last checkpoint folder (its trained gates in
    ``state.pt``), "results": [per-trial dicts], "path": the sweep folder, "resumed": whether
    it continued a sweep on storage}``. Raises RuntimeError when no trial finished with a
    valid size, ValueError when ``name`` holds a sweep with other settings,
    :class:`SweepInterrupted` when Ctrl-C stopped it before every trial finished."""
    import ray  # noqa: F401
    from ray import tune

    from cluster.session import check_feasible, ensure_ray
    ensure_ray()
    check_feasible({"CPU": cpus_per_trial, "GPU": gpus_per_trial}, "one Ray Tune trial",
                   "lower --cpus_per_trial / --gpus_per_trial")
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")
    space = {"size_weight": tune.loguniform(*size_weight),
             "size_tolerance": tune.uniform(*size_tolerance)}
    if lr is not None:
        space["lr"] = tune.loguniform(*lr)
    if use_optuna is None:
        try:
            import optuna  # noqa: F401
            use_optuna = True
        except ImportError:
            use_optuna = False
    search_alg = None
    if use_optuna:
        from ray.tune.search.optuna import OptunaSearch
        search_alg = OptunaSearch(seed=seed)
    ckpt_every = checkpoint_every or cfg.partial_save_interval
    scheduler = BakingASHA(last_step=cfg.max_steps, time_attr="training_iteration",
                           max_t=cfg.max_steps + 1,
                           grace_period=grace_period or max(1, cfg.max_steps // 4),
                           reduction_factor=reduction_factor)
    ref = ray.put(shared) if shared is not None else None
    trainable = tune.with_parameters(
        _trial, factory=factory, base_cfg=cfg.to_dict(), shared=ref,
        checkpoint_every=ckpt_every, report_every=report_every, tolerance=tolerance,
        init_logits=init_logits, bake_options=bake_options, step_hook=step_hook)
    trainable = tune.with_resources(trainable, {"cpu": cpus_per_trial, "gpu": gpus_per_trial})
    storage, path = _sweep_path(storage_path, name)
    settings = _settings(cfg, num_samples, size_weight, size_tolerance, lr, use_optuna, seed,
                         tolerance, grace_period, reduction_factor, ckpt_every, report_every)
    restored = tune.Tuner.can_restore(path)
    if restored:
        _check_settings(path, name, settings)
        # failed trials (a killed process, a lost node) are retried from their last
        # checkpoint: a sweep whose trial died is never stuck (a new user's killed trial made
        # every later call report "no trial finished" without running anything)
        tuner = tune.Tuner.restore(path, trainable, resume_unfinished=True,
                                   resume_errored=True, restart_errored=False)
        st = _trial_status(tuner.get_results())
        kept, failed = st.count("TERMINATED"), st.count("ERROR")
        total = max(int(num_samples), len(st))
        if kept >= total:
            print(f"sweep {name} ({path}) is finished ({kept} of {total} trials); reporting its "
                  f"results without running anything")
            grid = tuner.get_results()
        else:
            retry = (f", {failed} failed to retry from {'its' if failed == 1 else 'their'} "
                     "last checkpoint" if failed else "")
            print(f"resuming sweep {name} ({path}): {kept} of {total} trials finished and kept"
                  f"{retry}, {total - kept - failed} to run")
            grid = _fit(tuner)
    else:
        os.makedirs(path, exist_ok=True)
        _write_json(os.path.join(path, SETTINGS_FILE), settings)
        tuner = tune.Tuner(
            trainable, param_space=space,
            tune_config=tune.TuneConfig(metric=OBJECTIVE, mode="min", num_samples=num_samples,
                                        search_alg=search_alg, scheduler=scheduler,
                                        max_concurrent_trials=max_concurrent_trials),
            run_config=tune.RunConfig(name=name, storage_path=storage))
        grid = _fit(tuner)
    # what is on storage decides (after Ctrl-C Tune's in-memory trials all read TERMINATED)
    done, total = _progress(tune.Tuner.restore(path, trainable).get_results(), num_samples)
    if done < total:
        msg = (f"sweep {name} stopped with {done} of {total} trials finished; its state is in "
               f"{path}: run the same command again to continue it")
        print(msg, file=sys.stderr)
        raise SweepInterrupted(msg, path, done, total)
    rows = []
    for r in grid:
        m, conf = r.metrics or {}, r.config or {}
        rows.append({"trial_id": m.get("trial_id") or _trial_id(r),
                     **{k: conf.get(k) for k in space},
                     OBJECTIVE: m.get(OBJECTIVE), "kl": m.get("kl") if m.get("final") else None,
                     "total_bytes": m.get("total_bytes"), "budget_bytes": m.get("budget_bytes"),
                     "finished": bool(m.get("final")), "ok": bool(m.get("ok")),
                     "error": None if r.error is None else _error_reason(r.error),
                     "checkpoint": None if r.checkpoint is None else r.checkpoint.path})
    done = [r for r in rows if r["finished"] and r["ok"]]
    if print_table:
        _print_table(rows, list(space))
    if not done:
        failed: dict[str, list] = {}
        for r in rows:
            if r["error"]:
                failed.setdefault(r["error"], []).append(str(r["trial_id"]))
        why = "".join(f"; {len(v)} trial{'s' * (len(v) > 1)} failed: {k} ({', '.join(v)})"
                      for k, v in failed.items())
        again = ("; the same command again retries the failed trials from their last "
                 "checkpoint" if failed else "")
        raise RuntimeError(f"no trial of sweep {name} finished with a size within the budget"
                           f"{why or '; see the table above'}{again}")
    # ties (trials baking the same assignment) go to the lowest trial id, so a resumed or
    # re-reported sweep names the same best trial
    best = min(done, key=lambda r: (r[OBJECTIVE], str(r["trial_id"])))
    n_failed = sum(bool(r["error"]) for r in rows)
    if n_failed and print_table:
        print(f"{n_failed} trial{'s' * (n_failed > 1)} failed (the table's error rows); the "
              "same command again retries them from their last checkpoint and reports the "
              "sweep anew")
    if print_table:
        print(f"best: trial {best['trial_id']} objective {best[OBJECTIVE]:.6g} nats, "
              f"config {{{', '.join(f'{k}: {best[k]:.6g}' for k in space)}}}")
    return {"config": {k: best[k] for k in space}, "objective": best[OBJECTIVE],
            "kl": best["kl"], "total_bytes": best["total_bytes"],
            "budget_bytes": best["budget_bytes"], "trial_id": best["trial_id"],
            "checkpoint": best["checkpoint"], "results": rows, "path": path,
            "resumed": restored}


def _fit(tuner):
    """``tuner.fit()``, with the SIGINT handler as it was before (Tune installs its own and
    leaves it in place when no Ctrl-C came: a later Ctrl-C would be swallowed)."""
    import signal
    import threading
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT) if main else None
    try:
        return tuner.fit()
    finally:
        if main and before is not None:
            signal.signal(signal.SIGINT, before)


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def _settings(cfg, num_samples, size_weight, size_tolerance, lr, use_optuna, seed, tolerance,
              grace_period, reduction_factor, checkpoint_every, report_every) -> dict:
    """What a sweep is (JSON-able): a resumed sweep must have the same."""
    return json.loads(json.dumps({
        "num_samples": int(num_samples), "size_weight": list(size_weight),
        "size_tolerance": list(size_tolerance), "lr": None if lr is None else list(lr),
        "search": "optuna" if use_optuna else "random", "seed": seed, "tolerance": tolerance,
        "grace_period": grace_period, "reduction_factor": reduction_factor,
        "checkpoint_every": checkpoint_every, "report_every": report_every,
        "train_config": cfg.to_dict()}, default=str))


def _sweep_path(storage_path, name: str) -> tuple[str, str]:
    """``(storage, storage/name)``: the absolute storage folder (default ``~/ray_results``) and
    the sweep's folder in it."""
    storage = os.path.abspath(os.path.expanduser(str(storage_path or "~/ray_results")))
    return storage, os.path.join(storage, name)


def check_sweep_early(storage_path, name: str, cfg: TrainConfig, num_samples: int,
                      size_weight, size_tolerance, lr=None, seed: int = 0) -> None:
    """The settings a caller knows before any expensive stage (the TrainConfig, the sample
    count, the ranges, the seed) compared with a sweep already in ``storage_path/name``: one
    started with others raises the ValueError of :func:`run_sweep` now, not after the Fisher
    prior and the activation-rounding pricing (a new user's rerun with another --max_steps).
    Nothing happens when no such sweep exists."""
    path = _sweep_path(storage_path, name)[1]
    if not os.path.isfile(os.path.join(path, SETTINGS_FILE)):
        return
    full = _settings(cfg, num_samples, size_weight, size_tolerance, lr, None, seed, None,
                     None, None, None, None)
    keys = ("num_samples", "size_weight", "size_tolerance", "lr", "seed", "train_config")
    _check_settings(path, name, {k: full[k] for k in keys}, only=keys)


def _check_settings(path: str, name: str, settings: dict, only=None) -> None:
    f = os.path.join(path, SETTINGS_FILE)
    try:
        with open(f) as fh:
            saved = json.load(fh)
    except (OSError, ValueError):
        raise ValueError(f"{path} holds a Tune sweep that Voodoo did not start (no readable "
                         f"{SETTINGS_FILE}); use another sweep name or remove the folder") from None
    if only is not None:
        saved = {k: saved.get(k) for k in only}
    diff = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
    if "train_config" in diff:
        a, b = saved.get("train_config") or {}, settings["train_config"]
        diff.remove("train_config")
        diff += sorted(f"train_config.{k} ({a.get(k)!r} there, {b.get(k)!r} now)"
                       for k in set(a) | set(b) if a.get(k) != b.get(k))
    if diff:
        raise ValueError(f"sweep {name} in {path} was started with other settings (differs in "
                         f"{', '.join(diff)}); rerun with the same settings to continue it, or "
                         f"choose another sweep name (--sweep_name) or remove the folder")


def _trial_status(grid) -> list[str]:
    """Tune's status of each trial of a ResultGrid (TERMINATED, ERROR, PENDING, RUNNING...)."""
    ea = getattr(grid, "_experiment_analysis", None)
    trials = getattr(ea, "trials", None) or []
    return [str(t.status) for t in trials]


def _progress(grid, num_samples: int) -> tuple[int, int]:
    """(trials finished -- terminated or errored --, trials the sweep will have)."""
    st = _trial_status(grid)
    done = sum(s in ("TERMINATED", "ERROR") for s in st)
    return done, max(int(num_samples), len(st))


def _error_reason(err: BaseException) -> str:
    """One line for a failed trial: the trial's own exception (``TypeName: message``, the
    cause inside Ray's ``RayTaskError``), not the first line of Ray's wrapper
    (``ray::ImplicitFunc.train() (pid=…)``)."""
    import re
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException) and cause is not err:
        err = cause
    text = str(err).strip()
    last = [ln.strip() for ln in text.splitlines()
            if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b", ln.strip())]
    if last:
        return last[-1]
    first = text.splitlines()[0] if text else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def _trial_id(result) -> str | None:
    p = getattr(result, "path", None)
    return os.path.basename(p) if p else None


def _print_table(rows: list[dict], params: list[str]) -> None:
    head = ["trial", *params, OBJECTIVE, "bytes/budget", "status"]
    lines = [head]
    for r in sorted(rows, key=lambda r: (not (r["finished"] and r["ok"]),
                                         r[OBJECTIVE] if r[OBJECTIVE] is not None else math.inf)):
        ratio = (f"{r['total_bytes'] / r['budget_bytes']:.4f}"
                 if r["finished"] and r["ok"] and r["budget_bytes"] else "-")
        status = ("error" if r["error"] else "done" if r["finished"] and r["ok"]
                  else "over budget" if r["finished"] else "stopped (ASHA)")
        obj = "-" if r[OBJECTIVE] is None else f"{r[OBJECTIVE]:.6g}"
        if r[OBJECTIVE] is not None and not r["finished"]:
            obj += "*"   # a training step's kl + penalty, not a baked assignment's KL
        lines.append([str(r["trial_id"]), *(f"{r[k]:.4g}" for k in params), obj, ratio, status])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    for row in lines:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    if any(r[OBJECTIVE] is not None and not r["finished"] for r in rows):
        print(f"* the {OBJECTIVE} of the trial's last training step (KL on its batch + size "
              "penalty, soft gates); a finished trial's is the baked assignment's KL on the "
              "eval blocks, and only those are ranked")
