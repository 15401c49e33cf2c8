"""How OpenMP's wait policy changes torch's CPU speed, idle and on a shared machine.

Times a forward+backward of a SmolLM2-135M-shaped Llama (random weights, 30 layers, hidden 576,
1536 FFN, 49152 vocabulary, tied head) on ``--tokens`` tokens, the size of one gate-training
step's matmuls, in child processes under OpenMP wait policies: ``default`` (GNU libgomp's
own: a waiting thread spins 300,000 times before it sleeps), ``PASSIVE`` (no spinning),
``SPIN=N`` (``GOMP_SPINCOUNT=N``; ``import voodoo`` sets 10000 unless the user set a policy).
With ``--load N`` it first starts N busy processes (a pure-Python spin each) to stand for the
other jobs of a shared machine.

Prints the best and median seconds per step of each policy and the ratio of the first two,
measured in this one run. Usage::

    python benchmarks/omp_wait.py                # idle machine
    python benchmarks/omp_wait.py --load 3       # 3 busy processes beside it
    python benchmarks/omp_wait.py --load 3 --policies default,SPIN=10000,PASSIVE

Measured 2026-12-06 on the 2 cores (``--rounds 2 --steps 3``, ``--steps 2`` loaded): idle
3.29 / 3.05 / 3.34 s (default / SPIN=10000 / PASSIVE, best step); with ``--load 3`` 17.9 /
10.6 / 9.4 s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                  tie_word_embeddings=True)
m = LlamaForCausalLM(cfg)
ids = torch.randint(0, 49152, (1, int(sys.argv[1])))
def step():
    m.zero_grad(set_to_none=True)
    m(input_ids=ids, labels=ids).loss.backward()
step()
ts = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
print(json.dumps(ts))
"""


def _spin():
    while True:
        pass


def run(policy: str, tokens: int, steps: int) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy.startswith("SPIN="):  # libgomp's spin count before a waiting thread sleeps
        env["GOMP_SPINCOUNT"] = policy[5:]
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", CHILD, str(tokens), str(steps)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", type=int, default=0, help="busy processes to start beside it")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per policy and round")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the policies")
    ap.add_argument("--policies", default="default,SPIN=10000",
                    help="comma-separated: default (unset), PASSIVE, ACTIVE, SPIN=N "
                         "(GOMP_SPINCOUNT=N); the first two are compared")
    a = ap.parse_args()
    busy = [mp.Process(target=_spin, daemon=True) for _ in range(a.load)]
    for p in busy:
        p.start()
    try:
        times: dict[str, list[float]] = {p: [] for p in a.policies.split(",")}
        for _ in range(a.rounds):
            for pol in times:
                times[pol] += run(pol, a.tokens, a.steps)
    finally:
        for p in busy:
            p.terminate()
    print(f"forward+backward, SmolLM2-135M shape, {a.tokens} tokens, {os.cpu_count()} cores, "
          f"{a.load} busy processes beside it")
    for pol, ts in times.items():
        print(f"  {pol:12s} best {min(ts):6.2f} s  median "
              f"{statistics.median(ts):6.2f} s  ({len(ts)} steps)")
    p0, p1 = list(times)[:2]
    r_best = min(times[p0]) / min(times[p1])
    r_med = statistics.median(times[p0]) / statistics.median(times[p1])
    print(f"  {p0} / {p1}: best {r_best:.2f}x, median {r_med:.2f}x")


if __name__ == "__main__":
    main()
