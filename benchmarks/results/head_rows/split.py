"""KL split of a token_embd candidate: input use only, head use only, both (torch, eval blocks)."""
import sys
import numpy as np
import torch
import cython_ggml as cg
from voodoo.models import default_model
from voodoo.pipeline import load_context
from voodoo.data import load_dataset_dir

torch.set_num_threads(2)
QT, keys = sys.argv[1], sys.argv[2].split(",")
ctx = load_context(str(default_model()), with_tokenizer=False, check=False)
m = ctx.model
tr, ev, _ = load_dataset_dir("/tmp/vs-iq2/data")
z = np.load(sys.argv[3])
emb = m.get_input_embeddings()
head = m.get_output_embeddings()
W0 = emb.weight.detach().clone()
# untie
head.weight = torch.nn.Parameter(W0.clone())


@torch.no_grad()
def logits():
    return [m(input_ids=ev[i:i + 1], use_cache=False).logits.float().log_softmax(-1) for i in range(len(ev))]


ref = logits()


@torch.no_grad()
def kl():
    out = logits()
    return float(np.mean([(r.exp() * (r - o)).sum(-1).mean() for r, o in zip(ref, out)]))


# GGUF token_embd rows are HF rows in the same order (checked by voodoo's tensor map)
for k in keys:
    d = torch.from_numpy(np.asarray(cg.dequantize(z[k], QT, W0.shape[1]), dtype=np.float32))
    emb.weight.data.copy_(d); head.weight.data.copy_(W0)
    a = kl()
    emb.weight.data.copy_(W0); head.weight.data.copy_(d)
    b = kl()
    emb.weight.data.copy_(d); head.weight.data.copy_(d)
    c = kl()
    emb.weight.data.copy_(W0); head.weight.data.copy_(W0)
    print(f"{QT} {k:30s} input-only {a:.5f} head-only {b:.5f} both {c:.5f}", flush=True)
