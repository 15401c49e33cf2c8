"""A local Ray that ends with the Voodoo process that started it, however that process ends.

``ray.init()`` without an address (and no ``RAY_ADDRESS``) starts a local Ray: GCS server,
raylet, dashboard and runtime-env agents, and worker processes, all children of the driver.
How each way of ending the driver treats them (Ray 2.60, measured):

- normal exit, an exception, Ctrl-C (``KeyboardInterrupt``): ``ray.shutdown()`` runs (Ray
  registers it with ``atexit``) and stops them all;
- ``SIGTERM``/``SIGHUP`` (a closed terminal): Python's default action ends the process without
  ``atexit``; :func:`ensure_ray` turns them into ``SystemExit(128 + signal)`` (when no handler
  is set) so the shutdown runs;
- ``SIGKILL`` (or an OOM kill): nothing runs in the driver. GCS, raylet and the workers notice
  and exit within seconds, but the ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent``
  processes (children of the raylet) stay alive: still there a minute later, measured.
  :func:`ensure_ray` therefore starts a small **watchdog** process (``python -m
  cluster.session watch PID``) that follows the driver's process tree every 0.2 s and,
  once the driver is gone, sends SIGTERM, then SIGKILL after 3 s, to the processes it last saw
  in that tree (each checked by pid *and* start time, so a reused pid is never hit).

``ray stop`` is the manual way out: it finds **every** Ray process on the machine that it may
signal, by name and command line (raylet first, GCS last; all local clusters, other people's
runs included on a shared account), sends SIGTERM and SIGKILL to what is left after
``--grace-period`` (16 s), and removes the address file of the current cluster
(``/tmp/ray/ray_current_cluster``); ``ray stop --force`` sends SIGKILL at once. The watchdog
only touches the processes of the Ray that this driver started. A Ray that Voodoo joined
(``RAY_ADDRESS``, ``ray job submit``, a cluster started with ``ray start``) is never stopped by
Voodoo.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

__all__ = ["ensure_ray", "started_local_ray", "watch"]

_WATCHDOG: subprocess.Popen | None = None


def _descendants(pid: int) -> list:
    import psutil
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def started_local_ray() -> bool:
    """True when this process is the parent of a running ``raylet`` (it started a local Ray)."""
    return any(_name(p) == "raylet" for p in _descendants(os.getpid()))


def _name(p) -> str:
    try:
        return p.name()
    except Exception:  # noqa: BLE001 - a process that just ended
        return ""


def _is_ray(p) -> bool:
    """A process of Ray's (raylet, GCS, ``ray::`` workers and agents, Ray's Python helpers);
    other children of the driver (llama.cpp tools...) are left alone."""
    name = _name(p)
    if name in ("raylet", "gcs_server") or name.startswith("ray::"):
        return True
    try:
        cmd = p.cmdline()
    except Exception:  # noqa: BLE001
        return False
    return any(a.startswith("ray::") or f"{os.sep}ray{os.sep}" in a for a in cmd)


def _sigterm_to_exit(signum, frame):
    raise SystemExit(128 + signum)


def ensure_ray(**init_kwargs) -> bool:
    """``ray.init(**init_kwargs)`` unless Ray is up. When that started a local Ray, SIGTERM and
    SIGHUP are made to exit through ``ray.shutdown()`` (where the main thread has no handler) and
    a watchdog process stops the local Ray if this process is SIGKILLed (module docstring).
    Returns True when this call started a local Ray."""
    global _WATCHDOG
    import ray
    if ray.is_initialized():
        return False
    import threading
    main = threading.current_thread() is threading.main_thread()
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)} \
        if main else {}
    try:
        ray.init(**init_kwargs)
    except Exception as e:  # noqa: BLE001 -- re-raised, with the likely cause where known
        hint = auth_hint()
        if hint is None:
            raise
        raise ConnectionError(f"{str(e).strip() or type(e).__name__}; {hint}") from e
    # ray.init leaves C-level handlers of Ray's core worker on SIGTERM in the driver (a stack
    # dump, then abort: exit 134, no journal saved); the handlers Python had are put back
    for sig, h in before.items():
        if h is not None:
            signal.signal(sig, h)
    if not started_local_ray():
        return False
    if main:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _sigterm_to_exit)
    if _WATCHDOG is None or _WATCHDOG.poll() is not None:
        _WATCHDOG = subprocess.Popen(
            [sys.executable, "-m", "cluster.session", "watch", str(os.getpid())],
            stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                 *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])})
    return True


def auth_hint() -> str | None:
    """Why joining the cluster at ``RAY_ADDRESS`` may have failed when the client does not use
    token authentication (``RAY_AUTH_MODE`` unset): a head started with ``ray start --head``
    (Ray 2.60) requires it, and turns an unauthenticated client away with retries that end in
    "Failed to connect" or "ray client connection timeout", never naming the token. None
    without a ``RAY_ADDRESS`` (a local Ray) or with ``RAY_AUTH_MODE=token``."""
    addr = os.environ.get("RAY_ADDRESS", "").strip()
    if not addr or addr == "local" or os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return None
    return (f"if the cluster at RAY_ADDRESS={addr} uses token authentication (a head started "
            "with `ray start --head` does), set RAY_AUTH_MODE=token, with the head's token in "
            "~/.ray/auth_token or RAY_AUTH_TOKEN")


def check_address() -> None:
    """``RAY_ADDRESS`` that ``ray.init`` cannot join, refused before any work: ``host:port``
    (a GCS address, as ``ray start --head`` prints) or ``ray://host:port`` (Ray Client) where
    nothing answers (one TCP connect, 5 s; ``ray.init`` would retry forever, after every
    expensive stage), ``auto`` with no Ray running on this machine, and an ``http(s)://``
    address (the job server's, for ``ray job submit``, which ``ray.init`` rejects). ``local``
    (a new local Ray) passes, and so does an address that answers a plain HTTP request with
    anything but HTTP/1 (a GCS or Ray Client server answers in HTTP/2); one that answers
    HTTP/1 (the dashboard's port 8265 given without ``http://``, another web server) is
    refused. Raises ConnectionError naming the address and the way out."""
    import socket
    addr = os.environ.get("RAY_ADDRESS", "").strip()
    if not addr or addr == "local":
        return
    way_out = ("start one (`ray start --head`) or fix RAY_ADDRESS, or unset it to run on a "
               "local Ray")
    if addr == "auto":
        from ray._private.services import canonicalize_bootstrap_address_or_die
        try:
            canonicalize_bootstrap_address_or_die(addr)
        except ConnectionError:
            raise ConnectionError(f"RAY_ADDRESS=auto: no Ray is running on this machine; "
                                  f"{way_out}") from None
        return
    scheme, sep, rest = addr.partition("://")
    if sep and scheme in ("http", "https"):
        raise ConnectionError(
            f"RAY_ADDRESS={addr} is a job server's address (what `ray job submit --address` "
            "takes); Voodoo's commands join a cluster with ray.init, which needs its GCS "
            "address (host:6379, printed by `ray start --head`) or a Ray Client address "
            "(ray://host:10001); inside `ray job submit` jobs Ray sets it already")
    if sep and scheme != "ray":
        return
    host, _, port = (rest if sep else addr).rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        conn = socket.create_connection((host, int(port)), timeout=5)
    except OSError as e:
        raise ConnectionError(f"RAY_ADDRESS={addr}: no Ray cluster answers there ({e}); "
                              f"{way_out}") from None
    # A GCS (and a Ray Client server) speaks gRPC: to a plain HTTP/1 request it answers with
    # an HTTP/2 SETTINGS frame. A web server (the dashboard and job server on 8265 is the
    # usual slip) answers "HTTP/1.x ...", and ray.init would wait on it forever.
    try:
        conn.settimeout(3)
        conn.sendall(b"GET / HTTP/1.0\r\nHost: voodoo-probe\r\n\r\n")
        reply = conn.recv(64)
    except OSError:
        reply = b""
    finally:
        conn.close()
    if reply.startswith(b"HTTP/"):
        status = reply.split(b"\r")[0].decode(errors="replace")
        raise ConnectionError(
            f"RAY_ADDRESS={addr} answers HTTP ({status}): a web server such as Ray's "
            "dashboard and job server (port 8265 by default), not a Ray cluster's GCS, and "
            "ray.init would wait on it forever; give the GCS address (host:6379, printed by "
            "`ray start --head`) or a Ray Client address (ray://host:10001), or unset "
            "RAY_ADDRESS to run on a local Ray")


def _fits(nodes: list[dict], need: dict) -> int:
    """How many requests of ``need`` the nodes ``nodes`` (resource dicts) hold together, each on
    one node (a worker or trial is never split across nodes)."""
    import math
    return sum(min(math.floor(n.get(k, 0) / v + 1e-9) for k, v in need.items()) for n in nodes)


def _group_error(need: dict, count: int, fits: int, what: str, fix: str, where: str) -> str:
    return (f"{count} {what}s need {', '.join(f'{k} {v:g}' for k, v in need.items())} each, "
            f"and {where} holds {fits} such at once; Ray would wait for the rest forever "
            f"(Ray Train retries the worker group's start every minute); {fix}")


def check_feasible(need: dict, what: str, fix: str, count: int = 1,
                   count_fix: str | None = None) -> None:
    """Refuses a per-worker (or per-trial) resource request that no alive node of the connected
    cluster can ever hold, or a group of ``count`` such requests (a Ray Train worker group,
    started all at once) that the alive nodes cannot hold together: Ray would wait for it
    forever, printing 'infeasible' warnings. ``need``: e.g. ``{"CPU": 4, "GPU": 1}`` (zero
    entries ignored); ``what``: e.g. "one Ray Train worker"; ``fix``: the flags to change;
    ``count_fix``: those for a group too large (default ``fix``). Nodes' total resources are
    compared, not what other jobs leave free. ``VOODOO_ALLOW_PENDING=1`` skips the check (an
    autoscaling cluster that adds such nodes on demand). Raises ValueError."""
    import ray
    need = {k: float(v) for k, v in need.items() if v}
    if not need or os.environ.get("VOODOO_ALLOW_PENDING"):
        return
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if not nodes:
        return
    if not any(all(n.get(k, 0) >= v for k, v in need.items()) for n in nodes):
        best = {k: max(n.get(k, 0) for n in nodes) for k in need}
        raise ValueError(f"{what} needs {', '.join(f'{k} {v:g}' for k, v in need.items())}, "
                         f"and no node of this Ray cluster has that (the most on one node: "
                         f"{', '.join(f'{k} {v:g}' for k, v in best.items())}); {fix}, or add "
                         "such a node (an autoscaling cluster: VOODOO_ALLOW_PENDING=1 waits for "
                         "it)")
    fits = _fits(nodes, need)
    if count > fits:
        raise ValueError(_group_error(
            need, count, fits, what.removeprefix("one "), count_fix or fix,
            f"this Ray cluster ({len(nodes)} node{'s' * (len(nodes) > 1)})")
            + ", or add nodes (an autoscaling cluster: VOODOO_ALLOW_PENDING=1 waits for them)")


def running_local_cluster() -> str | None:
    """The address of a Ray that ``ray start`` began on this machine (Ray's
    ``/tmp/ray/ray_current_cluster``), which a plain ``ray.init()`` joins instead of starting
    a local Ray; None when there is none (or ``RAY_ADDRESS`` decides)."""
    if os.environ.get("RAY_ADDRESS", "").strip():
        return None
    try:
        from ray._private.services import find_bootstrap_address
        return find_bootstrap_address(None)
    except Exception:  # noqa: BLE001 - Ray's private helper moved: no pre-check then
        return None


def check_feasible_here(need: dict, what: str, fix: str, count: int = 1,
                        count_fix: str | None = None) -> None:
    """:func:`check_feasible` before Ray is up, for the local Ray a run without ``RAY_ADDRESS``
    starts: that Ray's one node has at most this machine's CPUs (``os.cpu_count()``) and the
    GPUs torch sees, so a larger per-worker (per-trial) request, or ``count`` of them that do
    not fit together, is refused before the data, imatrix and candidates instead of after them.
    With Ray already up in this process, its cluster's nodes are checked
    (:func:`check_feasible`); with ``RAY_ADDRESS`` set or a ``ray start`` cluster on this
    machine (which ``ray.init()`` joins: :func:`running_local_cluster`), that cluster is joined
    now (:func:`check_address`, :func:`ensure_ray`) and its nodes checked; with
    ``VOODOO_ALLOW_PENDING=1`` nothing is checked. Raises ValueError in :func:`check_feasible`'s
    form, ConnectionError when the cluster cannot be joined."""
    need = {k: float(v) for k, v in need.items() if v}
    if not need or os.environ.get("VOODOO_ALLOW_PENDING"):
        return
    import ray
    if ray.is_initialized():  # this process is on a cluster already: its nodes
        return check_feasible(need, what, fix, count, count_fix)
    if os.environ.get("RAY_ADDRESS", "").strip() or running_local_cluster():
        # join that cluster now: its nodes (and its token, if it asks for one) are checked
        # before the data, imatrix and candidates, not after them
        check_address()
        ensure_ray(address=os.environ.get("RAY_ADDRESS", "").strip() or None)
        return check_feasible(need, what, fix, count, count_fix)
    have = {"CPU": float(os.cpu_count() or 1)}
    if "GPU" in need:
        try:
            import torch
            have["GPU"] = float(torch.cuda.device_count())
        except ImportError:
            have["GPU"] = 0.0
    short = {k: v for k, v in need.items() if k in have and v > have[k]}
    if short:
        raise ValueError(f"{what} needs {', '.join(f'{k} {v:g}' for k, v in need.items())}, and "
                         f"the local Ray this run starts has "
                         f"{', '.join(f'{k} {have[k]:g}' for k in need if k in have)} (this "
                         f"machine's); {fix}, or set RAY_ADDRESS to a cluster that has such a "
                         "node")
    known = {k: v for k, v in need.items() if k in have}
    fits = _fits([have], known) if known else count
    if count > fits:
        raise ValueError(_group_error(
            known, count, fits, what.removeprefix("one "), count_fix or fix,
            f"the local Ray this run starts ({', '.join(f'{k} {have[k]:g}' for k in known)}: "
            "this machine's)") + ", or set RAY_ADDRESS to a larger cluster")


def watch(pid: int, interval: float = 0.2, grace: float = 3.0) -> int:
    """Follows the process tree of ``pid`` until ``pid`` ends, then stops what was last seen in
    it (SIGTERM, SIGKILL after ``grace`` seconds). Returns the number of processes stopped."""
    import psutil
    me = os.getpid()
    try:
        driver = psutil.Process(pid)
        born = driver.create_time()
    except psutil.Error:
        return 0
    seen: dict[int, float] = {}
    while True:
        try:
            alive = driver.is_running() and driver.create_time() == born and \
                driver.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        if not alive:
            break
        for p in _descendants(pid):
            if p.pid != me and p.pid not in seen and _is_ray(p):
                try:
                    seen[p.pid] = p.create_time()
                except psutil.Error:
                    pass
        time.sleep(interval)
    # the Ray processes' own children still alive now (e.g. a worker the raylet started after
    # the last sample): taken too, so none is orphaned by the sampling interval
    for p_id, t in list(seen.items()):
        try:
            for c in psutil.Process(p_id).children(recursive=True):
                if c.pid != me and c.pid not in seen and _is_ray(c):
                    seen[c.pid] = c.create_time()
        except psutil.Error:
            pass
    procs = []
    for p_id, t in seen.items():
        try:
            p = psutil.Process(p_id)
            if p.create_time() == t:
                procs.append(p)
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(procs, timeout=grace)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    return len(procs)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "watch":
        watch(int(sys.argv[2]))
        sys.exit(0)
    print("usage: python -m cluster.session watch PID", file=sys.stderr)
    sys.exit(2)
