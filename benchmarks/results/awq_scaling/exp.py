"""Exact per-channel scaling (AWQ-style, power-of-2 so the upstream writer's bytes are exactly
equivariant): for a reader tensor W (out x in) whose input channel j can be scaled by s_j with
the writer's row j scaled by 1/s_j, quantize W diag(s) and map back: W_eff = deq(Q(W S)) S^-1.
Held-out proxy tr(E H E^T) vs s = 1, for the pipeline's rounding (GPTQ + CD, and ggml bytes)."""
import sys, argparse, time
from pathlib import Path
import numpy as np
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/benchmarks")
import rounding as B
import cython_ggml
from voodoo import rounding as R

ap = argparse.ArgumentParser()
ap.add_argument("--model", default=str(Path("~/.cache/voodoo/rotated/SmolLM2-135M-Instruct-rot").expanduser()))
ap.add_argument("--work", default="/tmp/awq/work")
ap.add_argument("--fit_blocks", type=int, default=16)
ap.add_argument("--heldout_blocks", type=int, default=8)
ap.add_argument("--modules", default="down_proj,o_proj")
ap.add_argument("--layers", default="0,8,16,24,29")
ap.add_argument("--types", default="Q4_K,IQ4_XS,IQ3_S,IQ2_S,IQ4_NL,Q5_0")
ap.add_argument("--alphas", default="0.25,0.5,0.75")
a = ap.parse_args()
weights, blob = B.load_or_build(a)
layers = B.parse_layers(a.layers)
alphas = [float(x) for x in a.alphas.split(",")]
res = {}
for name, w in weights.items():
    L = int(name.split(".layers.")[1].split(".")[0])
    if L not in layers: continue
    hf, hh = blob["fit"][name], blob["held"][name]
    n = blob["n_fit"]
    rms = np.sqrt(np.diagonal(hf) / n)
    for t in a.types.split(","):
        if t in ("Q4_K","IQ4_XS","IQ3_S","IQ2_S","IQ2_XXS","Q3_K","Q5_K","Q6_K") and w.shape[1] % 256: continue
        out = {}
        for al in [0.0] + alphas:
            if al == 0:
                s = np.ones(w.shape[1])
            else:
                g = rms ** al
                g = g / np.exp(np.mean(np.log(g)))
                s = 2.0 ** np.round(np.log2(g))
            ws = (w * s[None, :]).astype(np.float32)
            S = s[:, None] * s[None, :]
            hfs, hhs = hf / S, hh / S
            imat = (np.diagonal(hfs) / n).astype(np.float32)
            for src in ("ggml", "fb"):
                if src == "ggml":
                    q = cython_ggml.quantize(ws, t, imatrix=imat, n_threads=1)
                else:
                    q = R.quantize_feedback(ws, t, imat, hfs, damp=0.05, sweeps=4)
                deq = cython_ggml.dequantize(q, t, w.shape[1], n_threads=1) / s[None, :]
                out[(al, src)] = R.proxy_error(w, deq, hh)
        base = min(out[(0.0, "ggml")], out[(0.0, "fb")])
        line = " ".join(f"a{al}:{src}={out[(al,src)]/base:.3f}" for (al, src) in out)
        print(f"{B.gguf_name(name)} {t} {line}", flush=True)
        res[(B.gguf_name(name), t)] = out
import pickle; pickle.dump(res, open("/tmp/awq/res.pkl", "wb"))
# summary: per type, total over tensors of best-of(s=1) vs best over alpha/src
for t in a.types.split(","):
    rr = [v for (nm, tt), v in res.items() if tt == t]
    if not rr: continue
    b0 = sum(min(v[(0.0, "ggml")], v[(0.0, "fb")]) for v in rr)
    for al in alphas:
        b1 = sum(min(v[(al, "ggml")], v[(al, "fb")]) for v in rr)
        bb = sum(min(min(v[(x, s)] for x in [0.0, al] for s in ("ggml","fb")), 1e99) for v in rr)
        print(f"{t} alpha {al}: total ratio {b1/b0:.3f}; per-tensor best of both {bb/b0:.3f} ({len(rr)} tensors)")
