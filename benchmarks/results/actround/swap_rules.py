import re, sys
from pathlib import Path
from voodoo.models import prepare_model, default_model
from voodoo.export import quantize_with_llama
from voodoo.evaluate import run_perplexity
W = Path("/tmp/voodoo-vs-stock"); out = Path("/tmp/act")
p = prepare_model(default_model())
text = out / "heldout.txt"
size = sys.argv[1]
types = (W / f"voodoo-{size}" / f"voodoo-{size}.tensor-types.txt").read_text()
# arm: name=rule;rule  rule: regex:from>to  (from '*' any)
for arm in sys.argv[2:]:
    name, rules = arm.split("=", 1)
    rules = [r.split(":") for r in rules.split(";")] if rules else []
    lines = []
    for ln in types.splitlines():
        n, t = ln.split("=", 1); t = t.strip().lower()
        for rx, ft in rules:
            f, to = ft.split(">")
            if re.search(rx, n) and (f == "*" or f == t):
                t = to
        lines.append(f"{n}={t}")
    tf = out / f"{size}-{name}.types.txt"; tf.write_text("\n".join(lines) + "\n")
    g = out / f"{size}-{name}.gguf"
    if not g.exists():
        quantize_with_llama(p.base_gguf, g, tensor_type_file=tf, imatrix_file=W / "imatrix.gguf", default_type="Q8_0")
    r = run_perplexity(g, text, ctx=512, chunks=20, kl_base=p.reference_gguf)
    print(size, name, g.stat().st_size, r["kld"], r.get("same_top_p"), flush=True)
