"""Diagnostic: does moving ffn_down from Q4_K (Q8_K activations) to a 32-block type of the same
bpw (Q8_0 activations, as the Q4_1 reference's Q8_1) lower the measured KLD? llama-quantize bytes
(stock rounding, same imatrix) for every arm, held-out enwiki text."""
import sys, json
from pathlib import Path
from voodoo.models import prepare_model
from voodoo.export import quantize_with_llama
from voodoo.evaluate import run_perplexity
from voodoo.data import write_heldout_text
W = Path("/tmp/voodoo-vs-stock"); out = Path("/tmp/act")
from voodoo.models import default_model
p = prepare_model(default_model() if sys.argv[1] == "default" else sys.argv[1])
text = write_heldout_text(W / "data", out / "heldout.txt", n_chars=120_000)
types = (W / "voodoo-Q4_K_M" / "voodoo-Q4_K_M.tensor-types.txt").read_text()
arms = {"control": lambda n, t: t}
for new in sys.argv[2:] if len(sys.argv) > 2 else ["IQ4_NL", "Q4_0"]:
    arms[new] = (lambda new: lambda n, t: new if "ffn_down" in n and t == "q4_k" else t)(new)
res = {}
for arm, f in arms.items():
    lines = []
    for ln in types.splitlines():
        if "=" in ln:
            n, t = ln.split("=", 1); lines.append(f"{n}={f(n, t.strip().lower())}")
        else: lines.append(ln)
    tf = out / f"{arm}.types.txt"; tf.write_text("\n".join(lines) + "\n")
    g = out / f"{arm}.gguf"
    if not g.exists():
        quantize_with_llama(p.base_gguf, g, tensor_type_file=tf, imatrix_file=W / "imatrix.gguf", default_type="Q8_0")
    r = run_perplexity(g, text, ctx=512, chunks=20, kl_base=p.reference_gguf)
    res[arm] = (g.stat().st_size, r["kld"], r.get("same_top_p"))
    print(arm, res[arm], flush=True)
json.dump(res, open(out / "res.json", "w"), indent=1)
