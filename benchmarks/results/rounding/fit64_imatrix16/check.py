# side check: ffn_down, imatrix from the 16 imatrix blocks (as Voodoo's pipeline), H from 64 blocks
import sys, numpy as np, torch, cython_ggml as g
sys.path.insert(0, "/work/main")
from voodoo import rounding as R
from transformers import AutoModelForCausalLM
b16 = torch.load("/tmp/voodoo-rounding/hessians_16_16.pt", weights_only=False)
b64 = torch.load("/tmp/voodoo-rounding64/hessians_64_16_down_proj.pt", weights_only=False)
m = AutoModelForCausalLM.from_pretrained("/root/.cache/voodoo/rotated/SmolLM2-135M-Instruct-rot", dtype=torch.float32)
mods = dict(m.named_modules())
types = ["Q4_0", "Q4_K", "IQ4_XS", "Q3_K", "IQ3_S", "IQ2_XXS"]
res = {t: [] for t in types}
for L in range(0, 30, 4):
    n = f"model.layers.{L}.mlp.down_proj"
    w = mods[n].weight.detach().numpy().astype(np.float32)
    im16 = (np.diagonal(b16["fit"][n]) / b16["n_fit"]).astype(np.float32)
    hh = b64["held"][n]
    u = R.inverse_hessian_cholesky(b64["fit"][n], 0.05)
    for t in types:
        base = R.proxy_error(w, g.dequantize(g.quantize(w, t, imatrix=im16, n_threads=1), t, w.shape[1]), hh)
        ours = R.proxy_error(w, g.dequantize(R.quantize_feedback(w, t, im16, b64["fit"][n], u=u), t, w.shape[1]), hh)
        res[t].append((base, ours))
print("ffn_down of layers 0,4,..,28; imatrix from 16 blocks; H for feedback from 64 blocks; held-out H (16 eval blocks)")
print("| type | median ratio | total ratio | tensors worse |")
print("| --- | ---: | ---: | ---: |")
for t, v in res.items():
    v = np.array(v)
    print(f"| {t} | {np.median(v[:,1]/v[:,0]):.3f} | {v[:,1].sum()/v[:,0].sum():.3f} | {(v[:,1] > v[:,0]).sum()} |")
