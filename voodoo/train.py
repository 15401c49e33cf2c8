"""Gate training: the core loop, in one process, no Ray.

The student is a HF causal LM whose selectable modules were replaced by gated mixed-quant
modules (:func:`voodoo.gates.install_gates`); only the gate logits train (Adam), every model
weight is frozen. Per step, on a batch of token blocks ``ids`` (B, T)::

    loss = CE(student next-token)                      # mean per predicted token, nats
         + kl_weight * KL(teacher || student)           # mean per token (all T positions), nats
         + size_penalty(E[bytes], budget, size_tolerance, size_weight)

with ``E[bytes] = sum_tensors sum_k p_k bytes_k`` (tied tensors once) and the dead-zone
quadratic penalty of :func:`voodoo.budget.size_penalty`.

Temperature: geometric from ``t_start`` (step 0) to ``t_end`` (last step),
``T(s) = t_start * (t_end / t_start) ** (s / (max_steps - 1))`` -- equal ratios per step, so
the gates sharpen as fast late as early on a log scale (see :func:`temperature_at`).

Determinism: the data order is a function of (seed, step) only (:func:`batch_indices`), the
gate init has no randomness, so a run is fixed by its config. Resume: ``partial.pt`` in the
output directory (gates, Adam state, step, RNG states, history) is written atomically every
``partial_save_interval`` steps and at the end; rerunning with the same directory continues from
it and ends with the same gates as an uninterrupted run.

Distributed use (the Ray layer): :func:`train_step` is the unit of work; pass ``rank``/
``world_size`` to :func:`train_gates` to shard each global batch, and ``grad_sync(params)`` to
average the gate gradients across workers (e.g. an all-reduce / world_size) before the Adam
step. Only rank 0 writes the journal.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from voodoo.budget import budget_bpw, budget_bytes, check_reachable, size_penalty
from voodoo.gates import (GATE_INITS, gate_parameters, gate_state, init_gates, load_gate_state,
                          mixed_weights, model_expected_bytes, set_temperature)
from voodoo.progress import log

__all__ = [
    "TrainConfig", "TrainResult", "CorruptJournalError", "CONFIG_VERSION", "JOURNAL_NAME",
    "train_gates", "train_step", "temperature_at", "batch_indices", "distill_losses",
    "torch_dtype", "METRICS", "start_gates", "TRAIN_GATE_INITS",
]

CONFIG_VERSION = 1
JOURNAL_NAME = "partial.pt"
#: Names of the per-step metrics (history entries, progress bar, Ray reports).
METRICS = ("loss", "ce", "kl", "penalty", "size_ratio", "temperature")

#: ``TrainConfig.gate_init`` values: :data:`voodoo.gates.GATE_INITS` and ``"fisher"``.
TRAIN_GATE_INITS = ("fisher", *GATE_INITS)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Fields that may change between a run and its resume without changing the result.
_RESUME_FREE = {"device", "partial_save_interval", "compile", "gradient_checkpointing"}


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` -> torch dtype; ValueError otherwise."""
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass
class TrainConfig:
    """Gate-training settings (versioned; ``to_dict``/``from_dict``/JSON round trip).

    Budget: ``compression_ratio`` (of the Q8_0 size) or ``target_bits`` (bits per weight) --
    set ``compression_ratio=None`` when giving ``target_bits`` --, less ``budget_reduction``
    (:func:`voodoo.budget.budget_bytes`). ``size_weight``/``size_tolerance``: the penalty's
    weight and dead zone (relative). ``kl_weight``: lambda. ``lr``: Adam's, on the logits.
    ``t_start``/``t_end``: the geometric temperature schedule. ``gate_init``: ``"fisher"`` (the
    knapsack solution of the Fisher-predicted KL per candidate, :mod:`voodoo.sensitivity`,
    computed from ``fisher_blocks`` calibration blocks and passed to :func:`train_gates` as
    ``init_logits``), ``"budget"`` (a prior toward the budget's bpw, strength
    ``gate_init_strength`` per bit) or ``"uniform"``.
    ``dtype``: the storage/compute dtype the caller loads the student and candidates in
    (``"bfloat16"`` on CUDA saves memory). ``compile``: ``torch.compile`` the student on CUDA
    (``--no_compile`` turns it off; never used on CPU).

    Raises ValueError from ``__post_init__`` for out-of-range values.
    """

    version: int = CONFIG_VERSION
    compression_ratio: float | None = 0.5
    target_bits: float | None = None
    budget_reduction: float = 0.0
    size_weight: float = 100.0
    size_tolerance: float = 0.005
    kl_weight: float = 1.0
    lr: float = 0.05
    max_steps: int = 500
    seq_len: int = 512
    batch_size: int = 4
    t_start: float = 1.0
    t_end: float = 0.05
    gate_init: str = "fisher"
    gate_init_strength: float = 2.0
    fisher_blocks: int = 8
    partial_save_interval: int = 50
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    compile: bool = True

    def __post_init__(self):
        if self.version != CONFIG_VERSION:
            raise ValueError(f"TrainConfig version {self.version} is not supported "
                             f"(this Voodoo writes version {CONFIG_VERSION})")
        if (self.compression_ratio is None) == (self.target_bits is None):
            raise ValueError("set exactly one of compression_ratio and target_bits")
        if self.compression_ratio is not None and not self.compression_ratio > 0:
            raise ValueError(f"compression_ratio must be > 0, got {self.compression_ratio}")
        if self.target_bits is not None and not self.target_bits > 0:
            raise ValueError(f"target_bits must be > 0, got {self.target_bits}")
        if not 0 <= self.budget_reduction < 1:
            raise ValueError(f"budget_reduction must be in [0, 1), got {self.budget_reduction}")
        for k in ("size_weight", "size_tolerance", "kl_weight"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k} must be >= 0, got {getattr(self, k)}")
        for k in ("lr", "t_start", "t_end", "gate_init_strength"):
            v = getattr(self, k)
            if not (v > 0 and v < float("inf")):
                raise ValueError(f"{k} must be a finite number > 0, got {v}")
        for k in ("max_steps", "seq_len", "batch_size", "partial_save_interval"):
            if not (isinstance(getattr(self, k), int) and getattr(self, k) >= 1):
                raise ValueError(f"{k} must be an integer >= 1, got {getattr(self, k)}")
        if self.seq_len < 2:
            raise ValueError("seq_len must be >= 2 (next-token loss)")
        if self.gate_init not in TRAIN_GATE_INITS:
            raise ValueError(f"gate_init must be one of {TRAIN_GATE_INITS}, got "
                             f"{self.gate_init!r}")
        if not (isinstance(self.fisher_blocks, int) and self.fisher_blocks >= 1):
            raise ValueError(f"fisher_blocks must be an integer >= 1, got {self.fisher_blocks}")
        torch_dtype(self.dtype)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Raises ValueError for unknown keys or an unsupported version."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown TrainConfig keys: {unknown}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        return cls.from_dict(json.loads(text))


