"""EvoPress-style (1+lambda) refinement of a baked assignment, scored by llama.cpp's KLD on
calibration text (feasibility experiment, not in the repo).

python /tmp/evo/evo.py --work /tmp/vs-evo --stock IQ2_XXS --gens 12
"""
import argparse, json, math, random, sys, time, copy
from pathlib import Path

sys.path.insert(0, "/work/main")

ap = argparse.ArgumentParser()
ap.add_argument("--work", default="/tmp/vs-evo")
ap.add_argument("--stock", default="IQ2_XXS")
ap.add_argument("--model", default=None)
ap.add_argument("--gens", type=int, default=12)
ap.add_argument("--lam", type=int, default=4)
ap.add_argument("--small", type=int, default=6)
ap.add_argument("--big", type=int, default=16)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--train_args", default="--no_ray --rounding auto --hessian_blocks 48")
g = ap.parse_args()
random.seed(g.seed)

from voodoo import cli
from voodoo.cli import (ArgumentParser, HelpFormatter, Run, _model_flags, _data_flags, _menu_flags,
                        _parse_keeping_run_data, _assignment_run_folder, _read_assignment,
                        _use_assignment_rounding, _use_assignment_imatrix, _cache, _precache_fn)
from voodoo.pipeline import ensure_candidates, export, FILL_MARGIN_BASE
from voodoo.evaluate import run_perplexity, kld_base
from voodoo.quants import fallback_type

work = Path(g.work)
d = work / f"voodoo-{g.stock}"
asg_path = d / f"voodoo-{g.stock}.assignment.json"
from voodoo.models import default_model
model = g.model or str(default_model())
argv = ["--model", model, "--output_dir", str(d), "--data_dir", str(work / "data"),
        "--imatrix_blocks", "16", "--seed", "0", "--imatrix", str(work / "imatrix.gguf"),
        "--assignment", str(asg_path)]
ap2 = ArgumentParser(formatter_class=HelpFormatter, prog="x")
_model_flags(ap2, "x"); _data_flags(ap2); _menu_flags(ap2, menus=False)
ap2.add_argument("--assignment")
a = _parse_keeping_run_data(ap2, argv, adopt=lambda a: _assignment_run_folder(a) or True)
r = Run(a)
r.context()
asg = _read_assignment(a.assignment)
_use_assignment_rounding(a, asg, r)
_use_assignment_imatrix(a, asg, r)
r.data()
r.imatrix()
menus = {n: list(v["menu"]) for n, v in asg["tensors"].items()}
r.cache = _cache(a)
keys = ensure_candidates(r.ctx, menus, r.im, r.cache, _precache_fn(a),
                         hessians=getattr(r, "hessians", None), feedback=r.feedback_for(menus))
shapes = r.ctx.shapes
sens = json.loads((d / "train" / "sensitivity.json").read_text())["tensors"]

# options per tensor: distinct fallback types sorted by bytes
opts = {}
for n, v in asg["tensors"].items():
    n_rows, n_per_row = shapes[n] if n in shapes else (None, None)
    seen = {}
    for k, t in enumerate(v["menu"]):
        q = fallback_type(t, n_per_row)
        b = n_rows * q.row_nbytes(n_per_row)
        c = sens[n]["dkl"][k]
        if q.name not in seen or c < seen[q.name][2]:
            seen[q.name] = (t, b, c)
    opts[n] = sorted(seen.values(), key=lambda x: x[1])
names = sorted(opts)


def idx_of(n, t):
    q = fallback_type(t, shapes[n][1]).name
    for i, o in enumerate(opts[n]):
        if fallback_type(o[0], shapes[n][1]).name == q:
            return i
    raise KeyError


parent = {n: idx_of(n, asg["tensors"][n]["type"]) for n in names}
total = lambda s: sum(opts[n][s[n]][1] for n in names)
ceiling = asg["budget_bytes"] - FILL_MARGIN_BASE - 32 * len(names)
print("parent bytes", total(parent), "ceiling", ceiling, "budget", asg["budget_bytes"], flush=True)
floor = ceiling - int(0.003 * asg["budget_bytes"])

# scoring text: decoded train blocks (calibration; never the evaluation text)
txt = work / "evo-calib.txt"
if not txt.exists():
    txt.write_text("\n".join(r.ctx.tokenizer.decode(b) for b in r.train_blocks[:g.big]))
