"""Per-row (KL-weighted) Hessians for the output head's error-feedback rounding: experiment."""
import sys, time, json
import numpy as np
import torch

from voodoo.models import default_model
from voodoo.pipeline import load_context, head_inputs, base_weights
from voodoo.data import load_dataset_dir
from voodoo import rounding as R
import cython_ggml as cg

torch.set_num_threads(2)
QT = sys.argv[1] if len(sys.argv) > 1 else "Q5_0"
NTR = int(sys.argv[2]) if len(sys.argv) > 2 else 48
BETAS = [float(b) for b in (sys.argv[3] if len(sys.argv) > 3 else "0.1,1").split(",")]
NROWS = int(sys.argv[4]) if len(sys.argv) > 4 else 4096
t0 = time.time()
ctx = load_context(str(default_model()), with_tokenizer=False, check=False)
tr, ev, _ = load_dataset_dir("/tmp/vs-iq2/data")
cache = "/tmp/rowh/x.npz"
try:
    z = np.load(cache)
    xtr, xev = z["xtr"], z["xev"]
    assert xtr.shape[0] == NTR * tr.shape[1]
except Exception:
    xtr = head_inputs(ctx, tr[:NTR], max_tokens=NTR * tr.shape[1])
    xev = head_inputs(ctx, ev, max_tokens=ev.shape[0] * ev.shape[1])
    np.savez(cache, xtr=xtr, xev=xev)
print("head inputs", xtr.shape, xev.shape, time.time() - t0, flush=True)
W = base_weights(ctx.prepared.base_gguf, names=["token_embd.weight"])["token_embd.weight"]
W = np.ascontiguousarray(W, dtype=np.float32)
V, n = W.shape
T = xtr.shape[0]
# sparse p: top-K per token
K = 64
wt = torch.from_numpy(W)
xt = torch.from_numpy(xtr)
tok_idx, row_idx, pv = [], [], []
mass = torch.zeros(V, dtype=torch.float64)
cover = 0.0
for i in range(0, T, 512):
    p = torch.softmax(xt[i:i + 512] @ wt.T, -1)
    mass += p.sum(0, dtype=torch.float64)
    top = p.topk(K, dim=-1)
    cover += float(top.values.sum())
    tok_idx.append(torch.arange(i, i + p.shape[0]).repeat_interleave(K))
    row_idx.append(top.indices.reshape(-1))
    pv.append(top.values.reshape(-1))
tok_idx = torch.cat(tok_idx).numpy(); row_idx = torch.cat(row_idx).numpy(); pv = torch.cat(pv).numpy()
print(f"top-{K} mass cover {cover / T:.4f}", time.time() - t0, flush=True)
order = np.argsort(-mass.numpy())
cum = np.cumsum(mass.numpy()[order]) / T
for k in (256, 1024, 4096, 8192, 16384):
    print(f"top {k} rows hold {cum[k-1]:.4f} of the mass")
H = (xtr.T.astype(np.float64) @ xtr.astype(np.float64))
Hbar = H / T
imp = np.diag(H).astype(np.float32) / T
base_q = cg.quantize(W, QT, imatrix=imp, n_threads=2)


t1 = time.time()
u = R.inverse_hessian_cholesky(H)
g_q = R.gptq_columns(W, QT, imp, H, u=u)
print("global gptq", time.time() - t1, flush=True)
g_cd = R.refine_columns(W, g_q, QT, H, sweeps=4)
print("global gptq+cd", time.time() - t1, flush=True)

# row-sorted sparse structure
srt = np.argsort(row_idx, kind="stable")
row_s, tok_s, p_s = row_idx[srt], tok_idx[srt], pv[srt]
starts = np.searchsorted(row_s, np.arange(V + 1))
sel = order[:NROWS]
ts_, has_min, off_qh, off_qs, kind, (qlo, qhi) = R._LAYOUT[QT]
off = R._OFFSET.get(QT, 0)


