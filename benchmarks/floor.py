"""How low can a quantized file's KLD go under the issue-14 protocol? The floor that llama.cpp's
own CPU arithmetic sets, measured against the same reference as every other benchmark here.

``llama-perplexity --kl-divergence`` compares a file with the *source GGUF run by llama.cpp*. On
the CPU backend a quantized matmul first rounds its activations to 8 bits (Q8_0 or Q8_1 for the
32-block weight types, Q8_K for the K- and IQ types; ggml-cpu's ``vec_dot_type``), so the
reference carries rounding noise of its own, and so does every file it is compared with. This
script measures, with llama-quantize from the model's F32 base (no imatrix; every type here is
8-bit or 6-bit, where the imatrix barely matters) and ``-c 512 --chunks N`` on WikiText-2 test:

- ``F32 base``: the exact weights, matmuls in F32 (no activation rounding on this side): what the
  reference's own rounding costs;
- ``Q8_0``: every tensor Q8_0 (llama-quantize's Q8_0 file type);
- ``Q8_0 + ffn_down <T>``: the same with one role at another type, to compare a role's measured
  increment with its Fisher-predicted KL (``--role``, ``--role_types``).

Writes ``results.json`` and ``results.md`` to ``--out``.

    python benchmarks/floor.py --out benchmarks/results/floor [--chunks 40]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "floor"))
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2 Q4_1)")
    ap.add_argument("--work", default="/tmp/voodoo-floor", help="quantized files (outside git)")
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--role", default="ffn_down", help="llama-quantize --tensor-type pattern")
    ap.add_argument("--role_types", default="Q6_K,Q4_K")
    ap.add_argument("--eval_text", default=str(REPO.parent / "shared" / "data" /
                                               "wikitext-2-raw-test.txt"))
    a = ap.parse_args()
    from voodoo.evaluate import run_perplexity
    from voodoo.export import quantize_with_llama
    from voodoo.models import default_model, prepare_model

    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    prepared = prepare_model(a.model or str(default_model()))
    files = {"F32 base": Path(prepared.base_gguf)}
    variants = {"Q8_0": ()}
    for t in (s.strip().upper() for s in a.role_types.split(",") if s.strip()):
        variants[f"Q8_0 + {a.role} {t}"] = ("--tensor-type", f"{a.role}={t.lower()}")
    for label, extra in variants.items():
        f = work / (label.replace(" + ", "_").replace(" ", "-") + ".gguf")
        if not f.is_file():
            quantize_with_llama(prepared.base_gguf, f, default_type="Q8_0", extra_args=extra)
        files[label] = f
    t0 = time.perf_counter()
    rows = []
    for label, f in files.items():
        r = run_perplexity(f, a.eval_text, ctx=a.ctx, chunks=a.chunks,
                           kl_base=prepared.reference_gguf)
        rows.append({"file": label, "bytes": f.stat().st_size, "ppl": r["ppl"],
                     "ppl_base": r.get("ppl_base"), "kld": r["kld"], "kld_err": r.get("kld_err"),
                     "same_top_p": r.get("same_top_p")})
        print(rows[-1], flush=True)
    (out / "results.json").write_text(json.dumps(
        {"rows": rows, "chunks": a.chunks, "ctx": a.ctx, "reference": Path(
            prepared.reference_gguf).name, "seconds": time.perf_counter() - t0}, indent=1))
    lines = [f"KLD against {Path(prepared.reference_gguf).name} (llama-perplexity -c {a.ctx} "
             f"--chunks {a.chunks} --kl-divergence, WikiText-2 test)", "",
             "| file | bytes | PPL | mean KLD | same top-p |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['file']} | {r['bytes']:,} | {r['ppl']:.3f} | {r['kld']:.4f} ± "
              f"{r['kld_err']:.4f} | {100 * r['same_top_p']:.1f}% |" for r in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
