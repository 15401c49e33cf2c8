"""Quantization throughput of cython_ggml per ggml type, single thread and all cores.

Prints million weights per second (Mw/s) for 1 thread and for N threads, and the parallel
efficiency (speed-up / N), all measured in this one run.

    python benchmarks/quant_throughput.py [--rows 512] [--cols 2048] [--threads N] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import cython_ggml as cg

TYPES = ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "Q3_K", "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_S",
         "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S", "IQ4_NL", "Q5_1", "Q5_0", "Q4_1", "Q4_0"]


def _time(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--types", nargs="*", default=TYPES)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((a.rows, a.cols)) * 0.05).astype(np.float32)
    im = (rng.random(a.cols) + 0.1).astype(np.float32)
    n = x.size / 1e6
    print(f"libggml-base: {cg.library_path()}")
    print(f"tensor {a.rows}x{a.cols} ({n:.2f} M weights), best of {a.repeat}, "
          f"{a.threads} threads\n")
    print(f"| type | 1 thread Mw/s | {a.threads} threads Mw/s | speed-up | efficiency |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for t in a.types:
        cg.quantize(x[:8], t, imatrix=im)  # grids initialised outside the timing
        t1 = _time(lambda: cg.quantize(x, t, imatrix=im, n_threads=1), a.repeat)
        tn = _time(lambda: cg.quantize(x, t, imatrix=im, n_threads=a.threads), a.repeat)
        s = t1 / tn
        print(f"| {t} | {n / t1:.2f} | {n / tn:.2f} | {s:.2f}x | {s / a.threads:.2f} |")


if __name__ == "__main__":
    main()