@dataclass
class TrainResult:
    """What :func:`train_gates` returns.

    gates: gguf_name -> logits (K,) float32 CPU. step: steps done. finished: step == max_steps.
    budget_bytes: B. expected_bytes: sum p_k bytes_k at the last temperature (bytes).
    history: one dict of :data:`METRICS` per step (all steps, across resumes)."""

    gates: dict[str, torch.Tensor]
    step: int
    finished: bool
    budget_bytes: int
    expected_bytes: float
    history: list[dict] = field(default_factory=list)


class CorruptJournalError(RuntimeError):
    """``partial.pt`` exists but cannot be read or does not match this run. The file is kept."""


def temperature_at(step: int, cfg: TrainConfig) -> float:
    """Geometric schedule: ``t_start`` at step 0, ``t_end`` at step ``max_steps - 1``."""
    if cfg.max_steps <= 1:
        return cfg.t_start
    frac = min(step, cfg.max_steps - 1) / (cfg.max_steps - 1)
    return cfg.t_start * (cfg.t_end / cfg.t_start) ** frac


def batch_indices(step: int, n_blocks: int, batch_size: int, seed: int) -> torch.Tensor:
    """Block indices (batch_size,) int64 of the global batch at ``step``.

    Sample position ``i = step * batch_size + j`` reads epoch ``i // n_blocks`` (a fresh
    permutation of the blocks from a generator seeded with (seed, epoch)) at ``i % n_blocks``.
    A pure function of its arguments, so resuming needs no data-loader state."""
    out, perms = [], {}
    for i in range(step * batch_size, (step + 1) * batch_size):
        e = i // n_blocks
        if e not in perms:
            g = torch.Generator().manual_seed(seed * 1_000_003 + e)
            perms[e] = torch.randperm(n_blocks, generator=g)
        out.append(perms[e][i % n_blocks])
    return torch.stack(out)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, use_cache=False) if isinstance(model, nn.Module) else model(ids)
    return out.logits if hasattr(out, "logits") else out