ref = r.ctx.prepared.reference_gguf
bases = {c: kld_base(ref, txt, ctx=512, chunks=c)["path"] for c in (g.small, g.big)}
outdir = Path("/tmp/evo/files"); outdir.mkdir(parents=True, exist_ok=True)


def to_asg(s):
    a2 = copy.deepcopy(asg)
    for n in names:
        t, b, c = opts[n][s[n]]
        a2["tensors"][n]["type"] = t
        a2["tensors"][n]["bytes"] = b
    a2["total_bytes"] = total(s)
    return a2


def score(s, chunks, tag):
    t0 = time.time()
    p = export(r.ctx, to_asg(s), keys, r.cache, outdir / f"{tag}.gguf")
    t1 = time.time()
    res = run_perplexity(p, txt, ctx=512, kl_base=bases[chunks])
    print(f"  {tag}: kld {res['kld']:.5f} ({chunks} chunks; export {t1-t0:.0f}s, ppl {time.time()-t1:.0f}s)", flush=True)
    p.unlink()
    return res["kld"]


def mutate(s):
    c = dict(s)
    # upgrade: sample by predicted gain per byte (prior), softmax with a broad temperature
    ups = []
    for n in names:
        i = c[n]
        if i + 1 < len(opts[n]):
            db = opts[n][i + 1][1] - opts[n][i][1]
            dc = opts[n][i + 1][2] - opts[n][i][2]
            ups.append((n, -dc / db))
    vals = [v for _, v in ups]
    tau = (sorted(vals)[len(vals) * 3 // 4] - sorted(vals)[len(vals) // 4]) or 1e-12
    mx = max(vals)
    w = [math.exp((v - mx) / tau) for v in vals]
    u = random.choices([n for n, _ in ups], weights=w)[0]
    c[u] += 1
    moved = {u}
    while total(c) > ceiling:
        downs = []
        for n in names:
            if n in moved or c[n] == 0:
                continue
            i = c[n]
            db = opts[n][i][1] - opts[n][i - 1][1]
            dc = opts[n][i - 1][2] - opts[n][i][2]
            downs.append((n, -dc / db))
        vals = [v for _, v in downs]
        tau = (sorted(vals)[len(vals) * 3 // 4] - sorted(vals)[len(vals) // 4]) or 1e-12
        mx = max(vals)
        w = [math.exp((v - mx) / tau) for v in vals]
        dn = random.choices([n for n, _ in downs], weights=w)[0]
        c[dn] -= 1
        moved.add(dn)
    return c, sorted(moved)


pbig = score(parent, g.big, "parent-big")
psmall = score(parent, g.small, "parent-small")
log = []
t_start = time.time()
for gen in range(g.gens):
    kids = []
    tries = 0
    while len(kids) < g.lam and tries < 200:
        tries += 1
        c, moved = mutate(parent)
        if total(c) >= floor:
            kids.append((c, moved))
    scored = []
    for j, (c, moved) in enumerate(kids):
        desc = ", ".join(f"{n}:{opts[n][parent[n]][0]}->{opts[n][c[n]][0]}" for n in moved)
        print(f"gen {gen} kid {j}: {desc} bytes {total(c)}", flush=True)
        scored.append((score(c, g.small, f"g{gen}k{j}"), c, desc))
    best = min(scored, key=lambda x: x[0])
    entry = {"gen": gen, "parent_small": psmall, "kids": [(s, dsc) for s, _, dsc in scored]}
    if best[0] < psmall:
        kb = score(best[1], g.big, f"g{gen}big")
        entry["best_big"] = kb
        if kb < pbig:
            parent, pbig = best[1], kb
            psmall = best[0]
            entry["accepted"] = best[2]
            print(f"gen {gen}: ACCEPT {best[2]}  big {kb:.5f}", flush=True)
    log.append(entry)
    Path("/tmp/evo/log.json").write_text(json.dumps({"log": log, "parent": {n: opts[n][parent[n]][0] for n in names}, "pbig": pbig}, indent=1))
    print(f"gen {gen} done: parent big {pbig:.5f} small {psmall:.5f} ({time.time()-t_start:.0f}s)", flush=True)

a2 = to_asg(parent)
Path(f"/tmp/evo/evolved-{g.stock}.assignment.json").write_text(json.dumps(a2, indent=1))
print("wrote evolved assignment")
