"""voodoo.pipeline.calibrate_kinds: the measured KL drop per tensor kind equals an independent
forward-pass measurement, the scale is measured / predicted (clamped), and the model it
borrows comes back bit for bit (tiny random llama, real libggml candidates)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from test_pipeline import tiny_fixed  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def setup(tiny_fixed, tmp_path_factory):  # noqa: F811
    from voodoo.candidates import CandidateCache
    from voodoo.pipeline import bytes_table, ensure_candidates, load_context, make_menus
    ctx = load_context(tiny_fixed, with_tokenizer=False)
    menus = make_menus(ctx.specs, candidate_types="Q8_0,Q4_K,Q2_K")
    cache = CandidateCache(tmp_path_factory.mktemp("cands"))
    keys = ensure_candidates(ctx, menus, {}, cache)
    table = bytes_table(ctx.specs, menus)
    return ctx, menus, keys, cache, table


def _kl(model, ref_model, blocks):
    out = 0.0
    with torch.no_grad():
        for b in blocks:
            r = torch.log_softmax(ref_model(b[None]).logits.float(), -1)
            s = torch.log_softmax(model(b[None]).logits.float(), -1)
            out += float((r.exp() * (r - s)).sum(-1).mean())
    return out / len(blocks)


def test_calibrate_kinds_measures_each_kind(setup):
    from voodoo.gates import write_gguf_into_params
    from voodoo.pipeline import _dequantized, calibrate_kinds, tensor_kind
    from voodoo.sensitivity import knapsack_choice
    ctx, menus, keys, cache, table = setup
    model = ctx.model.eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # predicted costs: 1e-3 nats per byte saved from the largest type (any positive numbers)
    dist = {n: [1e-3 * (max(b) - x) / max(b) for x in b] for n, b in table.items()}
    extra = {}
    budget = 0.6 * sum(max(b) for b in table.values())
    blocks = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    res = calibrate_kinds(ctx, model, menus, keys, cache, dist, extra, table, budget, blocks,
                          progress=False)
    for n, p in model.named_parameters():  # the borrowed model is restored exactly
        assert torch.equal(p, before[n]), n
    assert res, "the budget forces some tensor off its best type"
    choice = knapsack_choice(dist, table, budget)
    deq = {n: torch.from_numpy(_dequantized(cache, keys[(n, menus[n][k])], menus[n][k],
                                            ctx.tmap[n].n_per_row))
           for n, k in choice.items()}
    chosen = copy.deepcopy(model)
    write_gguf_into_params(chosen, ctx.tmap, deq)
    kl0 = _kl(chosen, model, blocks)
    for kind, r in res.items():
        names = [n for n in choice if tensor_kind(n) == kind and choice[n] != 0]
        assert r["tensors"] == len(names) > 0
        up = copy.deepcopy(chosen)
        write_gguf_into_params(up, ctx.tmap, {**deq, **{
            n: torch.from_numpy(_dequantized(cache, keys[(n, menus[n][0])], menus[n][0],
                                             ctx.tmap[n].n_per_row)) for n in names}})
        measured = kl0 - _kl(up, model, blocks)
        assert r["measured"] == pytest.approx(measured, rel=1e-4, abs=1e-7)
        pred = sum(dist[n][choice[n]] - dist[n][0] for n in names)
        assert r["predicted"] == pytest.approx(pred)
        assert r["scale"] == pytest.approx(float(np.clip(measured / pred, 0.25, 4.0)))