#: Logits (positions x vocab) above which :func:`distill_losses` works in chunks of positions.
DISTILL_CHUNK_ELEMENTS = 1 << 27


def _distill_chunk(s, t, tgt):
    """Summed CE (targets ``tgt``, -100 ignored) and summed KL(t || s) of a chunk of positions,
    in float32: s, t (n, V), tgt (n,)."""
    s = s.float()
    ce = F.cross_entropy(s, tgt, ignore_index=-100, reduction="sum")
    log_s = torch.log_softmax(s, -1)
    log_t = torch.log_softmax(t.float(), -1)
    return ce, (log_t.exp() * (log_t - log_s)).sum()


def distill_losses(s_logits: torch.Tensor, t_logits: torch.Tensor, ids: torch.Tensor):
    """(ce, kl) in nats: s_logits, t_logits (B, T, V), ids (B, T) int64.

    ce: mean next-token cross-entropy of the student over B*(T-1) predictions.
    kl: mean over B*T positions of KL(teacher || student) = sum_v p_t (log p_t - log p_s).
    Computed in float32. Beyond :data:`DISTILL_CHUNK_ELEMENTS` logits (e.g. 8192 tokens of a
    150k vocabulary), chunk by chunk of positions under non-reentrant checkpointing, so that
    only one chunk's float32 temporaries exist at a time (forward and backward) instead of
    several full (B, T, V) float32 tensors; the same sums, in another order."""
    b, t, v = s_logits.shape
    if s_logits.numel() > DISTILL_CHUNK_ELEMENTS and b * t > 1:
        from torch.utils.checkpoint import checkpoint
        tgt = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1).reshape(-1)
        rows = max(1, DISTILL_CHUNK_ELEMENTS // v)
        ce = kl = 0.0
        for s_c, t_c, g_c in zip(s_logits.reshape(-1, v).split(rows),
                                 t_logits.reshape(-1, v).split(rows), tgt.split(rows)):
            c, k = checkpoint(_distill_chunk, s_c, t_c, g_c, use_reentrant=False)
            ce, kl = ce + c, kl + k
        return ce / (b * (t - 1)), kl / (b * t)
    s = s_logits.float()
    v = s.shape[-1]
    ce = F.cross_entropy(s[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1))
    log_s = torch.log_softmax(s, -1)
    log_t = torch.log_softmax(t_logits.float(), -1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1).mean()
    return ce, kl


def train_step(student, teacher_fn: Callable[[torch.Tensor], torch.Tensor],
               ids: torch.Tensor, optimizer: torch.optim.Optimizer, params: list,
               cfg: TrainConfig, budget: float, temperature: float,
               grad_sync: Callable[[list], None] | None = None, forward=None) -> dict:
    """One optimisation step of the gate logits; returns the :data:`METRICS` as floats.

    ids: (B, T) int64 on the student's device. teacher_fn: ids -> logits (B, T, V), called
    under no_grad. ``grad_sync(params)``, if given, runs after backward and before the Adam
    step (e.g. all-reduce-average the logits' grads across data-parallel workers; the size
    penalty's grad is identical on every worker, so averaging keeps it). ``forward``: the
    callable to run the student with (e.g. its ``torch.compile`` wrapper), default the student.
    """
    set_temperature(student, temperature)
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        t_logits = teacher_fn(ids).to(ids.device)
    s_logits = _logits(student if forward is None else forward, ids)
    ce, kl = distill_losses(s_logits, t_logits, ids)
    size = model_expected_bytes(student)
    pen = size_penalty(size, budget, cfg.size_tolerance, cfg.size_weight)
    loss = ce + cfg.kl_weight * kl + pen
    loss.backward()
    if grad_sync is not None:
        grad_sync(params)
    optimizer.step()
    return {"loss": loss.item(), "ce": ce.item(), "kl": kl.item(), "penalty": float(pen.detach()),
            "size_ratio": size.item() / budget, "temperature": temperature}


# --------------------------------------------------------------------------- journal


def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    name, keys, pos, has_gauss, cached = np.random.get_state()
    st["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                   "has_gauss": has_gauss, "cached": cached}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    n = st["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    if "cuda" in st and torch.cuda.is_available() and len(st["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(st["cuda"])


def _save_journal(path: Path, obj: dict) -> None:
    """Atomic: written to a temporary file in the same folder, fsynced, then os.replace'd."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_journal_fits(journal, cfg: "TrainConfig", budget: float, st: dict | None = None,
                       way_out: str | None = None) -> None:
    """Raises ValueError, naming what differs and the way out, when the journal ``journal``
    (read unless ``st``, its contents, is given) was written by a run with another training
    config (``_RESUME_FREE`` keys aside) or another budget (bytes); such a journal cannot be
    resumed. ``way_out``: what the message tells the user to do instead (default: the same
    settings, a fresh --output_dir or deleting the journal). CorruptJournalError when it cannot
    be read. A Ray Train checkpoint's ``state.pt`` has the same ``config`` and
    ``budget_bytes``."""
    journal = Path(journal)
    st = _load_journal(journal) if st is None else st
    mine, theirs = cfg.to_dict(), dict(st["config"])
    diff = [f"{k} ({theirs.get(k)!r} there, {mine.get(k)!r} now)"
            for k in sorted(set(mine) | set(theirs))
            if k not in _RESUME_FREE and mine.get(k) != theirs.get(k)]
    if int(st["budget_bytes"]) != int(budget):
        diff.append(f"budget_bytes ({int(st['budget_bytes'])} there, {int(budget)} now)")
    if diff:
        way_out = way_out or (f"use the same settings to resume (flags left out take their "
                              f"defaults), a fresh --output_dir, or delete {journal} to train "
                              "anew here (the folder's data, imatrix and candidates are reused "
                              "where their settings match)")
        raise ValueError(f"{journal} belongs to a different run (differs in {diff}); {way_out}")


def _load_journal(path: Path) -> dict:
    hint = ("The file was kept; delete it to start training over, or pass a fresh output "
            "directory.")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- any unpickling failure means a bad file
        raise CorruptJournalError(f"{path} is not a readable training journal "
                                  f"({type(e).__name__}: {e}). {hint}") from e
    need = {"version", "config", "step", "gates", "optimizer", "rng", "history", "budget_bytes"}
    if not isinstance(obj, dict) or not need <= set(obj):
        raise CorruptJournalError(f"{path} is not a complete training journal (missing "
                                  f"{sorted(need - set(obj) if isinstance(obj, dict) else need)}"
                                  f"). {hint}")
    return obj


# --------------------------------------------------------------------------- the loop


def start_gates(mixed, cfg: TrainConfig, budget: float,
                init_logits: dict[str, torch.Tensor] | None = None, shapes=None, *,
                student: nn.Module | None = None, teacher=None,
                blocks: torch.Tensor | None = None) -> None:
    """Sets the starting logits of a fresh run: ``init_logits`` if given; else for
    ``gate_init="fisher"`` :func:`voodoo.sensitivity.prior_from_student` (needs ``student``,
    an ``nn.Module`` ``teacher`` and calibration ``blocks``; the first ``cfg.fisher_blocks``
    are used); else :func:`voodoo.gates.init_gates` with ``cfg.gate_init`` (``shapes``: the
    tensors' full shapes, default the gates' own).

    Raises ValueError for ``"fisher"`` without ``init_logits`` when the teacher is a plain
    callable or the student is sharded."""
    if init_logits is not None:
        load_gate_state(mixed, init_logits)
        return
    if cfg.gate_init == "fisher":
        if student is None or not isinstance(teacher, nn.Module) or blocks is None:
            raise ValueError("gate_init 'fisher' needs init_logits, or the student, an "
                             "nn.Module teacher and calibration blocks (voodoo.pipeline."
                             "fisher_prior computes init_logits)")
        from .sensitivity import prior_from_student
        dev = next(iter(mixed.values())).logits.device
        logits = prior_from_student(student, teacher, blocks[: cfg.fisher_blocks].to(dev),
                                    budget, cfg.gate_init_strength, cfg.seed)
        load_gate_state(mixed, logits)
        return
    shapes = shapes or {n: m.shape for n, m in mixed.items()}
    init_gates(mixed, cfg.gate_init, budget_bpw(budget, shapes), cfg.gate_init_strength)


def enable_checkpointing(model: nn.Module) -> bool:
    """Turns on transformers' activation (gradient) checkpointing per decoder layer, the
    non-reentrant variant (the reentrant one drops gradients when no input requires grad).
    Correct with the gates: :class:`voodoo.gates.ParamGates` sets every gated weight as a
    tensor before the forward, so a layer's recomputed forward reads the same mixed weights
    (same probabilities) and the gate gradients are unchanged. Returns False (and does
    nothing) for a model without transformers' checkpointing. The model must be in training
    mode for the layers to checkpoint."""
    kw = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    else:
        return False
    return True


def train_gates(student: nn.Module, teacher, train_blocks: torch.Tensor, cfg: TrainConfig,
                output_dir: str | os.PathLike | None = None, *, budget: int | None = None,
                grad_sync: Callable[[list], None] | None = None, rank: int = 0,
                world_size: int = 1, progress: bool = True, stop_after: int | None = None,
                callback: Callable[[int, dict], None] | None = None,
                init_logits: dict[str, torch.Tensor] | None = None) -> TrainResult:
    """Trains the gate logits of ``student`` (see the module docstring).

    Args:
        student: HF causal LM with gates installed, on ``cfg.device``. Its other parameters
            are frozen here (``requires_grad=False``).
        teacher: a HF causal LM (the BF16/F32 base, or the Q8_0-passed weights) or a callable
            ``ids (B, T) -> logits (B, T, V)``; run under no_grad, in eval mode.
        train_blocks: (N, seq_len) int64 token ids, N >= 1 (any device).
        output_dir: where ``partial.pt`` lives; None: no journal.
        budget: bytes; default from ``cfg`` over the gates' tensors
            (:func:`voodoo.budget.budget_bytes`).
        grad_sync, rank, world_size: data parallelism (see :func:`train_step`); each rank takes
            ``global_batch[rank::world_size]``; only rank 0 writes the journal.
        stop_after: stop (after saving the journal) once this many steps are done in total;
            the result has ``finished=False``. For time-limited jobs and tests.
        callback: called as ``callback(step_done, metrics)`` after every step.
        init_logits: gguf_name -> (K,) starting logits (required for ``gate_init="fisher"``:
            :func:`voodoo.pipeline.fisher_prior`); ignored when resuming from a journal.

    Raises ValueError (bad blocks, no gates, budget outside the menus' reachable range, a
    journal from a different run), CorruptJournalError (unreadable ``partial.pt``; kept).
    """
    if train_blocks.dim() != 2 or train_blocks.shape[1] != cfg.seq_len or len(train_blocks) < 1:
        raise ValueError(f"train_blocks must be (N >= 1, seq_len={cfg.seq_len}), got "
                         f"{tuple(train_blocks.shape)}")
    if train_blocks.dtype != torch.long:
        raise ValueError(f"train_blocks must be int64 token ids, got {train_blocks.dtype}")
    if not (0 <= rank < world_size) or cfg.batch_size % world_size:
        raise ValueError(f"need 0 <= rank < world_size and batch_size ({cfg.batch_size}) "
                         f"divisible by world_size ({world_size}); got rank {rank}")
    mws = mixed_weights(student)
    if not mws:
        raise ValueError("the student has no gates; call voodoo.gates.install_gates first")
    shapes = {n: m.shape for n, m in mws.items()}
    bytes_table = {n: m.nbytes.tolist() for n, m in mws.items()}
    if budget is None:
        budget = budget_bytes(shapes, cfg.compression_ratio, cfg.target_bits,
                              cfg.budget_reduction)
    check_reachable(budget, bytes_table, shapes)

    device = torch.device(cfg.device)
    params = gate_parameters(student)
    gate_ids = {id(p) for p in params}
    for p in student.parameters():
        p.requires_grad_(id(p) in gate_ids)
    if cfg.gradient_checkpointing and enable_checkpointing(student):
        student.train()  # HF checkpoints only in training mode; Llama-style models have no dropout
    else:
        student.eval()
    if isinstance(teacher, nn.Module):
        teacher.eval()
        teacher_fn = lambda ids: _logits(teacher, ids)  # noqa: E731
    else:
        teacher_fn = teacher
    forward = student
    if cfg.compile and device.type == "cuda":
        forward = torch.compile(student)

    optimizer = torch.optim.Adam(params, lr=cfg.lr)
    journal = Path(output_dir) / JOURNAL_NAME if output_dir is not None else None
    step, history = 0, []
    if journal is not None and journal.exists():
        st = _load_journal(journal)
        check_journal_fits(journal, cfg, budget, st)
        try:
            load_gate_state(student, st["gates"])
            optimizer.load_state_dict(st["optimizer"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CorruptJournalError(f"{journal} does not fit this model ({e}). The file was "
                                      f"kept; delete it or pass a fresh output directory.") from e
        _set_rng_state(st["rng"])
        step, history = int(st["step"]), list(st["history"])
        if progress and rank == 0 and step < cfg.max_steps:
            log(f"resuming from {journal}: step {step} of {cfg.max_steps} done")
        elif progress and rank == 0:
            log(f"gate training already finished ({journal}: step {step} of "
                f"{cfg.max_steps}); its gates are reused (a fresh --output_dir trains anew)")
    else:
        start_gates(mws, cfg, budget, init_logits, student=student, teacher=teacher,
                    blocks=train_blocks)
        torch.manual_seed(cfg.seed)
        if journal is not None and rank == 0:
            journal.parent.mkdir(parents=True, exist_ok=True)

    def state() -> dict:
        """The journal's content now (copies: the optimizer's tensors change in place)."""
        return {"version": CONFIG_VERSION, "config": cfg.to_dict(), "step": step,
                "gates": gate_state(student), "optimizer": copy.deepcopy(optimizer.state_dict()),
                "rng": _rng_state(), "history": list(history), "budget_bytes": int(budget)}

    def save(obj: dict | None = None):
        if journal is None or rank != 0:
            return
        _save_journal(journal, obj if obj is not None else state())

    end = cfg.max_steps if stop_after is None else min(cfg.max_steps, stop_after)
    bar = None
    if progress and rank == 0 and step < end:
        from tqdm.auto import tqdm
        bar = tqdm(total=cfg.max_steps, initial=step, desc="gates", dynamic_ncols=True)
    # Ctrl-C between two journal saves: the state after the last completed step (kept in
    # memory, a few KB of gate logits and Adam moments) is written, so no finished step is lost
    saved_step, last = step, None
    try:
        while step < end:
            idx = batch_indices(step, len(train_blocks), cfg.batch_size, cfg.seed)
            idx = idx[rank::world_size]
            ids = train_blocks[idx].to(device)
            m = train_step(student, teacher_fn, ids, optimizer, params, cfg, budget,
                           temperature_at(step, cfg), grad_sync, forward)
            history.append(m)
            step += 1
            if step % cfg.partial_save_interval == 0 or step == end:
                save()
                saved_step = step
            elif journal is not None and rank == 0:
                last = state()
            if bar is not None:   # postfix first, then one redraw (one line a step in a log)
                bar.set_postfix(loss=f"{m['loss']:.4f}", kl=f"{m['kl']:.4f}",
                                size=f"{m['size_ratio']:.4f}", T=f"{m['temperature']:.3g}",
                                refresh=False)
                bar.update(1)
            if callback is not None:
                callback(step, m)
    except KeyboardInterrupt:
        if last is not None and last["step"] > saved_step:
            if bar is not None:
                bar.close()
                bar = None
            save(last)
            log(f"interrupted: the journal {journal} holds step {last['step']} of "
                f"{cfg.max_steps}; rerun the same command to continue from there")
        raise
    finally:
        if bar is not None:
            bar.close()
    with torch.no_grad():
        set_temperature(student, temperature_at(max(step - 1, 0), cfg))
        expected = float(model_expected_bytes(student))
    if progress and step > 0:
        off = abs(expected / budget - 1) > cfg.size_tolerance
        log(f"gate training: {step} steps; after the last update the soft gates' "
            f"expected size is {expected / budget:.4f} of the budget (the bar's size= is "
            "each step's before its update; the size penalty is zero within "
            f"±{cfg.size_tolerance:g}); bake then picks one type per tensor and lands the "
            "file within its tolerance of the budget"
            + (" (the soft gates' size is only a guide: nothing to fix here)" if off else ""))
    return TrainResult(gate_state(student), step, step >= cfg.max_steps, int(budget), expected,
                       history)
