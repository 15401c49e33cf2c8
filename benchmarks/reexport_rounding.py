"""The assignments of a finished ``vs_stock.py`` run re-exported with another candidate rounding
(same types, same sizes), and scored exactly as ``vs_stock.py`` scores: the rounding alone,
without retraining the gates.

    python benchmarks/reexport_rounding.py --model ~/.cache/voodoo/rotated/SmolLM2-135M-Instruct-rot \\
        --work /tmp/voodoo-vs-stock-rot --rounding gptq --hessian_blocks 16 \\
        --out benchmarks/results/vs_stock_rotated/gptq_reexport.json

``--hessians FILE`` copies an input-Hessian file (``hessians.npz`` of another run on the same
model and calibration blocks) into each run folder first, so they are not recomputed per size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--work", required=True, help="the vs_stock.py --work folder")
    ap.add_argument("--rounding", default="gptq", choices=["gptq", "auto", "ggml"])
    ap.add_argument("--hessian_blocks", type=int, default=16)
    ap.add_argument("--hessians", default=None)
    ap.add_argument("--stock", default="Q4_K_M,Q3_K_M,IQ4_XS,IQ2_M,IQ2_XXS")
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--eval_text", default=str(REPO.parent / "shared" / "data" /
                                               "wikitext-2-raw-test.txt"))
    ap.add_argument("--results", default=None,
                    help="vs_stock.py's results.json of that run: the as-trained and stock KLDs "
                         "are read from it instead of being measured again")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from voodoo.cli import main as voodoo
    from voodoo.evaluate import run_perplexity
    from voodoo.models import default_model, prepare_model
    model = a.model or str(default_model())
    prepared = prepare_model(model)
    work = Path(a.work)
    known = json.loads(Path(a.results).read_text())["rows"] if a.results else None
    rows = []
    for t in [s.strip().upper() for s in a.stock.split(",") if s.strip()]:
        d = work / f"voodoo-{t}"
        asg = d / f"voodoo-{t}.assignment.json"
        if not asg.is_file():
            print(f"{asg}: missing, skipped", file=sys.stderr)
            continue
        if a.hessians:
            shutil.copyfile(a.hessians, d / "hessians.npz")
        name = f"voodoo-{t}-{a.rounding}"
        rc = voodoo(["export", "--model", model, "--output_dir", str(d), "--data_dir",
                     str(work / "data"), "--imatrix", str(work / "imatrix.gguf"), "--seed", "0",
                     "--no_ray", "--assignment", str(asg), "--rounding", a.rounding,
                     "--hessian_blocks", str(a.hessian_blocks), "--output_name", name])
        if rc:
            return rc
        r = run_perplexity(d / f"{name}.gguf", a.eval_text, ctx=512, chunks=a.chunks,
                           kl_base=prepared.reference_gguf)
        if known:
            base = next(x for x in known if x["file"] == f"Voodoo@{t}")
            stock = next(x for x in known if x["file"] == f"stock {t}")
        else:
            base = run_perplexity(d / f"voodoo-{t}.gguf", a.eval_text, ctx=512,
                                  chunks=a.chunks, kl_base=prepared.reference_gguf)
            stock = run_perplexity(next((d / "stock").glob("*.gguf")), a.eval_text, ctx=512,
                                   chunks=a.chunks, kl_base=prepared.reference_gguf)
        rows.append({"target": t, "file": f"{name}.gguf",
                     "bytes": (d / f"{name}.gguf").stat().st_size, "kld": r["kld"],
                     "kld_p99_9": r.get("kld_p99_9"), "same_top_p": r.get("same_top_p"),
                     "ppl": r["ppl"], "as_trained_kld": base["kld"],
                     "vs_as_trained": r["kld"] / base["kld"], "stock_kld": stock["kld"],
                     "vs_stock": r["kld"] / stock["kld"]})
        print(rows[-1], flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"what": f"assignments of {work} re-exported with "
                                       f"--rounding {a.rounding} --hessian_blocks "
                                       f"{a.hessian_blocks}, llama-perplexity -c 512 --chunks "
                                       f"{a.chunks} --kl-divergence", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
