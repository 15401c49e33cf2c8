"""One way for the Ray tests to get a local Ray: a 2-CPU ``ray.init`` unless Ray is already up
(then left alone), shut down afterwards only if this started it."""

from __future__ import annotations

import contextlib

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
