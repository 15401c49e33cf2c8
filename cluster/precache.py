"""Candidate quantization over a Ray cluster: what Ray adds to ``voodoo.candidates``.

:func:`precache_ray` does what :func:`voodoo.candidates.precache_local` does, with a pool of
:class:`QuantizeActor` (``num_cpus=1`` each, one per CPU of the cluster by default). Each actor
loads libggml once (``import cython_ggml``) and holds the imatrix rows, put once in the object
store. Each tensor's weights are ``ray.put`` once, just before the first of its jobs is sent,
and freed after its last; tasks get them by reference (zero-copy, read-only). A task returns
the quantized rows as a ``pyarrow.Table`` (:func:`voodoo.candidates.to_arrow`, with the node id
in its metadata); the driver checks the rows' sha256 and the key, and writes the Arrow IPC file
(:meth:`CandidateCache.put`). With ``actors_write=True`` the actors write the files themselves
(the cache folder must then be shared storage seen at the same path by every node).

Scheduling is a small loop over ``ray.wait`` (not ``ray.util.ActorPool``, which keeps feeding a
failing actor, ray #50313): at most ``depth`` tasks in flight per actor; a task whose actor
died is re-sent to another actor and the dead actor replaced (bounded); a task that raised is
re-sent to a different actor up to ``max_retries`` times; jobs that still fail are reported
together in :class:`PrecacheError` after every other candidate has been written.

The bytes are libggml's either way: a candidate built here is identical to one built by
``precache_local`` (same key, same file name, same rows).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import ray

from voodoo.candidates import (CandidateCache, CandidateKey, CorruptCandidate, PrecacheResult,
                               _progress, _quantize_label, from_arrow, plan_precache,
                               quantize_candidate, to_arrow)

__all__ = ["QuantizeActor", "precache_ray", "PrecacheError", "n_quantize_workers"]

log = logging.getLogger(__name__)


class PrecacheError(RuntimeError):
    """Some candidates could not be built after retries. ``.failures`` maps
    ``(gguf_name, type_name)`` to the last error message; ``.result`` is the
    :class:`PrecacheResult` of everything else (all of it written to the cache)."""

    def __init__(self, failures: dict, result: PrecacheResult):
        self.failures, self.result = failures, result

        def short(e: str) -> str:
            e = str(e).strip().splitlines()[0] if str(e).strip() else str(e)
            return e if len(e) <= 160 else e[:157] + "..."
        oom = sum(1 for e in failures.values() if "OutOfMemoryError" in str(e))
        shown = [(k, e) for k, e in failures.items() if "OutOfMemoryError" not in str(e)
                 and "no live quantize actor" not in str(e)][:3]
        lines = "; ".join(f"{n} {t}: {short(e)}" for (n, t), e in shown)
        gone = sum(1 for e in failures.values() if "no live quantize actor" in str(e))
        msg = f"{len(failures)} candidate(s) failed after retries"
        if gone:
            msg = (f"{len(failures)} candidate(s) not built: every quantize actor died and "
                   f"the replacements ran out ({gone} never got one; Ray's log says why an actor "
                   "died: a killed process, lost node or memory). Run the same command again: "
                   "every candidate already built stays in the cache")
            if result is not None and len(failures) >= result.misses and \
                    os.environ.get("RAY_AUTH_MODE", "").lower() == "token" \
                    and os.environ.get("RAY_ADDRESS", "").strip():
                # not one built: a cluster without token authentication turns this token-
                # sending driver away ("Missing authorization header" in its log only)
                msg += (". Not one was built: if the cluster at RAY_ADDRESS does not use "
                        "token authentication, unset RAY_AUTH_MODE (Ray's driver log then "
                        "says \"Missing authorization header\")")
        if oom:
            msg += (f"; {oom} of them were killed by Ray's memory monitor (the node ran out of "
                    "memory, often because other jobs hold it): free memory, or quantize in this "
                    "process with --no_ray, and run the same command again; every candidate "
                    "already built stays in the cache")
        if lines:
            more = len(failures) - oom - gone - len(shown)
            msg += f"; {lines}" + (f" (and {more} more)" if more > 0 else "")
        if not oom and not gone:
            msg += ("; every candidate already built stays in the cache: the same command "
                    "retries the rest")
        super().__init__(msg)


@ray.remote
class QuantizeActor:
    """Quantizes candidates with libggml; one per CPU.

    Args:
        imatrix: ``{imatrix_sha256: float32 (n_per_row,)}`` (given as one ObjectRef, resolved
            by Ray, zero-copy).
        n_threads: libggml threads per tensor (match the actor's ``num_cpus``).
        cache_root: where to write when the driver asks the actor to (shared storage).
        worker: this actor's index (reported back).
    Raises (at start-up, surfacing as ``ActorDiedError`` on its tasks):
        cython_ggml.GGMLLibraryNotFound when libggml is not built on the node.
    """

    def __init__(self, imatrix: dict, n_threads: int = 1, cache_root: str | None = None,
                 worker: int = 0):
        import cython_ggml  # noqa: F401  load libggml once, here

        self.imatrix = imatrix
        self.n_threads = n_threads
        self.cache = CandidateCache(cache_root) if cache_root else None
        self.worker = worker
        self.node_id = ray.get_runtime_context().get_node_id()

    def info(self) -> dict:
        """``{"node_id", "pid", "worker"}``."""
        return {"node_id": self.node_id, "pid": os.getpid(), "worker": self.worker}

    def quantize(self, w: np.ndarray, gguf_name: str, key_meta: dict, write: bool = False,
                 hessian: np.ndarray | None = None):
        """Quantizes ``w`` (float32 (n_rows, n_per_row), read-only is fine) for the key
        ``key_meta`` (:meth:`CandidateKey.to_meta`).

        Returns:
            ``pyarrow.Table`` (:func:`to_arrow`; metadata adds ``node_id``, ``pid``,
            ``worker``, ``seconds``), or with ``write=True`` the same metadata as a dict after
            writing the file to the actor's cache.
        Raises:
            ValueError / TypeError from :func:`quantize_candidate`; KeyError for an imatrix
            row this actor was not given.
        """
        key = CandidateKey.from_meta(key_meta)
        im = None if key.imatrix_sha256 == "none" else self.imatrix[key.imatrix_sha256]
        t0 = time.perf_counter()
        if (hessian is None) != (key.rounding == "ggml"):
            raise ValueError(f"{gguf_name}: key rounding {key.rounding!r} but "
                             f"{'no' if hessian is None else 'a'} Hessian given")
        data = quantize_candidate(w, key.type_name, im, gguf_name, n_threads=self.n_threads,
                                  hessian=hessian)
        info = {"node_id": self.node_id, "pid": os.getpid(), "worker": self.worker,
                "seconds": f"{time.perf_counter() - t0:.6f}"}
        if write:
            if self.cache is None:
                raise RuntimeError("this actor has no cache_root to write to")
            p = self.cache.put(key, data, gguf_name)
            return {**key.to_meta(), **info, "gguf_name": gguf_name, "path": str(p)}
        return to_arrow(data, {**key.to_meta(), "gguf_name": gguf_name,
                               "type": key.type_name, **info})


def _resources(resources) -> dict[str, float]:
    if resources is None:
        return {}
    if isinstance(resources, str):
        return {resources: 1.0}
    return {str(k): float(v) for k, v in dict(resources).items()}


def n_quantize_workers(max_workers: int | None = None, resources=None) -> int:
    """How many :class:`QuantizeActor` to start: the cluster's CPUs (one actor per CPU),
    no more than the custom resource allows (``total / per-actor amount``), capped by
    ``$VOODOO_QUANT_WORKERS`` and ``max_workers``. Needs Ray initialized.

    Raises:
        ValueError: the cluster has no CPU or none of the requested custom resource.
    """
    total = ray.cluster_resources()
    n = int(total.get("CPU", 0))
    for name, amount in _resources(resources).items():
        have = total.get(name, 0.0)
        if have < amount:
            raise ValueError(f"no node offers the resource {name!r} (cluster has "
                             f"{sorted(k for k in total if not k.startswith('node:'))})")
        n = min(n, int(have // amount))
    env = os.environ.get("VOODOO_QUANT_WORKERS")
    cap = quant_workers_cap()
    if cap is not None:
        n = min(n, cap)
    if max_workers is not None:
        n = min(n, int(max_workers))
    if n < 1:
        raise ValueError(f"no CPU to quantize on (cluster resources {total}, "
                         f"VOODOO_QUANT_WORKERS={env}, max_workers={max_workers})")
    return n


def quant_workers_cap() -> int | None:
    """``$VOODOO_QUANT_WORKERS`` (the most quantization actors), None when unset. Raises
    ValueError for anything but a whole number >= 1 (checked by the CLI before any stage)."""
    env = os.environ.get("VOODOO_QUANT_WORKERS")
    if not env:
        return None
    if not env.strip().isdigit() or int(env) < 1:
        raise ValueError(f"VOODOO_QUANT_WORKERS={env!r}: give a whole number >= 1 (the "
                         "most quantization actors), or unset it for one per CPU")
    return int(env)


@dataclass
class _Slot:
    actor: object
    index: int
    inflight: int = 0
    alive: bool = True


@dataclass
class _Task:
    i: int  # index into todo
    attempts: int = 0
    avoid: set = field(default_factory=set)  # slot indices that failed it
    last_error: str = ""


def precache_ray(jobs: Iterable, cache: CandidateCache, max_workers: int | None = None,
                 resources: str | dict | None = None, progress: bool = True, *,
                 actors_write: bool = False, max_retries: int = 3, depth: int = 2,
                 verify: bool = True,
                 on_result: Callable[[dict, list], None] | None = None) -> PrecacheResult:
    """Quantizes every job not already cached on a Ray cluster; same result as
    :func:`voodoo.candidates.precache_local`.

    Joins or starts Ray when it is not initialized (:func:`cluster.session.ensure_ray` with
    ``address=$RAY_ADDRESS``, checked first: no address starts a local Ray, which stops with
    this process however it ends) and leaves it running.

    Args:
        jobs: list of ``(gguf_name, weights float32 (n_rows, n_per_row) GGUF layout,
            type_name, imatrix_row float32 (n_per_row,) | None)`` (or ``CandidateJob``).
        cache: the :class:`CandidateCache` to fill; with ``actors_write`` its folder must be
            shared storage at the same path on every node.
        max_workers: at most this many actors (see :func:`n_quantize_workers`).
        resources: custom resource each actor needs, to pin them to node types: a name
            (``"quant"`` -> 1 each) or ``{name: amount}``.
        progress: tqdm bar with ETA, and a one-line summary on stderr.
        actors_write: actors write the Arrow files themselves (saves moving the rows through
            the driver); the driver checks the files exist.
        max_retries: times a job is re-sent after a failure (actor death, task error, bad
            checksum) before it is given up.
        depth: tasks in flight per actor (2 overlaps a transfer with a quantization).
        verify: verify cached files before skipping them (see ``plan_precache``).
        on_result: called in the driver after each candidate is persisted, with its metadata
            (``gguf_name``, ``type``, ``node_id``, ``worker``, ...) and the list of live
            actor handles (monitoring; failure tests).

    Returns:
        :class:`PrecacheResult` ``{(gguf_name, type_name): CandidateKey}`` with ``.hits``,
        ``.misses`` and ``.stats`` (``seconds``, ``workers``, ``retries``, ``actor_deaths``,
        ``nodes`` = {node id: candidates built there}).

    Raises:
        ValueError / TypeError: bad jobs (before anything runs); ValueError for resources the
            cluster lacks.
        PrecacheError: some jobs still failed after ``max_retries`` (the rest are cached), or
            every actor died and the replacement budget is spent.
    """
    t0 = time.perf_counter()
    result, todo = plan_precache(jobs, cache, verify=verify)
    stats = result.stats
    stats.update(retries=0, actor_deaths=0, nodes={}, workers=0)
    if not todo:
        stats["seconds"] = time.perf_counter() - t0
        if progress:
            print(f"[voodoo precache] {result.summary()}", file=sys.stderr, flush=True)
        return result
    if not ray.is_initialized():
        from .session import check_address, ensure_ray
        check_address()  # a dead RAY_ADDRESS: ray.init would retry it forever
        ensure_ray(address=os.environ.get("RAY_ADDRESS") or None)

    res = _resources(resources)
    n_workers = min(n_quantize_workers(max_workers, resources), len(todo))
    stats["workers"] = n_workers
    imatrix = {k.imatrix_sha256: j.imatrix_row for j, k in todo if j.imatrix_row is not None}
    imatrix_ref = ray.put(imatrix)
    root = str(cache.root.resolve()) if actors_write else None

    slots: list[_Slot] = []
    replacements_left = max(2, n_workers)

    def spawn() -> None:
        i = len(slots)
        a = QuantizeActor.options(num_cpus=1, resources=res or None, max_restarts=0,
                                  max_task_retries=0).remote(imatrix_ref, 1, root, i)
        slots.append(_Slot(a, i))

    for _ in range(n_workers):
        spawn()

    # weights: put lazily, freed after the tensor's last job
    remaining = Counter(k.weights_sha256 for _, k in todo)
    wrefs: dict[str, ray.ObjectRef] = {}
    hrefs: dict[str, ray.ObjectRef] = {}  # the Hessian's sha (end of the tag) -> it, put once

    def release(sha: str) -> None:
        remaining[sha] -= 1
        if remaining[sha] == 0:
            wrefs.pop(sha, None)

    queue: deque[_Task] = deque(_Task(i) for i in range(len(todo)))
    inflight: dict[ray.ObjectRef, tuple[_Task, _Slot]] = {}
    failures: dict = {}
    nodes: Counter = Counter()
    bar = _progress(todo, f"{_quantize_label(todo)} ({n_workers} Ray actors)", progress)

    def fail(task: _Task, slot: _Slot | None, err: str) -> None:
        job, key = todo[task.i]
        task.attempts += 1
        task.last_error = err
        if slot is not None:
            task.avoid.add(slot.index)
        if task.attempts > max_retries:
            log.error("giving up %s %s after %d attempts: %s", job.gguf_name, key.type_name,
                      task.attempts, err)
            failures[(job.gguf_name, key.type_name)] = err
            release(key.weights_sha256)
            if bar is not None:
                bar.done(task.i, f"{job.gguf_name} {key.type_name} (given up)")
        else:
            stats["retries"] += 1
            log.warning("retrying %s %s (attempt %d): %s", job.gguf_name, key.type_name,
                        task.attempts + 1, err)
            queue.appendleft(task)

    def actor_died(slot: _Slot, err: Exception) -> None:
        nonlocal replacements_left
        if not slot.alive:
            return
        slot.alive = False
        stats["actor_deaths"] += 1
        log.warning("quantize actor %d died: %s", slot.index, err)
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:  # already gone
            pass
        if replacements_left > 0:
            replacements_left -= 1
            spawn()

    def pick(task: _Task) -> _Slot | None:
        live = [s for s in slots if s.alive and s.inflight < depth]
        if not live:
            return None
        fresh = [s for s in live if s.index not in task.avoid] or live
        return min(fresh, key=lambda s: (s.inflight, s.index))

    try:
        while queue or inflight:
            while queue:
                slot = pick(queue[0])
                if slot is None:
                    break
                task = queue.popleft()
                job, key = todo[task.i]
                sha = key.weights_sha256
                if sha not in wrefs:
                    wrefs[sha] = ray.put(np.ascontiguousarray(job.weights))
                href = None
                if job.hessian is not None:
                    hsha = key.rounding.rsplit(":", 1)[-1]  # types' tags differ, H is shared
                    if hsha not in hrefs:
                        hrefs[hsha] = ray.put(np.ascontiguousarray(job.hessian))
                    href = hrefs[hsha]
                ref = slot.actor.quantize.remote(wrefs[sha], job.gguf_name, key.to_meta(),
                                                 actors_write, href)
                slot.inflight += 1
                inflight[ref] = (task, slot)
            if not inflight:
                if queue:
                    raise PrecacheError({(todo[t.i][0].gguf_name, todo[t.i][1].type_name):
                                         t.last_error or "no live quantize actor"
                                         for t in queue} | failures, result)
                break
            done, _ = ray.wait(list(inflight), num_returns=1)
            for ref in done:
                task, slot = inflight.pop(ref)
                slot.inflight -= 1
                job, key = todo[task.i]
                try:
                    out = ray.get(ref)
                    meta = _check(out, key, cache, actors_write, job.gguf_name, verify)
                except ray.exceptions.RayActorError as e:
                    actor_died(slot, e)
                    fail(task, None, f"actor died: {type(e).__name__}")
                    continue
                except (ray.exceptions.RayError, CorruptCandidate, OSError) as e:
                    fail(task, slot, f"{type(e).__name__}: {_short(e)}")
                    continue
                nodes[meta.get("node_id", "?")] += 1
                release(key.weights_sha256)
                if bar is not None:
                    bar.done(task.i, f"{job.gguf_name} {key.type_name}")
                if on_result is not None:
                    on_result(meta, [s.actor for s in slots if s.alive])
    finally:
        if bar is not None:
            bar.close()
        for s in slots:
            try:
                ray.kill(s.actor, no_restart=True)
            except Exception:
                pass
        wrefs.clear()
        del imatrix_ref

    stats["nodes"] = dict(nodes)
    stats["seconds"] = time.perf_counter() - t0
    if failures:
        raise PrecacheError(failures, result)
    log.info("precache_ray: %s", result.summary())
    if progress:
        print(f"[voodoo precache] {result.summary()} on {n_workers} Ray actors over "
              f"{len(nodes)} node(s); {stats['retries']} retries", file=sys.stderr, flush=True)
    return result


def _short(e: Exception, n: int = 300) -> str:
    s = str(e).strip().splitlines()
    return (s[-1] if s else repr(e))[:n]


def _check(out, key: CandidateKey, cache: CandidateCache, actors_write: bool,
           gguf_name: str, verify: bool) -> dict:
    """Verifies one task's result and persists it; returns its metadata.

    Raises CorruptCandidate when the rows' checksum, the key or the shape disagree, or (with
    ``actors_write``) when the file the actor wrote is not visible to the driver."""
    if actors_write:
        meta = dict(out)
        if key not in cache:
            raise CorruptCandidate(f"actor wrote {meta.get('path')} but the driver does not "
                                   f"see {cache.path(key)}: is the cache on shared storage?")
        if verify and cache.get(key) is None:
            raise CorruptCandidate(f"{cache.path(key)} written by an actor does not verify")
        return meta
    data, meta = from_arrow(out, verify=True)
    if CandidateKey.from_meta(meta) != key:
        raise CorruptCandidate("an actor returned rows for another key")
    if data.shape != (key.n_rows, key.row_size):
        raise CorruptCandidate(f"rows of shape {data.shape}, expected "
                               f"{(key.n_rows, key.row_size)}")
    cache.put(key, data, gguf_name)
    return meta
