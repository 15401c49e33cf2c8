"""The lazy Q8_0 teacher (``build_teacher(ctx, "Q8_0", lazy=True)``: selectable weights held as
Q8_0 bytes, dequantized module by module in the forward) against the dense Q8_0 teacher, on
the tiny llama (tests/conftest.py ``tiny_prepared``)."""

from __future__ import annotations

import copy

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_ctx(tiny_model_dir, tiny_prepared):
    from voodoo.pipeline import load_context
    ctx = load_context(tiny_model_dir, tiny_prepared.base_gguf.parent, with_tokenizer=False)
    vocab = ctx.model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    return ctx, ids


def test_lazy_q8_0_teacher_equals_dense(tiny_ctx):
    from voodoo.lazy import QuantizedParams
    from voodoo.pipeline import build_teacher
    from voodoo.train import _logits
    ctx, ids = tiny_ctx
    dense = build_teacher(ctx, "Q8_0")
    lazy = build_teacher(ctx, "Q8_0", lazy=True)
    qp = lazy.voodoo_quantized
    assert isinstance(qp, QuantizedParams)
    # the selectable weights are no longer parameters: only the bytes are held
    n_dense = sum(p.numel() for p in dense.parameters())
    n_lazy = sum(p.numel() for p in lazy.parameters())
    n_sel = sum(e.n_rows * e.n_per_row for e in ctx.tmap)
    assert n_dense - n_lazy >= n_sel - 1  # a tied embedding is one tensor
    assert qp.nbytes == n_sel * 34 // 32
    # the rebuilt weights are the dense teacher's exactly
    dp = dict(dense.named_parameters())
    for name, w in qp.dense_params().items():
        assert torch.equal(w, dp[name]), name
    with torch.no_grad():
        ld, ll = _logits(dense, ids), _logits(lazy, ids)
    torch.testing.assert_close(ll, ld, rtol=1e-5, atol=1e-5)
    assert torch.equal(ll, ld)  # same bits in practice (same ops on the same weights)
    # between calls nothing dense is kept; shape/dtype queries still answer
    w = lazy.get_output_embeddings().weight
    assert w.shape == dp["lm_head.weight" if "lm_head.weight" in dp
                         else "model.embed_tokens.weight"].shape
    assert w.untyped_storage().nbytes() <= w.element_size()


def test_lazy_teacher_follows_dtype(tiny_ctx):
    from voodoo.pipeline import build_teacher
    from voodoo.train import _logits
    ctx, ids = tiny_ctx
    dense = build_teacher(ctx, "Q8_0").to(torch.bfloat16)
    lazy = build_teacher(ctx, "Q8_0", lazy=True).to(torch.bfloat16)
    with torch.no_grad():
        ld, ll = _logits(dense, ids), _logits(lazy, ids)
    assert ll.dtype == torch.bfloat16
    assert torch.equal(ll, ld)


def test_lazy_only_for_q8_0(tiny_ctx):
    from voodoo.pipeline import build_teacher
    ctx, _ = tiny_ctx
    t = build_teacher(ctx, "BF16", lazy=True)
    assert not hasattr(t, "voodoo_quantized")


def test_training_with_lazy_teacher_same_losses(tiny_ctx, tmp_path):
    """Two steps of gate training against the lazy and the dense Q8_0 teacher: same losses."""
    from voodoo.candidates import CandidateCache
    from voodoo.pipeline import (Context, build_student, build_teacher, ensure_candidates,
                                 make_menus)
    from voodoo.train import TrainConfig, train_gates
    ctx, ids = tiny_ctx
    menus = make_menus(ctx.specs, ["Q8_0", "Q4_K", "Q2_K"])
    cache = CandidateCache(tmp_path / "cache")
    keys = ensure_candidates(ctx, menus, None, cache)
    cfg = TrainConfig(compression_ratio=0.55, max_steps=2, seq_len=ids.shape[1], batch_size=2,
                      gate_init="budget", lr=0.5, compile=False)
    hist = {}
    for lazy in (False, True):
        teacher = build_teacher(ctx, "Q8_0", lazy=lazy)
        c = Context(ctx.prepared, ctx.tmap, copy.deepcopy(ctx.model), None, ctx.adapter)
        build_student(c, menus, keys, cache, lazy=True)
        res = train_gates(c.model, teacher, ids, cfg, tmp_path / f"run{lazy}", progress=False)
        hist[lazy] = [h["kl"] for h in res.history]
    assert hist[True] == hist[False] and len(hist[True]) == 2
