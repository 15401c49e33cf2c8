"""How much per-step reporting costs a Ray Train run whose steps are short.

Ray Train V2 (2.60) gives each worker a result queue of size 1 that the controller drains
once per RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s), so ``ray.train.report`` made sooner than that
after the previous one blocks the worker. On a GPU a SmolLM2-size gate step takes 0.2 s, and
reporting every step made it 2 s a step (benchmarks/results/gpu_cli/run4). This runs the same
job (cluster.toy's tiny random Llama, one Ray Train worker, CPU) with ``report_every=1`` and
with ``"auto"`` (run_training's default: report every k steps, k the steps that take the
interval), in one process, and prints the wall times and their ratio.

    python benchmarks/ray_report.py [--steps 24] [--checkpoint_every 1000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--checkpoint_every", type=int, default=1000)
    a = ap.parse_args()
    import ray

    from cluster.session import ensure_ray
    from cluster.toy import TinyLlamaFactory
    from cluster.train import run_training
    from voodoo.train import TrainConfig
    ensure_ray(num_cpus=2, include_dashboard=False)
    cfg = TrainConfig(compression_ratio=0.7, max_steps=a.steps, seq_len=16, batch_size=2,
                      lr=0.1, partial_save_interval=a.checkpoint_every, t_end=0.2, seed=3)
    rows = []
    for every in (1, "auto"):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            res = run_training(TinyLlamaFactory(), cfg, num_workers=1, run_name=f"r{every}",
                               storage_path=d, report_every=every,
                               checkpoint_every=a.checkpoint_every)
            wall = time.perf_counter() - t0
        steps = sum(h["step_seconds"] for h in res.history)
        rows.append((every, wall, steps))
        print(f"report_every={every!s:>4}: {res.step} steps in {wall:6.1f} s (the steps "
              f"themselves {steps:5.2f} s)", flush=True)
    (_, w1, _), (_, wa, _) = rows
    print(f"wall time, report_every=1 / auto: {w1 / wa:.2f}x; the difference is "
          f"{(w1 - wa) / a.steps:.2f} s a step")
    ray.shutdown()


if __name__ == "__main__":
    main()
