"""Gate training on Ray Train V2: what Ray adds to :mod:`voodoo.train`.

One :func:`train_loop_per_worker` runs unchanged in-process (``ScalingConfig(num_workers=0)``:
tests, laptops, and ``torchrun``-launched tensor parallelism) and on a cluster
(``num_workers = tensor_parallel * data_parallel`` Ray Train workers, one process group over
them: gloo on CPU, NCCL on GPU). Each worker:

1. builds its job with the caller's **factory** (``factory(WorkerInfo) -> StudentJob``: the
   gated student, the teacher, the token blocks, the adapter's TensorSpecs and head counts); the
   factory must be picklable and deterministic (every rank builds the same model);
2. computes the budget from the **full** tensors, then (``tensor_parallel > 1``) splits the
   student and the teacher with :func:`cluster.tp.shard_model`, and (``device_map``) spreads
   the decoder layers of its replica over several devices with :func:`dispatch_layers`;
3. runs :func:`voodoo.train.train_step` per step on its share of the global batch
   (:func:`voodoo.train.batch_indices`, ``[dp_rank::data_parallel]``; tensor-parallel ranks of
   a replica read the same rows) with a ``grad_sync`` that averages the gate gradients over the
   data-parallel replicas (one flat all-reduce); the tensor-parallel sum is done in backward
   (:mod:`cluster.tp`);
4. reports :data:`voodoo.train.METRICS` (+ ``step``, ``expected_bytes``, ``budget_bytes``)
   with ``ray.train.report`` every ``report_every`` steps (:func:`run_training`'s default,
   ``"auto"``: as many steps as take Ray Train's 2 s report interval, since a report made
   sooner waits for the controller), with a checkpoint every ``checkpoint_every`` steps and at
   the end -- every rank, equally often (a barrier);
5. resumes from the newest complete checkpoint of the run (same ``storage_path`` and
   ``run_name``; below).

Rank layout: ``world_rank = dp_rank * tensor_parallel + tp_rank`` (a replica's TP ranks are
consecutive, so they share a node when workers are packed).

Checkpoint folder (one per checkpoint; Ray merges every rank's files into one)::

    state.pt        rank 0: version, config, step, gates (full logits), history, budget_bytes,
                    layout {tensor_parallel, data_parallel}
    rank-0003.pt    every rank: step, gates, optimizer state (Adam over the gate logits), RNG
    meta.json       rank 0: step, finished, budget_bytes, last metrics (for people)
    complete.json   rank 0, written last: step, world_size, and every file's bytes and sha256

Checkpoints are named by step, ``storage_path/run_name/checkpoint_NNNNNN``, in both modes. A
checkpoint is **complete** when its ``complete.json`` exists and every file it lists is there with
its size and sha256 (:func:`checkpoint_complete`); rank 0 writes it after every rank's files are
on storage (Ray Train: after ``ray.train.report`` returned on every rank and a barrier). A run
resumes from the newest complete checkpoint on storage (:func:`newest_checkpoint`), whatever Ray
Train's controller had registered when a worker died: under load the controller may not yet
have taken in the last report, and ``ray.train.get_checkpoint()`` then points at an older one.
Incomplete folders newer than the one resumed are removed before training goes on; rank 0 keeps
the ``num_to_keep`` newest complete checkpoints (Ray's own ``CheckpointConfig`` keeps all, so
the two never delete each other's folders).

In-process runs (``num_workers=0``) get no persistence from Ray (Ray's local mode keeps the last
checkpoint in memory only); the loop writes the same folders itself (into a temporary folder,
renamed when complete), so resume works the same way in both modes.

Errors that a retry cannot fix (:data:`TERMINAL_ERRORS`: ValueError -- bad input, non-finite
weights, a split that cuts quant blocks --, TypeError, ...) end the run at once: Ray Train's
``FailureConfig(max_failures)`` restarts on worker deaths only (:func:`terminal_error_policy`),
and :func:`run_training` re-raises the worker's own exception. A run that fails otherwise (a
worker died more often than ``max_failures`` allows) ends in :class:`TrainingFailed`: one line
saying what happened, the newest complete checkpoint (path and step) and the command that
resumes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from voodoo.budget import budget_bytes, check_reachable
from voodoo.gates import (gate_parameters, gate_state, load_gate_state,
                          mixed_weights)
from voodoo.train import (_RESUME_FREE, METRICS, TrainConfig, _rng_state, _set_rng_state,
                          batch_indices, enable_checkpointing, start_gates, temperature_at,
                          train_step)

__all__ = [
    "WorkerInfo", "StudentJob", "RunResult", "train_loop_per_worker", "run_loop",
    "RayTrainBackend", "run_training",
    "parse_device_map", "dispatch_layers", "load_checkpoint_state", "STATE_FILE",
    "MANIFEST_FILE", "checkpoint_complete", "newest_checkpoint", "TrainingFailed",
    "TERMINAL_ERRORS", "is_terminal_error", "terminal_error_policy", "command_line",
]

STATE_FILE = "state.pt"
META_FILE = "meta.json"
#: Written last into a checkpoint folder; lists every file with its bytes and sha256.
MANIFEST_FILE = "complete.json"
CKPT_VERSION = 1
_CKPT_RE = re.compile(r"^checkpoint_(\d{6,})$")


@dataclass
class WorkerInfo:
    """What a factory is told about the worker it builds for.

    rank/world_size: Ray Train world rank and size. tp_rank/tp_size, dp_rank/dp_size: the
    tensor- and data-parallel coordinates (``rank = dp_rank * tp_size + tp_rank``). device:
    where the student should live (``cuda:N`` from Ray on GPU workers, else ``cfg.device``; with
    a ``device_map``, its first device). cfg: the TrainConfig (seq_len, dtype, seed...).
    shared: the object passed as ``run_training(shared=...)`` (put in the object store once,
    resolved here), or None."""

    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    device: str = "cpu"
    cfg: TrainConfig | None = None
    shared: Any = None


@dataclass
class StudentJob:
    """What a factory returns (all un-sharded; the loop shards).

    student: HF causal LM with gates installed (:func:`voodoo.gates.install_gates`), full size.
    teacher: a HF causal LM of the same architecture, or a callable ids (B, T) -> logits
        (B, T, V). An nn.Module teacher is sharded/dispatched like the student.
    train_blocks: (N, seq_len) int64. eval_blocks: (M, seq_len) int64 or None (for Tune).
    specs: the adapter's TensorSpecs (taken before gates were installed); required for
        tensor parallel (their ``tp``). n_head/n_head_kv: attention heads (tensor parallel).
    budget: bytes; default from the config over the full gated tensors."""

    student: nn.Module
    teacher: Any
    train_blocks: torch.Tensor
    eval_blocks: torch.Tensor | None = None
    specs: list | None = None
    n_head: int | None = None
    n_head_kv: int | None = None
    budget: int | None = None


@dataclass
class RunResult:
    """What :func:`run_training` returns.

    gates: gguf_name -> logits (K,) float32 (the full, replicated gates). step: steps done.
    finished: step == max_steps. budget_bytes: B. history: per-step metrics (rank 0's).
    metrics: the last reported metrics. checkpoint_path: folder of the last checkpoint."""

    gates: dict[str, torch.Tensor]
    step: int
    finished: bool
    budget_bytes: int
    history: list[dict] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    checkpoint_path: str | None = None


# --------------------------------------------------------------------------- layer-wise


def parse_device_map(spec: str | list | None) -> list[str] | None:
    """``"cuda:0,cuda:1"`` / ``"cpu,cpu"`` / a list -> list of device strings (None stays None).
    Raises ValueError for an empty map or an unknown device."""
    if spec is None:
        return None
    devs = [d.strip() for d in (spec.split(",") if isinstance(spec, str) else spec)]
    if not devs or any(not d for d in devs):
        raise ValueError(f"device_map must list devices like 'cuda:0,cuda:1', got {spec!r}")
    for d in devs:
        try:
            torch.device(d)
        except RuntimeError as e:
            raise ValueError(f"device_map: bad device {d!r} ({e})") from None
    return devs


def _to(obj, dev):
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, obj)


def dispatch_layers(model: nn.Module, devices: list[str], layers: str = "model.layers") -> dict:
    """Spreads the decoder layers of ``model`` over ``devices``, in place; no collectives.

    Layer i of the ``nn.ModuleList`` at ``layers`` goes to ``devices[i * len(devices) // n]``
    (contiguous chunks); everything else (embedding, final norm, lm_head -- a tied head shares
    the embedding's gate, so both stay together) on ``devices[0]``; each layer is moved straight
    to its device and never through ``devices[0]`` (a model built on its devices layer by
    layer, bigger than one device, stays where it is). A forward pre-hook on each
    layer moves its inputs (hidden states, rotary cos/sin, mask) to its device; a forward hook
    on the last layer moves its output back to ``devices[0]``. Each gate's expected size is
    returned on ``devices[0]`` (so the model's total can be summed). Returns
    ``{layer index: device}``. Raises ValueError when ``layers`` is not a ModuleList."""
    stack = model.get_submodule(layers)
    if not isinstance(stack, nn.ModuleList) or len(stack) == 0:
        raise ValueError(f"{layers} is not a non-empty nn.ModuleList of decoder layers")
    first = torch.device(devices[0])
    n, d = len(stack), len(devices)
    placement = {}
    # each layer straight to its device, then the rest to the first without the layers: a
    # model built layer by layer on its devices (bigger than one of them) is never gathered
    # on the first device
    for i, layer in enumerate(stack):
        layer.to(torch.device(devices[i * d // n]))
    held = dict(stack._modules)
    stack._modules.clear()
    try:
        model.to(first)
    finally:
        stack._modules.update(held)
    for i, layer in enumerate(stack):
        dev = torch.device(devices[i * d // n])
        placement[i] = str(dev)
        layer.register_forward_pre_hook(
            lambda m, a, k, _d=dev: (_to(a, _d), _to(k, _d)), with_kwargs=True)
    stack[-1].register_forward_hook(lambda m, a, out: _to(out, first))
    gates = getattr(model, "voodoo_gates", None)
    if gates is not None and hasattr(gates, "follow_modules"):
        gates.follow_modules(model)  # gates on any parameter: mix each layer's on its device
    for mw in mixed_weights(model).values():
        base = type(mw).expected_bytes
        mw.expected_bytes = types.MethodType(lambda self, _b=base: _b(self).to(first), mw)
    return placement


# --------------------------------------------------------------------------- helpers


def _logits(model, ids):
    out = model(input_ids=ids, use_cache=False) if isinstance(model, nn.Module) else model(ids)
    return out.logits if hasattr(out, "logits") else out


def _groups(rank: int, world: int, tp: int):
    """(tp_group, dp_group) for ``rank``; every rank creates every group in the same order,
    as ``dist.new_group`` requires. None when not distributed."""
    if world == 1:
        return None, None
    if not dist.is_initialized():
        raise RuntimeError("world_size > 1 but torch.distributed is not initialized")
    dp = world // tp
    tp_group = dp_group = None
    for d in range(dp):
        g = dist.new_group([d * tp + t for t in range(tp)])
        if rank // tp == d:
            tp_group = g
    for t in range(tp):
        g = dist.new_group([d * tp + t for d in range(dp)])
        if rank % tp == t:
            dp_group = g
    return tp_group, dp_group


def _dp_grad_sync(group, size: int) -> Callable[[list], None] | None:
    """``grad_sync(params)``: average the gate grads over the data-parallel group, one flat
    all-reduce on the first parameter's device (NCCL needs CUDA tensors, gloo CPU ones)."""
    if size == 1:
        return None

    def sync(params):
        dev = params[0].device
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.detach().to(dev, torch.float32).flatten() for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat /= size
        off = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[off:off + n].view_as(g).to(g.device, g.dtype)
            off += n
    return sync


def _barrier(world: int):
    if world > 1 and dist.is_initialized():
        dist.barrier()


def report_poll_seconds() -> float:
    """How often Ray Train V2's controller takes in a worker's report: every
    ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` seconds (2.0 by default in Ray 2.60,
    ``ray.train.v2._internal.constants``). A worker's ``ray.train.report`` puts its result on a
    queue of size 1 (``worker_group/worker.py``), so a second report within that time blocks
    until the first is taken in: reporting every 0.2 s step made a GPU run take 2 s a step
    (``benchmarks/results/gpu_cli/run4``)."""
    try:
        return max(float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", 2.0)), 0.0)
    except ValueError:
        return 2.0


def _report_interval(step_seconds: float, ckpt_every: int, world: int, device=None) -> int:
    """``report_every="auto"``: report every k steps, k the fewest steps that take at least
    :func:`report_poll_seconds` (at least 1, at most ``ckpt_every``: a checkpoint reports
    anyway), from this rank's step time; the largest k over the ranks, so every rank reports
    equally often (``ray.train.report`` is a barrier)."""
    poll = report_poll_seconds()
    k = 1 if step_seconds <= 0 or poll <= 0 else math.ceil(poll / step_seconds)
    k = max(1, min(int(k), max(1, int(ckpt_every))))
    if world > 1 and dist.is_initialized():
        t = torch.tensor([k], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            t = t.to(device if device is not None and torch.device(device).type == "cuda"
                     else "cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        k = int(t.item())
    return k


def load_checkpoint_state(path: str | os.PathLike) -> dict:
    """The ``state.pt`` of a checkpoint folder (config, step, gates, history, budget_bytes).
    Raises FileNotFoundError when the folder has none."""
    f = Path(path) / STATE_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{path} is not a Voodoo training checkpoint (no {STATE_FILE})")
    return torch.load(f, map_location="cpu", weights_only=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _expected_files(world: int) -> list[str]:
    return [STATE_FILE, META_FILE, *(f"rank-{r:04d}.pt" for r in range(world))]


def _file_records(d: Path) -> dict:
    """``{name: {"bytes", "sha256"}}`` of the checkpoint files in folder ``d`` (not the
    manifest, not hidden temporaries)."""
    return {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(d.iterdir())
            if p.is_file() and p.name != MANIFEST_FILE and not p.name.startswith(".")}


def _manifest(step: int, world: int, files: dict) -> dict:
    """The ``complete.json`` record of a checkpoint: its step, world size and files."""
    return {"version": CKPT_VERSION, "step": int(step), "world_size": int(world),
            "files": dict(sorted(files.items()))}


def write_manifest(path: str | os.PathLike, step: int, world: int) -> dict:
    """Writes ``complete.json`` into the checkpoint folder ``path`` (atomically, last): the
    step, the world size and each file's bytes and sha256, read back from storage. Raises
    RuntimeError when a file of the ``world`` ranks is missing (the checkpoint is then left
    incomplete)."""
    d = Path(path)
    missing = [n for n in _expected_files(world) if not (d / n).is_file()]
    if missing:
        raise RuntimeError(f"checkpoint {d} lacks {missing} after every rank reported it")
    man = _manifest(step, world, _file_records(d))
    tmp = d / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps(man, indent=2))
    os.replace(tmp, d / MANIFEST_FILE)
    return man


def _prewrite_manifest(d: Path, rank: int, world: int, step: int) -> None:
    """Rank 0 writes ``complete.json`` into its local checkpoint folder ``d`` before the report
    uploads it: every rank's files with their bytes and sha256, gathered from the ranks (so the
    manifest is right once every rank's upload has landed, and :func:`checkpoint_complete` tells
    a storage folder still missing some). :func:`write_manifest` writes the same after every
    rank's report returned."""
    mine = _file_records(d)
    if world > 1 and dist.is_initialized():
        box = [None] * world
        dist.all_gather_object(box, mine)
    else:
        box = [mine]
    if rank != 0:
        return
    files = {}
    for part in box:
        files.update(part or {})
    (d / MANIFEST_FILE).write_text(json.dumps(_manifest(step, world, files), indent=2))


def checkpoint_complete(path: str | os.PathLike) -> dict | None:
    """The manifest of the checkpoint folder ``path`` when the checkpoint is complete (its
    ``complete.json`` parses, lists ``state.pt``, ``meta.json`` and one ``rank-NNNN.pt`` per
    rank of its world size, and every listed file is there with its bytes and sha256); else
    None."""
    d = Path(path)
    try:
        man = json.loads((d / MANIFEST_FILE).read_text())
        files, world = dict(man["files"]), int(man["world_size"])
        if any(n not in files for n in _expected_files(world)):
            return None
        for name, want in files.items():
            f = d / name
            if f.stat().st_size != int(want["bytes"]) or _sha256(f) != want["sha256"]:
                return None
        int(man["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return man


def _step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the ``checkpoint_NNNNNN`` folders in ``run_dir``, newest first."""
    if not run_dir.is_dir():
        return []
    out = []
    for p in run_dir.iterdir():
        m = _CKPT_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)


def _config_diff(cfg: TrainConfig, state: dict) -> list[str]:
    """The TrainConfig fields (but :data:`voodoo.train._RESUME_FREE`) in which a checkpoint's
    state (:func:`load_checkpoint_state`) differs from ``cfg``: not empty, it is another run's."""
    mine, theirs = cfg.to_dict(), dict(state["config"])
    return sorted(k for k in set(mine) | set(theirs)
                  if k not in _RESUME_FREE and mine.get(k) != theirs.get(k))


def newest_checkpoint(run_dir: str | os.PathLike) -> tuple[Path, int] | None:
    """(folder, step) of the newest complete checkpoint (:func:`checkpoint_complete`) among
    ``run_dir/checkpoint_NNNNNN``, or None. Incomplete folders (a worker died while writing)
    are skipped."""
    for step, p in _step_dirs(Path(run_dir)):
        man = checkpoint_complete(p)
        if man is not None and int(man["step"]) == step:
            return p, step
    return None


def _prune(run_dir: Path, keep: int, newest: int) -> None:
    """Keeps the ``keep`` newest complete checkpoints at or below step ``newest``; removes
    older complete ones and incomplete folders older than ``newest``."""
    kept = 0
    for step, p in _step_dirs(run_dir):
        if step > newest:
            continue
        if step < newest and checkpoint_complete(p) is None:
            shutil.rmtree(p, ignore_errors=True)
        elif kept < keep:
            kept += 1
        else:
            shutil.rmtree(p, ignore_errors=True)


#: Ray Train's record of a run's reported checkpoints, in the run folder (Ray 2.60:
#: ``ray.train.v2._internal.constants.CHECKPOINT_MANAGER_SNAPSHOT_FILENAME``)
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


def _forget_pruned_in_ray_snapshot(run_dir) -> str | None:
    """Sets aside Ray Train's record of the run's checkpoints (:data:`RAY_SNAPSHOT`, renamed to
    ``*.pruned``) when it names a checkpoint folder that is gone, and says so; returns the new
    name, or None (no record, a remote storage path, or nothing gone).

    The record lists every reported checkpoint (``CheckpointConfig(num_to_keep=None)``) while
    the loop keeps only the ``num_to_keep`` newest (:func:`_prune`), and Ray 2.60 refuses to
    start a run whose record names a missing folder (``CheckpointManagerInitializationError``,
    "delete the existing folder"): every rerun of a run that wrote more than ``num_to_keep``
    checkpoints failed. The loop resumes from the newest complete checkpoint on storage
    (:func:`newest_checkpoint`) whatever Ray offers, so nothing is lost without the record."""
    p = Path(str(run_dir)) / RAY_SNAPSHOT
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    gone = sorted(n for n in set(re.findall(r"checkpoint_\d{6}", text))
                  if not (p.parent / n).is_dir())
    if not gone:
        return None
    aside = p.with_name(p.name + ".pruned")
    os.replace(p, aside)
    print(f"[voodoo train] resuming from the newest complete checkpoint in {p.parent} (Ray "
          f"Train's own record, which still lists the {len(gone)} older checkpoint(s) Voodoo "
          f"pruned as usual, set aside as {aside.name}: nothing is lost)", file=sys.stderr,
          flush=True)
    return str(aside)


def _checkpoint_step(path) -> int:
    st = load_checkpoint_state(path)
    return int(st["step"])


# --------------------------------------------------------------------------- the loop


class RayTrainBackend:
    """How the loop talks to Ray Train: ranks, the checkpoint to resume, reports. (Tune's
    function trainables use :class:`cluster.tune.TuneBackend`, with the same methods.)"""

    def world(self) -> tuple[int, int]:
        import ray.train
        ctx = ray.train.get_context()
        return ctx.get_world_rank(), ctx.get_world_size()

    def get_checkpoint(self):
        import ray.train
        return ray.train.get_checkpoint()

    def report(self, metrics: dict, checkpoint_dir: str | None = None,
               name: str | None = None) -> None:
        import ray.train
        ck = None if checkpoint_dir is None else ray.train.Checkpoint.from_directory(
            checkpoint_dir)
        ray.train.report(metrics, checkpoint=ck, checkpoint_dir_name=name)


def train_loop_per_worker(config: dict) -> None:
    """The ``TorchTrainer`` loop: :func:`run_loop` with Ray Train's context."""
    run_loop(config, RayTrainBackend())


def run_loop(config: dict, backend) -> dict:
    """Ray Train worker loop (see the module docstring).

    config keys: ``factory`` (picklable ``factory(WorkerInfo) -> StudentJob``), ``cfg`` (TrainConfig
    dict), ``tensor_parallel`` (int), ``use_gpu``, ``device_map`` (list or None),
    ``checkpoint_every`` (steps, default ``cfg.partial_save_interval``), ``report_every`` (steps,
    default 1; ``"auto"``: after the second step, as many steps as take Ray Train's report interval,
    :func:`_report_interval`), ``stop_after`` (steps or None), ``step_hook`` (``hook(step, info,
    student)`` after each step, or None), ``shared`` (object or ObjectRef), ``local_dir``
    (in-process runs: where checkpoints are written), ``run_dir`` (the run's storage folder, scanned
    for the newest complete checkpoint; default ``local_dir``), ``num_to_keep``,
    ``report_objective`` (add ``objective = kl + penalty`` to the metrics, for Tune schedulers).

    ``backend``: :class:`RayTrainBackend` or anything with its methods. Returns (on every
    rank) ``{"gates", "step", "budget_bytes", "history", "metrics", "job"}`` of the final
    state (``job``: the factory's StudentJob, its student sharded/dispatched as trained).

    Raises ValueError (world size not divisible by tensor_parallel, a checkpoint of another
    run, a budget out of reach), TensorParallelError (the split is not possible)."""
    cfg = TrainConfig.from_dict(dict(config["cfg"]))
    rank, world = backend.world()
    tp = int(config.get("tensor_parallel", 1))
    if tp < 1 or world % tp:
        raise ValueError(f"world size {world} is not a multiple of tensor_parallel={tp}")
    dp = world // tp
    tp_rank, dp_rank = rank % tp, rank // tp
    if cfg.batch_size % dp:
        raise ValueError(f"batch_size {cfg.batch_size} must divide by data_parallel={dp}")
    devices = config.get("device_map")
    if config.get("use_gpu") and world > 0 and torch.cuda.is_available() and not devices:
        import ray.train.torch
        device = str(ray.train.torch.get_device())
    else:
        device = devices[0] if devices else cfg.device
    cfg = dataclasses.replace(cfg, device=device)
    shared = config.get("shared")
    if shared is not None and type(shared).__name__ == "ObjectRef":
        import ray
        shared = ray.get(shared)
    info = WorkerInfo(rank, world, tp_rank, tp, dp_rank, dp, device, cfg, shared)
    tp_group, dp_group = _groups(rank, world, tp)

    job: StudentJob = config["factory"](info)
    student, teacher = job.student, job.teacher
    mws = mixed_weights(student)
    if not mws:
        raise ValueError("the factory's student has no gates; call voodoo.gates.install_gates")
    shapes = {n: m.shape for n, m in mws.items()}  # full shapes, before any split
    bytes_table = {n: m.nbytes.tolist() for n, m in mws.items()}
    budget = job.budget if job.budget is not None else budget_bytes(
        shapes, cfg.compression_ratio, cfg.target_bits, cfg.budget_reduction)
    check_reachable(budget, bytes_table, shapes)

    init_logits = config.get("init_logits")
    if cfg.gate_init == "fisher" and init_logits is None and tp > 1:
        # the prior needs whole tensors: compute it before sharding (same on every rank)
        from voodoo.sensitivity import prior_from_student
        init_logits = prior_from_student(student, teacher, job.train_blocks[: cfg.fisher_blocks],
                                         budget, cfg.gate_init_strength, cfg.seed)
    if tp > 1:
        from cluster.tp import TPGroup, head_counts, shard_model
        n_head, n_head_kv = job.n_head, job.n_head_kv
        if n_head is None:
            n_head, n_head_kv = head_counts(getattr(student, "config", None))
        g = TPGroup(tp_rank, tp, tp_group)
        shard_model(student, job.specs, g, n_head, n_head_kv or n_head)
        if isinstance(teacher, nn.Module):
            shard_model(teacher, job.specs, g, n_head, n_head_kv or n_head)
    if devices:
        dispatch_layers(student, devices)
        if isinstance(teacher, nn.Module):
            dispatch_layers(teacher, devices)
    else:
        student.to(device)
        if isinstance(teacher, nn.Module):
            teacher.to(device)

    params = gate_parameters(student)
    ids_of = {id(p) for p in params}
    for p in student.parameters():
        p.requires_grad_(id(p) in ids_of)
    if cfg.gradient_checkpointing and enable_checkpointing(student):
        student.train()  # HF checkpoints only in training mode
    else:
        student.eval()
    if isinstance(teacher, nn.Module):
        teacher.eval()
        teacher_fn = lambda ids: _logits(teacher, ids)  # noqa: E731
    else:
        teacher_fn = teacher
    forward = None
    if cfg.compile and torch.device(device).type == "cuda" and tp == 1 and not devices:
        forward = torch.compile(student)
    optimizer = torch.optim.Adam(params, lr=cfg.lr)
    grad_sync = _dp_grad_sync(dp_group, dp)
    input_device = torch.device(devices[0] if devices else device)

    # ---- resume: the newest complete checkpoint on storage (rank 0 decides, all follow)
    local_dir = Path(config["local_dir"]) if config.get("local_dir") else None
    run_dir = Path(config["run_dir"]) if config.get("run_dir") else local_dir
    ckpt_dir = None
    ck = backend.get_checkpoint()
    step, history = 0, []
    if run_dir is not None:
        chosen = None
        if rank == 0:
            found = newest_checkpoint(run_dir)
            chosen = (str(found[0]), found[1]) if found is not None else None
            registered = getattr(ck, "path", None) if local_dir is None else None
            if registered and os.path.isdir(registered):
                # the one Ray registered is complete too (every rank's report returned); it
                # wins when newer (killed between the reports and the manifest)
                try:
                    rs = _checkpoint_step(registered)
                except Exception:  # noqa: BLE001 - unreadable: not a candidate
                    rs = -1
                if rs >= 0 and (chosen is None or rs > chosen[1]):
                    chosen = (str(registered), rs)
            newest_step = chosen[1] if chosen is not None else -1
            for s_, p_ in _step_dirs(run_dir):  # newer folders: incomplete leftovers
                if s_ > newest_step and (chosen is None or str(p_) != chosen[0]):
                    shutil.rmtree(p_, ignore_errors=True)
            if local_dir is not None:  # an in-process run killed while writing one
                for p_ in local_dir.glob(".tmp_checkpoint_*"):
                    shutil.rmtree(p_, ignore_errors=True)
        if world > 1 and dist.is_initialized():
            box = [chosen]
            dist.broadcast_object_list(box, src=0)
            chosen = box[0]
        if chosen is not None:
            ckpt_dir, ck = Path(chosen[0]), None
        elif local_dir is not None:
            ck = None  # Ray's local mode keeps nothing worth resuming
        _barrier(world)
    with (ck.as_directory() if ck is not None and ckpt_dir is None
          else _nullpath(ckpt_dir)) as d:
        if d is not None:
            st = load_checkpoint_state(d)
            diff = _config_diff(cfg, st)
            if diff or int(st["budget_bytes"]) != int(budget):
                raise ValueError(f"checkpoint {d} belongs to a different run (differs in "
                                 f"{diff or ['budget_bytes']}); use the same settings or a new "
                                 f"run name")
            own = Path(d) / f"rank-{rank:04d}.pt"
            rk = torch.load(own if own.is_file() else Path(d) / "rank-0000.pt",
                            map_location="cpu", weights_only=True)
            load_gate_state(student, st["gates"])
            optimizer.load_state_dict(rk["optimizer"])
            _set_rng_state(rk["rng"])
            step, history = int(st["step"]), list(st["history"])
            if rank == 0:
                # written, not print()ed: Ray Train's workers patch print() to log each line
                # and also echo it (RAY_TRAIN_ENABLE_PRINT_PATCH): it reached the driver twice
                sys.stderr.write(f"[voodoo train] resuming from {d} (step {step} of "
                                 f"{cfg.max_steps})\n")
                sys.stderr.flush()
        else:
            start_gates(mixed_weights(student), cfg, budget, init_logits,
                        shapes, student=student, teacher=teacher, blocks=job.train_blocks)
            if world > 1 and dist.is_available() and dist.is_initialized():
                # every rank starts from rank 0's gates (a prior computed per rank on GPUs
                # may differ in the last bits: CUDA's embedding backward is not deterministic)
                for p in gate_parameters(student):
                    dist.broadcast(p.data, src=0)
            torch.manual_seed(cfg.seed)

    ckpt_every = int(config.get("checkpoint_every") or cfg.partial_save_interval)
    report_every = config.get("report_every") or 1
    auto_report = report_every == "auto"
    report_every = 1 if auto_report else int(report_every)
    stop_after = config.get("stop_after")
    end = cfg.max_steps if stop_after is None else min(cfg.max_steps, int(stop_after))
    hook = config.get("step_hook")
    num_to_keep = config.get("num_to_keep") or 2

    def metrics_of(m):
        out = dict(m, step=step, budget_bytes=int(budget),
                   expected_bytes=float(m["size_ratio"]) * budget)
        if config.get("report_objective"):
            out["objective"] = float(m["kl"]) + float(m["penalty"])
        return out

    def save_and_report(m):
        final = step >= cfg.max_steps
        name = f"checkpoint_{step:06d}"
        with tempfile.TemporaryDirectory(prefix="voodoo-ckpt-") as tmp:
            d = Path(tmp)
            if local_dir is not None:
                d = local_dir / f".tmp_{name}"
                if rank == 0 and d.exists():
                    shutil.rmtree(d)
                _barrier(world)
                d.mkdir(parents=True, exist_ok=True)
            torch.save({"step": step, "gates": gate_state(student),
                        "optimizer": optimizer.state_dict(), "rng": _rng_state()},
                       d / f"rank-{rank:04d}.pt")
            if rank == 0:
                torch.save({"version": CKPT_VERSION, "config": cfg.to_dict(), "step": step,
                            "gates": gate_state(student), "history": history,
                            "budget_bytes": int(budget),
                            "layout": {"tensor_parallel": tp, "data_parallel": dp}},
                           d / STATE_FILE)
                (d / META_FILE).write_text(json.dumps(
                    {"step": step, "finished": final, "budget_bytes": int(budget),
                     "metrics": m}, indent=2))
            if local_dir is not None:
                _barrier(world)
                final_dir = local_dir / name
                if rank == 0:
                    write_manifest(d, step, world)
                    if final_dir.exists():
                        shutil.rmtree(final_dir)
                    os.replace(d, final_dir)
                    _prune(local_dir, num_to_keep, step)
                _barrier(world)
                d = final_dir
            if local_dir is None:
                # the manifest travels with the files: a rank killed after Ray copied them
                # (before the manifest below) leaves a checkpoint that is still known complete
                _prewrite_manifest(d, rank, world, step)
            backend.report(metrics_of(m), str(d), name=name)
            if run_dir is not None and local_dir is None:
                # every rank's report returned: its files are on storage; mark it complete
                _barrier(world)
                if rank == 0:
                    write_manifest(run_dir / name, step, world)
                    _prune(run_dir, num_to_keep, step)
                _barrier(world)

    def final():
        return {"gates": gate_state(student), "step": step, "budget_bytes": int(budget),
                "history": history, "metrics": metrics_of(history[-1]) if history else {},
                "job": job}

    if step >= end:  # nothing left: report the state we resumed (so the result has it)
        last = history[-1] if history else {k: float("nan") for k in METRICS}
        if run_dir is not None:  # the checkpoint is on storage already: keep it as it is
            backend.report(metrics_of(last))
        else:
            save_and_report(last)
        return final()
    first = step
    while step < end:
        idx = batch_indices(step, len(job.train_blocks), cfg.batch_size, cfg.seed)[dp_rank::dp]
        ids = job.train_blocks[idx].to(input_device)
        t0 = time.perf_counter()
        m = train_step(student, teacher_fn, ids, optimizer, params, cfg, budget,
                       temperature_at(step, cfg), grad_sync, forward)
        if torch.cuda.is_available() and str(input_device).startswith("cuda"):
            torch.cuda.synchronize()
            m["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        m["step_seconds"] = time.perf_counter() - t0
        m["tokens_per_s"] = ids.numel() * dp / m["step_seconds"]
        history.append(m)
        step += 1
        if auto_report and step == first + 2:   # the second step of this process: compiled
            report_every = _report_interval(m["step_seconds"], ckpt_every, world, device)
        if step % ckpt_every == 0 or step == end:
            save_and_report(m)
        elif step % report_every == 0:
            backend.report(metrics_of(m))
        if hook is not None:
            hook(step, info, student)
    return final()


class _nullpath:
    """Context manager yielding a path (or None), like Checkpoint.as_directory."""

    def __init__(self, p):
        self.p = p

    def __enter__(self):
        return None if self.p is None else str(self.p)

    def __exit__(self, *exc):
        return False


# --------------------------------------------------------------------------- failures


def _terminal_types() -> tuple[type, ...]:
    from voodoo.data import DatasetError
    from voodoo.imatrix import ImatrixError
    from voodoo.llamacpp import LlamaCppNotBuilt
    from voodoo.train import CorruptJournalError
    return (ValueError, TypeError, KeyError, NotImplementedError, FloatingPointError,
            DatasetError, ImatrixError, LlamaCppNotBuilt, CorruptJournalError)


#: Exceptions raised in the training function that a retry cannot fix (bad input, non-finite
#: weights, a tensor-parallel split that cuts quant blocks, a checkpoint of another run,
#: missing llama.cpp builds): they end the run on the first occurrence.
TERMINAL_ERRORS: tuple[type, ...] = _terminal_types()


def is_terminal_error(err: BaseException | None) -> bool:
    """True for an exception of :data:`TERMINAL_ERRORS` (not a worker death)."""
    return isinstance(err, TERMINAL_ERRORS)


def _worker_died(err: BaseException) -> bool:
    from ray.exceptions import RayActorError
    try:
        from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
    except ImportError:  # pragma: no cover - other Ray versions
        WorkerHealthCheckFailedError = ()  # noqa: N806
    return isinstance(err, (RayActorError, WorkerHealthCheckFailedError))


def terminal_error_policy(failure_config):
    """Ray Train V2 failure policy: Ray's ``DefaultFailurePolicy``, except that a worker-group
    failure in which a worker raised an error of :data:`TERMINAL_ERRORS` (and no worker died)
    is not retried. Ray's default retries every ``WorkerGroupError`` -- worker deaths and
    exceptions raised in the training function alike -- up to ``FailureConfig(max_failures)``
    times, and ``FailureConfig`` has no setting for this; :func:`run_training` installs this
    policy for its trainer."""
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy

    class VoodooFailurePolicy(DefaultFailurePolicy):
        def _is_retryable_error(self, training_failed_error):
            fails = getattr(training_failed_error, "worker_failures", None) or {}
            if (any(is_terminal_error(e) for e in fails.values())
                    and not any(_worker_died(e) for e in fails.values())):
                return False
            return super()._is_retryable_error(training_failed_error)

    return VoodooFailurePolicy(failure_config)


def _trainer_class():
    """TorchTrainer whose ``fit`` uses :func:`terminal_error_policy` (falls back to Ray's
    policy, retrying every failure, when this Ray has no ``create_failure_policy`` hook)."""
    from ray.train.torch import TorchTrainer

    class VoodooTorchTrainer(TorchTrainer):
        def fit(self):
            try:
                import ray.train.v2.api.data_parallel_trainer as dpt
                from ray.train.v2._internal.execution.failure_handling import (  # noqa: F401
                    DefaultFailurePolicy)
                orig = dpt.create_failure_policy
            except (ImportError, AttributeError):  # pragma: no cover - other Ray versions
                return super().fit()
            dpt.create_failure_policy = terminal_error_policy
            try:
                return super().fit()
            finally:
                dpt.create_failure_policy = orig

    return VoodooTorchTrainer


class TrainingFailed(RuntimeError):
    """A Ray Train run that failed for good (workers died more often than ``max_failures``
    allows, or Ray itself failed). The message is one line: what happened, what was kept and
    the command that resumes. Attributes: ``run_name``, ``checkpoint`` (newest complete
    checkpoint folder or None), ``step`` (its step, 0 without one), ``command``."""

    def __init__(self, message: str, run_name: str, checkpoint: str | None, step: int,
                 command: str):
        super().__init__(message)
        self.run_name, self.checkpoint, self.step, self.command = (run_name, checkpoint,
                                                                   step, command)


def command_line(argv: list[str] | None = None) -> str:
    """The command this process runs, for "rerun it to resume" messages: ``voodoo train ...``
    for console scripts, ``python -m pkg.mod ...`` for ``-m`` runs."""
    argv = list(sys.argv if argv is None else argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None) and argv and argv[0].endswith(".py"):
        head = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:
        head = [os.path.basename(argv[0]) if argv else "python"]
    return shlex.join(head + argv[1:])


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def _failure_message(err, run_name: str, run_dir: str, max_failures: int, max_steps: int,
                     resume_command: str | None) -> TrainingFailed:
    fails = dict(getattr(err, "worker_failures", None) or {})
    died = sorted(r for r, e in fails.items() if _worker_died(e))
    if died:
        cause = fails[died[0]]
        cause = getattr(cause, "health_check_failure", None) or cause
        what = (f"worker rank{'s' if len(died) > 1 else ''} {', '.join(map(str, died))} died "
                f"({_first_line(cause)})")
    elif fails:
        r0 = sorted(fails)[0]
        what = f"worker rank {r0} failed ({_first_line(fails[r0])})"
    else:
        what = f"Ray Train failed ({_first_line(err)})"
    tries = "no restart allowed" if max_failures == 0 else f"after {max_failures} restart(s)"
    found = newest_checkpoint(run_dir)
    if found is None:
        kept = "no checkpoint was complete yet, so a rerun starts from step 0"
        ck, step = None, 0
    else:
        ck, step = str(found[0]), found[1]
        kept = f"kept checkpoint {ck} (step {step} of {max_steps})"
    cmd = resume_command or command_line()
    more = "" if "--max_failures" in cmd or max_failures > 0 else \
        " (add --max_failures N to restart dead workers by itself)"
    msg = (f"gate training run {run_name} stopped: {what}, {tries} (--max_failures "
           f"{max_failures}); {kept}; resume with: {cmd}{more}")
    return TrainingFailed(msg, run_name, ck, step, cmd)


# --------------------------------------------------------------------------- the driver


def run_training(factory: Callable[[WorkerInfo], StudentJob], cfg: TrainConfig, *,
                 num_workers: int | None = 0, use_gpu: bool = False, tensor_parallel: int = 1,
                 data_parallel: int | None = None, run_name: str = "voodoo-train",
                 storage_path: str | os.PathLike | None = None, max_failures: int = 0,
                 num_to_keep: int = 2, device_map: str | list | None = None,
                 resources_per_worker: dict | None = None, checkpoint_every: int | None = None,
                 report_every: int | str = "auto", stop_after: int | None = None,
                 step_hook: Callable | None = None, shared: Any = None,
                 callbacks: list | None = None, report_objective: bool = False,
                 init_logits: dict | None = None,
                 resume_command: str | None = None) -> RunResult:
    """Trains gates with a ``TorchTrainer``; returns the final state from its last checkpoint.

    Args:
        factory: picklable ``factory(WorkerInfo) -> StudentJob`` (see :class:`StudentJob`).
        cfg: the TrainConfig (identical on every worker).
        num_workers: Ray Train workers. 0: in-process (Ray's local mode; with ``torchrun``
            environment variables set, torchrun's processes form the group); None:
            ``tensor_parallel * data_parallel``.
        use_gpu: one GPU per worker (NCCL); the worker's device comes from Ray.
        tensor_parallel: ranks per model replica (:mod:`cluster.tp`); data_parallel: replicas
            (default ``num_workers // tensor_parallel``).
        run_name: the RunConfig name; keep it fixed to resume (never a timestamp).
        storage_path: RunConfig storage (shared storage on multi-node clusters); default
            ``~/ray_results``.
        max_failures: worker-group restarts (FailureConfig); each resumes from the last
            checkpoint. num_to_keep: CheckpointConfig.
        device_map: ``"cuda:0,cuda:1"``: layer-wise split inside each worker
            (:func:`dispatch_layers`).
        resources_per_worker: ScalingConfig's (e.g. ``{"CPU": 0.5}``).
        checkpoint_every/report_every/stop_after/step_hook/report_objective: see
            :func:`train_loop_per_worker`. shared: any object the factory needs on every
            worker (candidates, weights): put in the object store once.
        callbacks: RunConfig callbacks (e.g. Tune's ``TuneReportCallback``).
        init_logits: gguf_name -> (K,) starting logits (needed for ``gate_init="fisher"``;
            :func:`voodoo.pipeline.fisher_prior`), sent to every worker.
        resume_command: the command a user reruns to resume, named in :class:`TrainingFailed`
            (default: this process's command line, :func:`command_line`).

    The result is read from the newest complete checkpoint on storage
    (:func:`newest_checkpoint`).

    Raises ValueError for inconsistent sizes; the worker's own exception (not retried) for
    :data:`TERMINAL_ERRORS`; :class:`TrainingFailed` when workers died more than
    ``max_failures`` times (one line: what happened, the checkpoint kept, the command that
    resumes)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.exceptions import RayError
    from ray.train import TrainingFailedError

    tensor_parallel = int(tensor_parallel)
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
    if num_workers is None:
        num_workers = tensor_parallel * (data_parallel or 1)
    if num_workers > 0:
        dp = data_parallel or num_workers // tensor_parallel
        if dp * tensor_parallel != num_workers:
            raise ValueError(f"num_workers={num_workers} must equal tensor_parallel "
                             f"({tensor_parallel}) x data_parallel ({data_parallel})")
    storage = os.path.abspath(os.path.expanduser(str(storage_path or "~/ray_results")))
    devices = parse_device_map(device_map)
    if num_workers > 0:
        from cluster.session import check_feasible, ensure_ray
        ensure_ray()  # a local Ray started here ends with this process (cluster.session)
        # ScalingConfig's default per worker: 1 CPU, or 1 GPU with use_gpu
        need = dict(resources_per_worker or ({} if use_gpu else {"CPU": 1}))
        if use_gpu:
            need.setdefault("GPU", 1)
        check_feasible(need, "one Ray Train worker",
                       "lower --cpus_per_worker (or leave out --use_gpu)", count=num_workers,
                       count_fix="lower --num_workers (voodoo tp: --nproc) or --cpus_per_worker")
    if shared is not None and num_workers > 0:
        import ray
        shared = ray.put(shared)
    loop_config = {
        "factory": factory, "cfg": cfg.to_dict(), "tensor_parallel": tensor_parallel,
        "use_gpu": use_gpu, "device_map": devices, "checkpoint_every": checkpoint_every,
        "report_every": report_every, "stop_after": stop_after, "step_hook": step_hook,
        "shared": shared, "num_to_keep": num_to_keep, "report_objective": report_objective,
        "init_logits": ({k: torch.as_tensor(v).float() for k, v in init_logits.items()}
                        if init_logits is not None else None),
        "local_dir": os.path.join(storage, run_name) if num_workers == 0 else None,
        "run_dir": os.path.join(storage, run_name),
    }
    scaling = ScalingConfig(num_workers=num_workers, use_gpu=use_gpu and num_workers > 0,
                            resources_per_worker=resources_per_worker)
    run_config = RunConfig(name=run_name, storage_path=storage,
                           failure_config=FailureConfig(max_failures=max_failures),
                           # the loop prunes its own checkpoints (see the module docstring)
                           checkpoint_config=CheckpointConfig(num_to_keep=None),
                           callbacks=callbacks)
    trainer = _trainer_class()(train_loop_per_worker, train_loop_config=loop_config,
                               scaling_config=scaling, run_config=run_config)
    run_dir = loop_config["run_dir"]
    _forget_pruned_in_ray_snapshot(run_dir)
    import signal
    import threading
    main_thread = threading.current_thread() is threading.main_thread()
    old_sigint = signal.getsignal(signal.SIGINT) if main_thread else None
    try:
        result = trainer.fit()
    except SystemExit:
        # Ray Train's SIGINT handler aborts the run and calls sys.exit() inside fit(); to the
        # caller this is a Ctrl-C (the CLI then says how to resume), not a silent exit 1
        raise KeyboardInterrupt from None
    except TrainingFailedError as e:
        fails = dict(getattr(e, "worker_failures", None) or {})
        terminal = [fails[r] for r in sorted(fails) if is_terminal_error(fails[r])]
        if terminal and not any(_worker_died(x) for x in fails.values()):
            raise terminal[0] from None  # the worker's own error: bad input, not Ray's
        raise _failure_message(e, run_name, run_dir, max_failures, cfg.max_steps,
                               resume_command) from e
    except RayError as e:
        # the controller itself lost (its node, or the head, crashed): the same line, with the
        # checkpoint on storage and the command that resumes, not Ray's traceback
        raise _failure_message(e, run_name, run_dir, max_failures, cfg.max_steps,
                               resume_command) from e
    finally:
        if old_sigint is not None:  # fit() left Ray's handler installed
            signal.signal(signal.SIGINT, old_sigint)
    found = newest_checkpoint(run_dir)
    if found is None:
        raise RuntimeError(f"run {run_name} finished without a complete checkpoint in "
                           f"{run_dir}")
    st = load_checkpoint_state(found[0])
    diff = _config_diff(cfg, st)
    if diff:
        # another run wrote into this run folder meanwhile: never bake its gates as ours
        raise RuntimeError(f"the newest checkpoint in {run_dir} ({found[0]}) is another run's "
                           f"(differs in {diff}): two runs share the run "
                           "name; give each its own --run_name or --output_dir")
    path = str(found[0])
    return RunResult(gates=st["gates"], step=int(st["step"]),
                     finished=int(st["step"]) >= cfg.max_steps,
                     budget_bytes=int(st["budget_bytes"]), history=list(st["history"]),
                     metrics=dict(result.metrics or {}), checkpoint_path=path)
