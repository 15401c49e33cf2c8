"""One way for the Ray tests to get a local Ray: a 2-CPU ``ray.init`` unless Ray is already up
(then left alone), shut down afterwards only if this started it. And :func:`cpu_hog`, a loaded
machine for the tests that must hold on one."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import ray


@contextlib.contextmanager
def local_ray(num_cpus: int = 2):
    owned = not ray.is_initialized()
    if owned:
        ray.init(num_cpus=num_cpus, include_dashboard=False, address="local")
    try:
        yield
    finally:
        if owned and ray.is_initialized():
            ray.shutdown()


@contextlib.contextmanager
def cpu_hog(n: int | None = None, seconds: float = 240.0, nice: int = 0,
            until: str | os.PathLike | None = None, linger: float = 5.0):
    """Runs ``n`` (default: one per core) busy-looping Python processes for the body of the
    ``with``: a loaded machine, as on CI. Each stops by itself after ``seconds`` even if this
    process dies, and ``linger`` seconds after the file ``until`` appears (when given: keep the
    load over the moment under test, not over what follows); all are killed (by their pid)
    when the body ends. ``nice``: their niceness (0: compete with the test as equals; higher:
    they yield to it, but still take every idle cycle, so every wait in the test gets longer
    and scheduling less regular)."""
    n = n or os.cpu_count() or 2
    code = (f"import os, time\nos.nice({int(nice)})\nend = time.time() + {float(seconds)}\n"
            f"until = {None if until is None else str(until)!r}\ni = 0\n"
            f"while time.time() < end:\n"
            f"    i += 1\n"
            f"    if until and i % 20000 == 0 and os.path.exists(until):\n"
            f"        end = min(end, time.time() + {float(linger)})\n"
            f"        until = None\n")
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