def rows_gptq(rows, beta, damp=0.01, chunk=128):
    """Per-row-Hessian column GPTQ for `rows`; returns their bytes (len(rows), row_size)."""
    out = np.empty((len(rows), n // 32 * ts_), np.uint8)
    for c0 in range(0, len(rows), chunk):
        rr = rows[c0:c0 + chunk]
        Rn = len(rr)
        Hs = np.empty((Rn, n, n))
        for i, v in enumerate(rr):
            a, b = starts[v], starts[v + 1]
            xv = xtr[tok_s[a:b]].astype(np.float64)
            Hs[i] = (xv * p_s[a:b, None]).T @ xv + beta * mass[v].item() * Hbar
        Ht = torch.from_numpy(Hs)
        dg = torch.diagonal(Ht, dim1=-2, dim2=-1)
        dg += damp * dg.mean(-1, keepdim=True)
        L = torch.linalg.cholesky(Ht)
        Hinv = torch.cholesky_inverse(L)
        U = torch.linalg.cholesky(Hinv).transpose(-1, -2).numpy()  # upper, U^T U = Hinv
        wk = W[rr].astype(np.float64)
        for k, s in enumerate(range(0, n, 32)):
            e = s + 32
            ubb = U[:, s:e, s:e]
            cur = np.ascontiguousarray(wk[:, s:e], dtype=np.float32)
            ref = cg.quantize(cur, QT, imatrix=np.ascontiguousarray(imp[s:e]), n_threads=1)
            d = R._f16_at(ref, 0)
            m = R._f16_at(ref, 2) if has_min else np.zeros(Rn, np.float32)
            head = ref[:, :off_qs]
            dz = d == 0
            dsafe = np.where(dz, np.float32(1), d)
            nl = d[:, None] * R._IQ4NL[None, :] if kind == "nl" else None
            blk = wk[:, s:e]
            qv = np.empty((Rn, 32), np.int64)
            errs = np.empty((Rn, 32))
            for j in range(32):
                x = blk[:, j]
                if kind == "nl":
                    qi = np.abs(x[:, None].astype(np.float32) - nl).argmin(1)
                    dv = nl[np.arange(Rn), qi]
                else:
                    r = np.rint((x.astype(np.float32) - m) / dsafe)
                    qi = np.clip(r + off, qlo, qhi).astype(np.int64)
                    qi[dz] = off if not has_min else 0
                    dv = (qi - off).astype(np.float32) * d + m
                qv[:, j] = qi
                err = (x - dv) / ubb[:, j, j]
                errs[:, j] = err
                if j + 1 < 32:
                    blk[:, j + 1:] -= err[:, None] * ubb[:, j, j + 1:]
            if e < n:
                wk[:, e:] -= np.einsum("rb,rbc->rc", errs, U[:, s:e, e:])
            out[c0:c0 + Rn, k * ts_:(k + 1) * ts_] = R._encode_block(QT, head, qv)
    return out


cands = {"ggml": base_q, "gptq": g_q, "gptq+cd4": g_cd}
for beta in BETAS:
    t2 = time.time()
    q = g_cd.copy()
    q[sel] = rows_gptq(sel, beta)
    cands[f"rowH b={beta} (+cd4 rest)"] = q
    print("row gptq", beta, time.time() - t2, flush=True)
names = list(cands)
deqs = [np.asarray(cg.dequantize(cands[k], QT, n), dtype=np.float32) for k in names]
kls = R.logit_kl(W, deqs, xev)
kls_tr = R.logit_kl(W, deqs, xtr[:4096])
for k, a, b in zip(names, kls, kls_tr):
    print(f"{QT} {k:28s} held-out KL {a:.5f}   train KL {b:.5f}", flush=True)
np.savez("/tmp/rowh/cands_%s.npz" % QT, **{k.replace(' ', '_'): v for k, v in cands.items()})
print("total", time.time() - t0)
