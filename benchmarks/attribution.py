"""Attribution: what each ingredient of the method is worth, one change at a time, at a fixed
file size (``--match_size``, default IQ4_XS: the hardest row of issue 6).

Every variant is ``voodoo train --match_size T <flags>`` + ``voodoo export`` with the same
data, the same imatrix and the same seed; only the flags named in the variant differ from the
reference settings. Each file is scored by ``llama-perplexity -c 512 --kl-divergence`` against
the base on **held-out calibration text** (enwiki articles that neither the train nor the eval
blocks use: :func:`voodoo.data.write_heldout_text`), never on WikiText-2 test, so choosing
settings from this table is not tuning on the evaluation text.

    python benchmarks/attribution.py --out benchmarks/results/attribution [--match_size IQ4_XS]
        [--chunks 20] [--only name1,name2]

Writes ``results.json`` and ``results.md`` (one row per variant: bytes, mean KLD, 99.9% KLD,
same-top-p, the flags) to ``--out``; work files go to ``--work`` (default ``/tmp``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: name -> (flags, what it tests). "fisher-8" is the reference setting.
VARIANTS = {
    "budget-8": ("--gate_init budget --max_steps 8",
                 "previous method: bpw prior toward the budget, 8 steps"),
    "fisher-prior": ("--max_steps 1", "Fisher knapsack prior alone (1 step at T=1)"),
    "fisher-8": ("--max_steps 8", "reference: Fisher prior + 8 gate-training steps"),
    "fisher-24": ("--max_steps 24", "more steps"),
    "fisher-8-teacherF32": ("--max_steps 8 --teacher_quant F32",
                            "teacher F32 (= the base exactly) instead of BF16"),
    "fisher-8-teacherQ8_0": ("--max_steps 8 --teacher_quant Q8_0", "teacher Q8_0"),
    "fisher-8-lr0.2": ("--max_steps 8 --lr 0.2", "4x learning rate"),
    "fisher-8-kl0": ("--max_steps 8 --kl_weight 0", "lambda = 0 (CE only)"),
    "fisher-8-strength1": ("--max_steps 8 --gate_init_strength 1", "softer prior"),
    "fisher-8-tend0.2": ("--max_steps 8 --t_end 0.2", "temperature ends at 0.2, not 0.05"),
    "fisher-8-tol0": ("--max_steps 8 --size_tolerance 0",
                      "size penalty without a dead zone (pure quadratic)"),
    "fisher-8-imatrix4": ("--max_steps 8 --imatrix_blocks 4",
                          "imatrix from 4 calibration blocks, not 16 (Voodoo's file only)"),
    "fisher-prior-16blocks": ("--max_steps 1 --fisher_blocks 16", "Fisher from 16 blocks"),
    "fisher-prior-coarse": ("--max_steps 1 --candidate_types Q8_0,Q4_K,IQ3_S,IQ2_XXS",
                            "coarse menu (fallbacks for 576-wide rows: Q8_0, Q5_0, IQ4_NL)"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "attribution"))
    ap.add_argument("--work", default="/tmp/voodoo-attribution")
    ap.add_argument("--match_size", default="IQ4_XS")
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated variant names")
    a = ap.parse_args()
    from voodoo.cli import main as voodoo
    from voodoo.data import write_heldout_text
    from voodoo.evaluate import format_table, run_perplexity
    from voodoo.models import default_model, prepare_model
    from voodoo.runner import stock_file

    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model = str(default_model())
    prepared = prepare_model(model)
    names = [n.strip() for n in a.only.split(",") if n.strip()] or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"unknown variants {unknown}; choose from {list(VARIANTS)}", file=sys.stderr)
        return 2
    t = a.match_size.upper()
    data = work / "data"
    common = ["--model", model, "--data_dir", str(data), "--seed", "0"]
    res_path = out / "results.json"
    rows = json.loads(res_path.read_text())["rows"] if res_path.is_file() else []
    rows = [r for r in rows if r["variant"] not in names or r.get("match_size") != t]
    text = None
    for name in names:
        flags, what = VARIANTS[name]
        d = work / f"{t}-{name}"
        t0 = time.perf_counter()
        own_im = "--imatrix_blocks" in flags
        extra = ["--imatrix", str(work / "imatrix.gguf")] if (work / "imatrix.gguf").is_file() \
            and not own_im else []
        rc = voodoo(["train", *common, "--match_size", t, "--output_dir", str(d),
                     "--output_name", name, *extra,
                     *shlex.split(flags)])
        if rc:
            return rc
        if not (work / "imatrix.gguf").is_file():
            (work / "imatrix.gguf").write_bytes((d / "imatrix.gguf").read_bytes())
        im = d / "imatrix.gguf" if own_im else work / "imatrix.gguf"
        rc = voodoo(["export", *common, "--output_dir", str(d), "--imatrix", str(im),
                     "--assignment", str(d / f"{name}.assignment.json")])
        if rc:
            return rc
        secs = time.perf_counter() - t0
        if text is None:
            text = write_heldout_text(data, work / "heldout.txt", n_chars=60_000 * a.chunks // 10)
            stock = stock_file(prepared.base_gguf, t, im, work / "stock")
            r = run_perplexity(stock, text, ctx=512, chunks=a.chunks,
                               kl_base=prepared.reference_gguf)
            rows = [x for x in rows if x["variant"] != f"stock {t}"]
            rows.append({"variant": f"stock {t}", "match_size": t, "bytes": stock.stat().st_size,
                         "kld": r["kld"], "kld_p99_9": r.get("kld_p99_9"),
                         "same_top_p": r.get("same_top_p"), "flags": "", "what": "llama-quantize"})
        f = d / f"{name}.gguf"
        r = run_perplexity(f, text, ctx=512, chunks=a.chunks, kl_base=prepared.reference_gguf)
        rows.append({"variant": name, "match_size": t, "bytes": f.stat().st_size,
                     "kld": r["kld"], "kld_p99_9": r.get("kld_p99_9"),
                     "same_top_p": r.get("same_top_p"), "flags": flags, "what": what,
                     "train_export_seconds": round(secs, 1)})
        print(rows[-1], flush=True)
        res_path.write_text(json.dumps({"rows": rows, "chunks": a.chunks,
                                        "text": "held-out enwiki (write_heldout_text)"},
                                       indent=1))
    cols = ["variant", "match_size", "bytes", "kld", "kld_p99_9", "same_top_p", "flags", "what"]
    table = format_table(rows, cols)
    (out / "results.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
