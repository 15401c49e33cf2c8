"""How OpenMP's wait policy changes torch's CPU speed, idle and on a shared machine.

Times a forward+backward of a SmolLM2-135M-shaped Llama (random weights, 30 layers, hidden 576,
1536 FFN, 49152 vocabulary, tied head) on ``--tokens`` tokens, the size of one gate-training
step's matmuls, in child processes with ``OMP_WAIT_POLICY`` unset (GNU libgomp's default: a waiting thread
spins for a while before it sleeps) and set to PASSIVE (what ``import voodoo`` sets unless the
user set it). With ``--load N`` it first starts N busy
processes (a pure-Python spin each) to stand for the other jobs of a shared machine.

Prints the best and median seconds per step of each policy and the ratio default / PASSIVE,
measured in this one run. Usage::

    python benchmarks/omp_wait.py                # idle machine
    python benchmarks/omp_wait.py --load 3       # 3 busy processes beside it
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
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", CHILD, str(tokens), str(steps)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", type=int, default=0, help="busy processes to start beside it")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per policy and round")
    ap.add_argument("--rounds", type=int, default=2, help="default/PASSIVE alternations")
    a = ap.parse_args()
    busy = [mp.Process(target=_spin, daemon=True) for _ in range(a.load)]
    for p in busy:
        p.start()
    try:
        times: dict[str, list[float]] = {"default": [], "PASSIVE": []}
        for _ in range(a.rounds):
            for pol in times:
                times[pol] += run(pol, a.tokens, a.steps)
    finally:
        for p in busy:
            p.terminate()
    print(f"forward+backward, SmolLM2-135M shape, {a.tokens} tokens, {os.cpu_count()} cores, "
          f"{a.load} busy processes beside it")
    for pol, ts in times.items():
        print(f"  OMP_WAIT_POLICY={pol:7s} best {min(ts):6.2f} s  median "
              f"{statistics.median(ts):6.2f} s  ({len(ts)} steps)")
    r_best = min(times["default"]) / min(times["PASSIVE"])
    r_med = statistics.median(times["default"]) / statistics.median(times["PASSIVE"])
    print(f"  default / PASSIVE: best {r_best:.2f}x, median {r_med:.2f}x")


if __name__ == "__main__":
    main()
