"""Error-feedback rounding (voodoo/rounding.py) vs llama-quantize's own bytes, by the layer's
output-error proxy ``tr(E H E^T)`` (``E = W - deq(Q)``, ``H = X^T X`` of the tensor's input).

For every linear tensor of the decoder layers and every type of its menu, four byte sources,
all with the same imatrix (diag(H)/tokens of the fit blocks, what llama-quantize weighs by):

- ``ggml``: ``cython_ggml.quantize`` of the whole tensor (llama-quantize's bytes);
- ``blocks``: :func:`voodoo.rounding.gptq_blocks` (libggml per column group, group error fed
  forward with the GPTQ/OBS update);
- ``blocks-nofb``: the same groups without the feedback (control: quantizing a group on its own
  changes libggml's per-row statistics; this isolates that);
- ``columns``: :func:`voodoo.rounding.gptq_columns` (32-block types: libggml's block scale,
  columns rounded one by one with feedback; bytes written by Voodoo).

``H`` and the imatrix come from ``--fit_blocks`` calibration blocks (enwiki train blocks, 512
tokens); the proxy is also measured with ``H`` of ``--heldout_blocks`` other calibration blocks
(the dataset's eval blocks: documents disjoint from the fit blocks), to check it is not
overfitting. Never WikiText.

    python benchmarks/rounding.py [--model DIR] [--layers 0-29] [--out benchmarks/results/rounding]
        [--layers_256 0,4,...] [--modules down_proj] [--fit_blocks 16] [--damp 0.05]
        [--no_control] [--kld_types Q4_0,IQ4_NL --kld_blocks 8]

``--kld_types`` also measures the whole model's mean KL(F32 || quantized) on held-out blocks
with every decoder linear of that type, ggml's bytes vs ``columns`` (torch, dequantized
weights; not llama.cpp).

Prints, per type and source, the ratio source/ggml of the proxy: median over tensors and total
(sum over tensors), on the fit H and on the held-out H; writes ``results.md`` and
``per_tensor.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: HF llama layout -> GGUF role, only to name rows of the table
_ROLE = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}
#: 32-block types (any row of a multiple of 32) and the 256-block ones (rows of a multiple of
#: 256 only: ffn_down of SmolLM2)
TYPES_32 = ["Q8_0", "Q5_1", "Q5_0", "IQ4_NL", "Q4_0"]
TYPES_256 = ["Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "Q3_K", "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_S",
             "IQ2_XXS", "IQ1_S"]


def gguf_name(hf: str) -> str:
    parts = hf.split(".")
    i = parts.index("layers")
    sub = ".".join(parts[i + 2:])
    return f"blk.{parts[i + 1]}.{_ROLE.get(sub, sub)}.weight"


@torch.no_grad()
def hessians(model, blocks: torch.Tensor, names: list[str]) -> tuple[dict, int]:
    """``X^T X`` (float64) of every module in ``names`` over ``blocks``; modules fed the same
    tensor (q/k/v, gate/up) share one array. Returns ({name: H}, tokens)."""
    mods = dict(model.named_modules())
    acc: dict[str, torch.Tensor] = {}
    alias: dict[str, str] = {}
    last = {"x": None, "name": None}

    def hook_for(name):
        def hook(_m, args):
            x = args[0]
            if last["x"] is x:          # same input tensor as the previous linear
                alias[name] = last["name"]
                return
            last["x"], last["name"] = x, name
            x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
            h = x2.T @ x2
            if name in acc:
                acc[name] += h.to(torch.float64)
            else:
                acc[name] = h.to(torch.float64)
        return hook

    hs = [mods[n].register_forward_pre_hook(hook_for(n)) for n in names]
    try:
        for b in blocks:
            last["x"] = None
            model(input_ids=b[None], use_cache=False)
    finally:
        for h in hs:
            h.remove()
    out = {n: acc[n] for n in acc}
    for n, a in alias.items():
        out[n] = out[a]
    return {n: out[n].numpy() for n in names}, int(blocks.numel())


def load_or_build(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from voodoo.data import build_dataset

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    if not (data / "meta.json").is_file():
        tok = AutoTokenizer.from_pretrained(args.model)
        build_dataset(tok, "enwiki", data, seq_len=512, n_train_blocks=args.fit_blocks,
                      n_eval_blocks=args.heldout_blocks, seed=0)
    fit = torch.load(data / "train.pt")[:args.fit_blocks]
    held = torch.load(data / "eval.pt")[:args.heldout_blocks]
    tag = "" if not args.modules else "_" + args.modules.replace(",", "+")
    cache = work / f"hessians_{args.fit_blocks}_{args.heldout_blocks}{tag}.pt"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    names = [n for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and ".layers." in f".{n}"
             and (not args.modules or any(k in n for k in args.modules.split(",")))]
    if cache.is_file():
        blob = torch.load(cache, weights_only=False)
    else:
        t0 = time.time()
        hf, nf = hessians(model, fit, names)
        hh, nh = hessians(model, held, names)
        blob = {"fit": hf, "held": hh, "n_fit": nf, "n_held": nh}
        torch.save(blob, cache)
        print(f"hessians of {len(names)} linears from {nf} + {nh} tokens: "
              f"{time.time() - t0:.0f} s", flush=True)
    weights = {n: dict(model.named_modules())[n].weight.detach().numpy().astype(np.float32)
               for n in names}
    return weights, blob


@torch.no_grad()
def whole_model_kld(args, variants: dict) -> dict:
    """{variant: mean KL(F32 || variant) per token} on the held-out blocks; ``variants``:
    {key: {module name: dequantized weight}}."""
    from transformers import AutoModelForCausalLM

    from voodoo.data import load_dataset_dir  # noqa: F401  (same folder as load_or_build)
    held = torch.load(Path(args.work) / "data" / "eval.pt")[:args.kld_blocks]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    mods = dict(model.named_modules())
    orig = {n: mods[n].weight.detach().clone() for v in variants.values() for n in v}
    tot = {k: 0.0 for k in variants}
    n = 0
    for b in held:
        for n_, w in orig.items():
            mods[n_].weight.copy_(w)
        lp = torch.log_softmax(model(input_ids=b[None], use_cache=False).logits[0].double(), -1)
        for k, ws in variants.items():
            for n_, w in orig.items():
                mods[n_].weight.copy_(torch.from_numpy(ws[n_]) if n_ in ws else w)
            lq = torch.log_softmax(model(input_ids=b[None], use_cache=False).logits[0].double(),
                                   -1)
            tot[k] += float((lp.exp() * (lp - lq)).sum())
        n += b.numel()
    return {k: v / n for k, v in tot.items()}


def parse_layers(s: str) -> set[int]:
    out = set()
    for part in s.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/voodoo/rotated/SmolLM2-135M-Instruct-rot"))
    ap.add_argument("--work", default="/tmp/voodoo-rounding")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "rounding"))
    ap.add_argument("--fit_blocks", type=int, default=16)
    ap.add_argument("--heldout_blocks", type=int, default=16)
    ap.add_argument("--layers", default="0-29")
    ap.add_argument("--layers_256", default="",
                    help="layers whose 256-block types are measured (default: --layers)")
    ap.add_argument("--modules", default="",
                    help="comma-separated substrings of the HF module names to measure "
                         "(e.g. down_proj); default all decoder linears")
    ap.add_argument("--types", default="", help="comma-separated subset of types")
    ap.add_argument("--damp", type=float, default=0.05,
                    help="fraction of mean(diag H) added to diag H (damp_sweep.md)")
    ap.add_argument("--importance", default="imatrix", choices=["imatrix", "hessian"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--kld_blocks", type=int, default=16, help="held-out blocks for --kld_types")
    ap.add_argument("--refine", type=int, default=0,
                    help="also measure columns+cd / ggml+cd (32-block types) and blocks+cd "
                         "(Q4_K, Q5_K, Q6_K): voodoo.rounding.refine_columns with this many "
                         "sweeps from the columns / ggml / blocks bytes")
    ap.add_argument("--no_control", action="store_true", help="skip the blocks-nofb control")
    ap.add_argument("--kld_types", default="",
                    help="comma-separated 32-block types: also measure the whole model's mean "
                         "KL(F32 || quantized) on the held-out blocks with every decoder linear "
                         "of that type, ggml's bytes vs columns (needs --layers 0-29)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import cython_ggml

    from voodoo import rounding as R

    t_start = time.time()
    weights, blob = load_or_build(args)
    layers = parse_layers(args.layers)
    layers_256 = parse_layers(args.layers_256) if args.layers_256 else layers
    only = {t.strip().upper() for t in args.types.split(",") if t.strip()}
    kld_types = [t.strip().upper() for t in args.kld_types.split(",") if t.strip()]
    kld_w: dict = {}
    rows = []
    for name, w in weights.items():
        layer = int(name.split(".layers.")[1].split(".")[0])
        if layer not in layers:
            continue
        hfit, hheld = blob["fit"][name], blob["held"][name]
        imat = (np.diagonal(hfit) / blob["n_fit"]).astype(np.float32)
        cols = w.shape[1]
        u = R.inverse_hessian_cholesky(hfit, args.damp)
        menu = TYPES_32 + (TYPES_256 if cols % 256 == 0 and layer in layers_256 else [])
        for t in menu:
            if only and t not in only:
                continue
            srcs = {"ggml": lambda: cython_ggml.quantize(w, t, imatrix=imat, n_threads=1),
                    "blocks": lambda: R.gptq_blocks(w, t, imat, hfit, u=u,
                                                    importance=args.importance),
                    "blocks-nofb": lambda: R.gptq_blocks(w, t, imat, hfit, u=u, feedback=False,
                                                         importance=args.importance)}
            if args.no_control:
                del srcs["blocks-nofb"]
            if t in R.COLUMN_TYPES:
                srcs["columns"] = lambda: R.gptq_columns(w, t, imat, hfit, u=u,
                                                         importance=args.importance)
                if args.refine:
                    srcs["columns+cd"] = lambda: R.refine_columns(
                        w, R.gptq_columns(w, t, imat, hfit, u=u, importance=args.importance),
                        t, hfit, damp=args.damp, sweeps=args.refine)
                    srcs["ggml+cd"] = lambda: R.refine_columns(
                        w, cython_ggml.quantize(w, t, imatrix=imat, n_threads=1), t, hfit,
                        damp=args.damp, sweeps=args.refine)
            elif args.refine and t in R.REFINE_TYPES:
                srcs["blocks+cd"] = lambda: R.refine_columns(
                    w, R.gptq_blocks(w, t, imat, hfit, u=u, importance=args.importance),
                    t, hfit, damp=args.damp, sweeps=args.refine)
            rec = {"tensor": gguf_name(name), "shape": list(w.shape), "type": t}
            for s, fn in srcs.items():
                t0 = time.time()
                q = fn()
                if not R.validate_rows(q, t):
                    raise SystemExit(f"{name} {t} {s}: ggml_validate_row_data rejects the bytes")
                deq = cython_ggml.dequantize(q, t, cols, n_threads=1)
                if t in kld_types and s in ("ggml", "columns"):
                    kld_w.setdefault((t, s), {})[name] = deq
                rec[s] = {"fit": R.proxy_error(w, deq, hfit),
                          "held": R.proxy_error(w, deq, hheld), "s": time.time() - t0}
            rows.append(rec)
        print(f"{gguf_name(name)} {tuple(w.shape)} done ({time.time() - t_start:.0f} s)",
              flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "per_tensor.json").write_text(json.dumps(rows, indent=0) + "\n")
    lines = ["# Error-feedback rounding vs llama-quantize's bytes: proxy tr(E H E^T)",
             "",
             f"model {args.model}; layers {args.layers} (256-block types: "
             f"{args.layers_256 or args.layers}); H and imatrix from {args.fit_blocks} "
             f"enwiki train blocks x 512 tokens ({blob['n_fit']} tokens); held-out H from "
             f"{args.heldout_blocks} enwiki eval blocks ({blob['n_held']} tokens, other "
             f"documents); damp {args.damp}; importance {args.importance}.",
             "",
             "ratio = source / ggml (< 1: the source's bytes have less output error); "
             "reduction = 1 - ratio. median: over tensors; total: sum over tensors / sum.",
             "",
             "| type | source | tensors | median ratio (fit H) | total ratio (fit H) | "
             "median ratio (held-out H) | total ratio (held-out H) | s/tensor |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    types = []
    for r in rows:
        if r["type"] not in types:
            types.append(r["type"])
    for t in types:
        rs = [r for r in rows if r["type"] == t]
        for s in ["blocks-nofb", "blocks", "blocks+cd", "columns", "columns+cd", "ggml+cd"]:
            rr = [r for r in rs if s in r]
            if not rr:
                continue
            cell = []
            for which in ("fit", "held"):
                ratio = np.array([r[s][which] / r["ggml"][which] for r in rr])
                tot = sum(r[s][which] for r in rr) / sum(r["ggml"][which] for r in rr)
                cell += [f"{np.median(ratio):.3f}", f"{tot:.3f}"]
            sec = np.mean([r[s]["s"] for r in rr])
            lines.append(f"| {t} | {s} | {len(rr)} | {' | '.join(cell)} | {sec:.2f} |")
    # per role at the best source of each type (held-out total)
    lines += ["", "Per role, held-out H, total ratio of `columns` (32-block types) or `blocks`:",
              ""]
    roles = []
    for r in rows:
        role = r["tensor"].split(".")[2]
        if role not in roles:
            roles.append(role)
    lines.append("| type | " + " | ".join(roles) + " |")
    lines.append("| --- |" + " ---: |" * len(roles))
    for t in types:
        s = "columns" if t in R.COLUMN_TYPES else "blocks"
        cells = []
        for role in roles:
            rr = [r for r in rows if r["type"] == t and r["tensor"].split(".")[2] == role]
            cells.append(f"{sum(r[s]['held'] for r in rr) / sum(r['ggml']['held'] for r in rr):.3f}"
                         if rr else "")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    if kld_w:
        lines += ["", "Whole model, every decoder linear of one type (head and embedding F32), "
                  f"mean KL(F32 || quantized) per token on {args.kld_blocks} held-out "
                  "blocks:", "", "| type | ggml bytes | columns bytes | ratio |",
                  "| --- | ---: | ---: | ---: |"]
        kl = whole_model_kld(args, kld_w)
        for t in kld_types:
            a, b = kl[(t, "ggml")], kl[(t, "columns")]
            lines.append(f"| {t} | {a:.5f} | {b:.5f} | {b / a:.3f} |")
        (out / "kld.json").write_text(json.dumps({f"{t}/{s}": v for (t, s), v in kl.items()})
                                      + "\n")
    lines += ["", f"wall time {time.time() - t_start:.0f} s", ""]
    text = "\n".join(lines)
    print(text)
    (out / "results.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
