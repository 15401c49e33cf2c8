"""Glue for ``ray job submit``: the command line that runs a Voodoo training as a Ray job.

The job's entrypoint is :mod:`cluster.train_entry` (a plain ``ray.init()`` inside joins the
cluster the job runs on). Keep the ``working_dir`` small (it is uploaded, capped at 512 MiB,
and honours ``.gitignore``/``.rayignore``): caches, weights and llama.cpp builds stay out of it;
Voodoo itself is installed on every node by the cluster's ``setup_commands``
(``ray-cluster.yaml``), so cython_ggml is built for each node's ABI.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys

__all__ = ["entrypoint", "submit_argv", "DASHBOARD_PORT"]

#: Ray's default dashboard / job-server port.
DASHBOARD_PORT = 8265


def entrypoint(train_args: list[str], python: str = "python") -> list[str]:
    """``python -m cluster.train_entry <train_args>`` (the job's entrypoint)."""
    return [python, "-m", "cluster.train_entry", *train_args]


def submit_argv(address: str, train_args: list[str], working_dir: str | os.PathLike = ".",
                runtime_env: dict | None = None, no_wait: bool = False,
                submission_id: str | None = None) -> list[str]:
    """The ``ray job submit`` command line for a training job.

    address: the head's job server, ``http://HEAD:8265``. train_args: flags for
    :mod:`cluster.train_entry`. runtime_env: e.g. ``{"env_vars": {...}}`` (JSON-encoded).
    Raises ValueError when ``address`` has no ``http(s)://`` scheme."""
    if not address.startswith(("http://", "https://")):
        raise ValueError(f"the job server address is http://HOST:{DASHBOARD_PORT}, got "
                         f"{address!r}")
    ray_exe = shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
    argv = [ray_exe, "job", "submit", "--address", address, "--working-dir", str(working_dir)]
    if runtime_env:
        argv += ["--runtime-env-json", json.dumps(runtime_env)]
    if submission_id:
        argv += ["--submission-id", submission_id]
    if no_wait:
        argv.append("--no-wait")
    return [*argv, "--", *entrypoint(train_args)]


if __name__ == "__main__":  # prints the command for the given train flags
    print(shlex.join(submit_argv(os.environ.get("RAY_JOB_ADDRESS",
                                                f"http://127.0.0.1:{DASHBOARD_PORT}"),
                                 sys.argv[1:])))
