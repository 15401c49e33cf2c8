"""Lazy candidates under tensor parallelism (issue 11, item 6): each rank holds and
dequantizes only its shard's ggml blocks (rows for a column split, whole blocks of columns for a
row split), and two gloo ranks give the logits and gate gradients of one process holding the
dense, libggml-dequantized candidates. No Ray: torch.multiprocessing + gloo on the CPU."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

#: Block size 32 each: row-parallel shards of 64 columns (hidden 128 / TP 2) cut between blocks.
TYPES = ("Q8_0", "Q5_1", "Q4_0", "IQ4_NL")
IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(9))


def _build(lazy: bool):
    """A tiny random Llama (hidden 128, 8/4 heads) gated over libggml's quantizations of its own
    weights: dense dequantized candidates, or (``lazy``) their bytes; random gate logits."""
    import cython_ggml as cg
    from transformers import LlamaConfig, LlamaForCausalLM

    from voodoo.arch import get_adapter
    from voodoo.gates import install_gates
    from voodoo.lazy import QuantizedCandidates
    from voodoo.quants import tensor_nbytes
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
                      tie_word_embeddings=True, max_position_embeddings=64,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    adapter = get_adapter(cfg)
    specs = adapter.selectable(model)
    cands, stores = {}, {}
    for s in specs:
        w = model.get_submodule(s.module_name).weight.detach().numpy()
        q = [cg.quantize(np.ascontiguousarray(w, np.float32), t) for t in TYPES]
        if lazy:
            stores[s.gguf_name] = QuantizedCandidates([torch.from_numpy(b) for b in q], TYPES,
                                                      w.shape)
        else:
            cands[s.gguf_name] = torch.stack([torch.from_numpy(cg.dequantize(b, t, w.shape[1]))
                                              for b, t in zip(q, TYPES)])
    table = {s.gguf_name: [tensor_nbytes(t, *s.shape) for t in TYPES] for s in specs}
    mixed = install_gates(model, specs, cands, table, menus={s.gguf_name: list(TYPES)
                                                              for s in specs}, stores=stores)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n in sorted(mixed):
            mixed[n].logits.copy_(torch.randn(len(TYPES), generator=g) * 1.5)
    return model, specs, adapter, mixed


def _close_grads(got, want):
    # dL/dlogit_k = p_k (<W_k, G> - sum_j p_j <W_j, G>) cancels; summed in another order
    # (GEMV vs dL/dW then dots, per shard then all-reduced): tests/test_lazy_student.py's bound
    torch.testing.assert_close(got, want, rtol=1e-3, atol=2e-3 * want.abs().max())


def _run(model, mixed):
    from voodoo.gates import gate_parameters
    logits = model(input_ids=IDS, use_cache=False).logits
    w = torch.linspace(0.5, 1.5, logits.shape[-1])
    (torch.log_softmax(logits, -1) * w).sum().neg().backward()
    return logits.detach(), {mw.gguf_name: mw.logits.grad.clone()
                             for mw in _gates(model)}, gate_parameters(model)


def _gates(model):
    from voodoo.gates import MixedWeight
    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, MixedWeight) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def _worker(rank, world, port, out_dir):
    import torch.distributed as dist

    from cluster.tp import TPGroup, shard_model
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, specs, adapter, mixed = _build(lazy=True)
        full_bytes = sum(s.nbytes for s in (mw.store for mw in mixed.values()))
        embd = mixed["token_embd.weight"].store.nbytes
        shard_model(model, specs, TPGroup(rank, world, None), adapter.n_head, adapter.n_head_kv)
        held = sum(mw.store.nbytes for mw in _gates(model))
        logits, grads, _ = _run(model, mixed)
        torch.save({"logits": logits, "grads": grads, "held": held, "full": full_bytes,
                    "embd": embd,
                    "shards": {mw.gguf_name: (tuple(mw.store.shape2d), tuple(mw.shape))
                               for mw in _gates(model)}},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_lazy_install_gates_equals_dense():
    """Unsharded: install_gates(stores=...) gives the dense candidates' logits and grads."""
    me, _, _, xe = _build(lazy=False)
    ml, _, _, xl = _build(lazy=True)
    le, ge, _ = _run(me, xe)
    ll, gl, _ = _run(ml, xl)
    torch.testing.assert_close(ll, le, rtol=1e-5, atol=1e-5)
    for n in ge:
        _close_grads(gl[n], ge[n])
    mw = next(iter(xl.values()))
    assert mw.candidates.numel() == 0 and mw.store.nbytes > 0


def test_lazy_tensor_parallel_gloo_matches_one_process(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    me, _, _, xe = _build(lazy=False)
    le, ge, _ = _run(me, xe)
    r = [torch.load(tmp_path / f"rank{i}.pt") for i in range(2)]
    for ri in r:
        torch.testing.assert_close(ri["logits"], le, rtol=1e-5, atol=1e-5)
        for n in ge:
            _close_grads(ri["grads"][n], ge[n])
        # column splits hold half the rows, row splits half the columns; the embedding whole
        sh = ri["shards"]
        assert sh["blk.0.attn_q.weight"] == ((64, 128), (128, 128))
        assert sh["blk.0.attn_output.weight"] == ((128, 64), (128, 128))
        assert sh["blk.1.ffn_down.weight"] == ((128, 128), (128, 256))
        assert sh["token_embd.weight"] == ((256, 128), (256, 128))
    # each rank holds its shards' bytes only: half of every split tensor, the embedding whole
    emb = r[0]["embd"]
    assert r[0]["held"] == r[1]["held"] == emb + (r[0]["full"] - emb) // 2
