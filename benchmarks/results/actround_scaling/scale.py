# Torch check (not Voodoo code): Q8_K activation-rounding noise of ffn_down's input, as seen at
# ffn_down's output, with and without per-32-block power-of-2 channel scales (x/s in ffn_up's
# rows, W*s in ffn_down's 32-column blocks), on held-out calibration tokens (enwiki train blocks
# of runs/main; first half fits the scales, second half scores).
import torch
from voodoo.models import prepare_model, default_model, load_hf_model
from voodoo.actround import round_activations
prep = prepare_model(default_model()); model = load_hf_model(prep)
blocks = torch.load('/work/main/runs/main/data/train.pt')[:6]
xs = {}
for i, layer in enumerate(model.model.layers):
    layer.mlp.down_proj.register_forward_hook(
        lambda m, inp, out, i=i: xs.setdefault(i, []).append(inp[0].detach().reshape(-1, inp[0].shape[-1])))
with torch.no_grad():
    for b in blocks: model(b[None])
tot = {}
for i, layer in enumerate(model.model.layers):
    x = torch.cat(xs[i]); W = layer.mlp.down_proj.weight.detach(); n = x.shape[1]
    cw = W.square().sum(0); half = x.shape[0] // 2; xf, xh = x[:half], x[half:]
    a = xf.abs().reshape(half, n // 32, 32).amax(-1).pow(2).mean(0).sqrt()  # per 32-block
    res = {}
    def cost(cls, s=None):
        ss = torch.ones(n) if s is None else s.repeat_interleave(32)
        xx = xh / ss
        d = round_activations(xx, cls) - xx
        return float((d.square().mean(0) * cw * ss.square()).sum())
    res['q8_0'] = cost('Q8_0'); res['q8k'] = cost('Q8_K')
    for kmax in (1, 2, 3):
        sb = a.reshape(-1, 8)  # 8 sub-blocks per 256
        lo = sb.amin(1, keepdim=True)
        k = torch.clamp(torch.round(torch.log2(sb / lo)), 0, kmax)
        res[f'q8k_scale{kmax}'] = cost('Q8_K', (2.0 ** k).reshape(-1))
    for k_, v in res.items(): tot[k_] = tot.get(k_, 0) + v
    print(i, ' '.join(f'{k_}={v / res["q8k"]:.3f}' for k_, v in res.items()), flush=True)
print('TOTAL (ratio to Q8_K)', {k_: round(v / tot['q8k'], 3) for k_, v in tot.items()})
