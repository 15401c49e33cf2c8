"""The lazy student (``build_student(..., lazy=True)``: candidates held as ggml bytes, mixed tile
by tile) against the eager one (dense libggml-dequantized candidates), and gradient
checkpointing with the gates, on the tiny llama (tests/conftest.py ``tiny_prepared``)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

#: A menu with K-quants, i-quants and a legacy type, so several dequantizers are exercised.
MENU = ["Q8_0", "Q5_K", "Q4_K", "IQ4_XS", "Q3_K", "Q2_K"]


@pytest.fixture(scope="module")
def tiny_setup(tiny_model_dir, tiny_prepared, tmp_path_factory):
    """(ctx, menus, keys, cache, pristine model, token blocks) for the tiny model; candidates
    quantized once (no imatrix)."""
    from voodoo.candidates import CandidateCache
    from voodoo.pipeline import ensure_candidates, load_context, make_menus
    ctx = load_context(tiny_model_dir, tiny_prepared.base_gguf.parent, with_tokenizer=False)
    menus = make_menus(ctx.specs, MENU)
    cache = CandidateCache(tmp_path_factory.mktemp("lazy-cache"))
    keys = ensure_candidates(ctx, menus, None, cache)
    pristine = copy.deepcopy(ctx.model).eval()
    vocab = ctx.model.config.vocab_size
    blocks = torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(0))
    return ctx, menus, keys, cache, pristine, blocks


def _student(setup, lazy: bool):
    """A fresh student (a copy of the pristine model) with eager or lazy candidates."""
    from voodoo.pipeline import Context, build_student
    ctx, menus, keys, cache, pristine, _ = setup
    c = Context(ctx.prepared, ctx.tmap, copy.deepcopy(pristine), None, ctx.adapter)
    mixed = build_student(c, menus, keys, cache, lazy=lazy)
    return c.model, mixed


def _random_logits(mixed, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in sorted(mixed):
            mw = mixed[name]
            mw.logits.copy_(torch.randn(mw.k, generator=g) * 1.5)


def _loss_and_grads(model, mixed, ids):
    from voodoo.train import _logits
    for mw in mixed.values():
        mw.logits.grad = None
    logits = _logits(model, ids)
    # a loss that reaches every logit position with distinct weights
    w = torch.linspace(0.5, 1.5, logits.shape[-1])
    (torch.log_softmax(logits, -1) * w).sum().neg().backward()
    return logits.detach(), {n: mw.logits.grad.clone() for n, mw in mixed.items()}


def test_lazy_student_matches_eager(tiny_setup):
    from voodoo.lazy import QuantizedCandidates
    ids = tiny_setup[5][:2]
    eager, m_e = _student(tiny_setup, lazy=False)
    lazy, m_l = _student(tiny_setup, lazy=True)
    assert sorted(m_e) == sorted(m_l) and len(m_l) >= 10
    stores = [mw.store for mw in m_l.values()]
    assert all(isinstance(s, QuantizedCandidates) for s in stores)
    assert all(mw.candidates.numel() == 0 for mw in m_l.values())  # nothing dense held
    q_bytes = sum(s.nbytes for s in stores)
    dense = sum(mw.candidates.numel() * 4 for mw in m_e.values())
    assert dense == sum(s.dense_nbytes(torch.float32) for s in stores)
    # exactly the bytes the GGUF would hold for each candidate (llama.cpp's row sizes)
    assert q_bytes == sum(sum(mw.nbytes.tolist()) for mw in m_l.values())
    assert q_bytes < dense / 6, (q_bytes, dense)  # 4.8 bpw on average vs 32 bits
    for name in m_e:
        assert m_l[name].shape == m_e[name].shape

    for seed in (0, 1):
        _random_logits(m_e, seed)
        _random_logits(m_l, seed)
        le, ge = _loss_and_grads(eager, m_e, ids)
        ll, gl = _loss_and_grads(lazy, m_l, ids)
        # bit-identical dequantization and the same float32 mixing order: the same logits
        # (measured: equal to the bit on the CPU; the tolerance is float32's)
        torch.testing.assert_close(ll, le, rtol=1e-5, atol=1e-5)
        for n in ge:
            assert torch.any(ge[n] != 0), n
            # dL/dlogit_k = p_k (<W_k, G> - sum_j p_j <W_j, G>): a difference of nearly equal
            # float32 sums over every weight, taken in another order (tiles vs one GEMV), so
            # it cancels; measured <= 2.4e-4 of the largest entry, 7.6e-3 for token_embd
            # (12.6 M weights, tied lm_head)
            torch.testing.assert_close(gl[n], ge[n], rtol=1e-3, atol=2e-2 * ge[n].abs().max())

    # one-hot gates: the mixture is each candidate exactly, so the logits agree to the bit
    from voodoo.pipeline import assign_student
    asg = {"tensors": {n: {"type": MENU[min(i % 6, len(mw.types) - 1)]
                           if MENU[min(i % 6, len(mw.types) - 1)] in mw.types else mw.types[0],
                           "menu": mw.types} for i, (n, mw) in enumerate(sorted(m_e.items()))}}
    assign_student(m_e, asg)
    assign_student(m_l, asg)
    with torch.no_grad():
        from voodoo.train import _logits
        assert torch.equal(_logits(lazy, ids), _logits(eager, ids))


def test_lazy_training_bakes_same_assignment(tiny_setup, tmp_path):
    from voodoo.bake import bake
    from voodoo.pipeline import bytes_table
    from voodoo.train import TrainConfig, train_gates
    ctx, menus, _, _, pristine, blocks = tiny_setup
    cfg = TrainConfig(compression_ratio=0.55, max_steps=2, seq_len=blocks.shape[1],
                      batch_size=2, gate_init="budget", lr=0.5, compile=False)
    table = bytes_table(ctx.specs, menus)
    out = {}
    # eager; lazy; lazy with gradient checkpointing per decoder layer
    for lazy, ckpt in ((False, False), (True, False), (True, True)):
        model, mixed = _student(tiny_setup, lazy)
        c = dataclasses.replace(cfg, gradient_checkpointing=ckpt)
        res = train_gates(model, pristine, blocks, c, tmp_path / f"run{lazy}{ckpt}",
                          progress=False)
        assert res.finished and res.step == 2
        assert model.model.layers[0].gradient_checkpointing == ckpt
        out[lazy, ckpt] = (res, bake(res.gates, menus, table, res.budget_bytes))
    re, ae = out[False, False]
    te = {n: v["type"] for n, v in ae["tensors"].items()}
    assert len(set(te.values())) > 1  # a real mixed assignment, not all one type
    for key in ((True, False), (True, True)):
        rl, al = out[key]
        for he, hl in zip(re.history, rl.history):
            assert hl["loss"] == pytest.approx(he["loss"], rel=1e-5), key
        for n in re.gates:
            torch.testing.assert_close(rl.gates[n], re.gates[n], rtol=1e-4, atol=1e-4)
        assert {n: v["type"] for n, v in al["tensors"].items()} == te, key


@pytest.mark.parametrize("lazy", [False, True])
def test_gradient_checkpointing_same_gate_grads(tiny_setup, lazy):
    """HF's non-reentrant checkpointing per decoder layer recomputes the layers from the
    weights ParamGates set before the forward: the gate gradients are unchanged."""
    ids = tiny_setup[5][:2]
    model, mixed = _student(tiny_setup, lazy)
    _random_logits(mixed, 3)
    model.eval()
    l0, g0 = _loss_and_grads(model, mixed, ids)
    from voodoo.train import enable_checkpointing
    assert enable_checkpointing(model)
    model.train()  # HF checkpoints only in training mode
    n_ckpt = []
    for layer in model.model.layers:  # count the checkpointed layer calls
        assert layer.gradient_checkpointing
        f = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = \
            lambda *a, f=f, **k: (n_ckpt.append(1), f(*a, **k))[1]
    l1, g1 = _loss_and_grads(model, mixed, ids)
    assert len(n_ckpt) == len(model.model.layers)
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    for n in g0:
        assert torch.any(g0[n] != 0), n
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-6, atol=1e-9)


def _llama_shapes(h, i, n_layers, heads, kv, vocab):
    hd = h // heads
    out = {"token_embd.weight": (vocab, h)}
    for b in range(n_layers):
        for n, s in {"attn_q": (heads * hd, h), "attn_k": (kv * hd, h), "attn_v": (kv * hd, h),
                     "attn_output": (h, heads * hd), "ffn_gate": (i, h), "ffn_up": (i, h),
                     "ffn_down": (h, i)}.items():
            out[f"blk.{b}.{n}.weight"] = s
    return out


def test_predict_memory_against_h200_and_stores(tiny_setup):
    """Candidate bytes are exact (the lazy stores' bytes; K x elements x itemsize eagerly) and
    the whole-step totals match what benchmarks/results/lazy_student/ measured on an H200."""
    from voodoo.lazy import format_memory, predict_memory
    ctx, menus, *_ = tiny_setup
    shapes = ctx.shapes
    kw = dict(n_params=sum(p.numel() for p in ctx.model.parameters()), n_layers=2, hidden=256,
              intermediate=512, vocab=ctx.model.config.vocab_size, tokens=64)
    _, m_l = _student(tiny_setup, lazy=True)
    lz = predict_memory(shapes, menus, lazy=True, dtype=torch.float32, **kw)
    ea = predict_memory(shapes, menus, lazy=False, dtype=torch.float32, **kw)
    assert lz["candidates"] == sum(mw.store.nbytes for mw in m_l.values())
    assert ea["candidates"] == sum(mw.store.dense_nbytes(torch.float32) for mw in m_l.values())
    assert lz["total"] < ea["total"]
    q8 = predict_memory(shapes, menus, lazy=True, teacher_quant="Q8_0", **kw)
    assert q8["teacher"] < lz["teacher"] / 1.8

    gib = 2 ** 30
    menu6 = ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "IQ3_S"]
    s3 = _llama_shapes(3072, 8192, 28, 24, 8, 128256)
    k3 = dict(n_params=3212749824, n_layers=28, hidden=3072, intermediate=8192, vocab=128256,
              tokens=8192)
    m3 = {n: menu6 for n in s3}
    for lazy, measured in ((False, 104.8), (True, 81.3)):  # whole step peaks, GiB
        p = predict_memory(s3, m3, lazy=lazy, chunked_loss=False, **k3)  # measured before
        print(format_memory(p, int(measured * gib)))
        assert abs(p["total"] / gib - measured) < 0.05 * measured, (lazy, p)
    s14 = _llama_shapes(5120, 17408, 40, 40, 8, 151936)
    p14 = predict_memory(s14, {n: menu6 for n in s14}, lazy=True, checkpointing=True,
                         n_params=13990384640, n_layers=40, hidden=5120, intermediate=17408,
                         vocab=151936, tokens=8192, chunked_loss=False)
    assert p14["total"] / gib > 139.8  # it ran out of memory on the H200
    assert p14["candidates"] / gib < 55  # vs 156 GiB of dense bf16 candidates
    # since: the chunked distillation loss and per-module mixing (h200_single_3b_eager_vs_lazy
    # and h200_single_14b_lazy_ckpt_q8teacher.json): whole-step peaks
    for lazy, measured in ((False, 82.1), (True, 58.6)):
        p = predict_memory(s3, m3, lazy=lazy, **k3)
        print(format_memory(p, int(measured * gib)))
        assert abs(p["total"] / gib - measured) < 0.05 * measured, (lazy, p)
    p14 = predict_memory(s14, {n: menu6 for n in s14}, lazy=True, checkpointing=True,
                         teacher_quant="Q8_0", n_params=13990384640, n_layers=40, hidden=5120,
                         intermediate=17408, vocab=151936, tokens=8192)
    print(format_memory(p14, int(106.6 * gib)))
    assert abs(p14["total"] / gib - 106.6) < 0.05 * 106.6, p14


def test_lazy_tp_student_matches_eager(tiny_setup):
    """build_student_tp(lazy=True): the cache's bytes with rows put in HF order (attn_q/attn_k
    are row-permuted by the converter) give the dense TP student's logits; the sharding itself
    is tests/cluster/test_tp_lazy.py's."""
    from voodoo.pipeline import Context, build_student_tp
    from voodoo.train import _logits
    ctx, menus, keys, cache, pristine, blocks = tiny_setup
    out = {}
    for lazy in (False, True):
        c = Context(ctx.prepared, ctx.tmap, copy.deepcopy(pristine), None, ctx.adapter)
        mixed = build_student_tp(c, menus, keys, cache, lazy=lazy)
        _random_logits(mixed, 3)
        with torch.no_grad():
            out[lazy] = _logits(c.model, blocks[:2])
        if lazy:
            assert all(mw.candidates.numel() == 0 for mw in mixed.values())
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lazy", [False, True])
def test_compiled_student_compiles_once(tiny_setup, lazy):
    """``torch.compile`` of the student (what ``voodoo train`` does on CUDA) traces the model
    once: the gates' mixing runs outside the graph, so steps with new gate logits neither
    recompile nor change the logits (dynamo's ``eager`` backend, on the CPU). Before, the
    eager student's every parameter was a graph of its own and the first step hit dynamo's
    recompile limit (120 s on an H200)."""
    import torch._dynamo
    from voodoo.train import _logits
    model, mixed = _student(tiny_setup, lazy)
    ids = tiny_setup[5][:2]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    for step in range(3):
        # the lazy student's per-module mixing breaks the graph at each module, so its first
        # step enters transformers' shared wrappers once per module class (a few compiles,
        # not one per parameter); after it nothing may compile again
        with torch._dynamo.config.patch(error_on_recompile=not lazy or step > 0):
            _random_logits(mixed, step)
            out = _logits(compiled, ids)
            ref = _logits(model, ids)
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
            out.sum().backward()
    assert all(mw.logits.grad is not None and torch.isfinite(mw.logits.grad).all()
               for mw in mixed.values())
