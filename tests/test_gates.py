"""voodoo.gates: the mixture, its gradients, installing into a tiny Llama, tied embeddings."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from voodoo.gates import (MixedQuantEmbedding, MixedQuantLinear, MixedWeight, _MixEmbeddingFn,
                          _MixLinearFn, gate_state, init_gates, install_gates,
                          load_gate_state, mixed_weights, model_expected_bytes, set_temperature)
from voodoo.quants import tensor_nbytes

TYPES = ["Q8_0", "Q5_0", "Q4_0"]  # 32-block types fit the tiny model's rows of 64/128
_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}


def tiny_llama(seed=0, tied=True, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                      tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def tiny_specs(model):
    specs = []
    for i in range(model.config.num_hidden_layers):
        for hf, g in _GGUF.items():
            w = model.get_submodule(f"model.layers.{i}.{hf}").weight
            specs.append(SimpleNamespace(gguf_name=f"blk.{i}.{g}.weight",
                                         module_name=f"model.layers.{i}.{hf}", kind="linear",
                                         shape=tuple(w.shape), tied_to=[]))
    e = model.model.embed_tokens.weight
    tied = model.config.tie_word_embeddings
    specs.append(SimpleNamespace(gguf_name="token_embd.weight", module_name="model.embed_tokens",
                                 kind="embedding", shape=tuple(e.shape),
                                 tied_to=["lm_head"] if tied else []))
    if not tied:
        specs.append(SimpleNamespace(gguf_name="output.weight", module_name="lm_head",
                                     kind="linear", shape=tuple(model.lm_head.weight.shape),
                                     tied_to=[]))
    return specs


def synthetic_candidates(model, specs, seed=1):
    """Candidate k = W + noise of std 0.01 * 2**k (k=0 the most bits), bytes from quants."""
    g = torch.Generator().manual_seed(seed)
    cands, nbytes, menus = {}, {}, {}
    for s in specs:
        w = model.get_submodule(s.module_name).weight.detach()
        noise = [torch.randn(w.shape, generator=g).to(w.dtype) * 0.01 * 2 ** k
                 for k in range(len(TYPES))]
        cands[s.gguf_name] = torch.stack([w + n for n in noise])
        nbytes[s.gguf_name] = [tensor_nbytes(t, *s.shape) for t in TYPES]
        menus[s.gguf_name] = list(TYPES)
    return cands, nbytes, menus


def gated_llama(seed=0, tied=True):
    """(student with gates, teacher = untouched copy, candidates, bytes, menus, specs)."""
    model = tiny_llama(seed, tied)
    teacher = copy.deepcopy(model)
    specs = tiny_specs(model)
    cands, nbytes, menus = synthetic_candidates(model, specs)
    install_gates(model, specs, cands, nbytes, menus=menus)
    return model, teacher, cands, nbytes, menus, specs


def test_linear_output_equals_mixture():
    torch.manual_seed(0)
    cand = torch.randn(3, 5, 7, dtype=torch.float64)
    bias = torch.randn(5, dtype=torch.float64)
    lin = MixedQuantLinear(cand, bias, nbytes=[30, 20, 10], gguf_name="t")
    with torch.no_grad():
        lin.logits.copy_(torch.tensor([0.3, -1.0, 0.5]))
    lin.mixed.temperature.fill_(0.7)
    x = torch.randn(2, 4, 7, dtype=torch.float64)
    p = lin.probs().detach().double()  # float32 softmax(z / T), as the module uses
    torch.testing.assert_close(p, torch.softmax(lin.logits.double() / 0.7, 0), rtol=1e-6, atol=0,
                               check_dtype=False)
    w = (p[:, None, None] * cand).sum(0)
    torch.testing.assert_close(lin(x), x @ w.T + bias, rtol=0, atol=1e-12)
    torch.testing.assert_close(lin.expected_bytes().double(),
                               (p * torch.tensor([30., 20, 10])).sum(), rtol=1e-6, atol=0)


def test_gate_gradient_matches_finite_difference():
    torch.manual_seed(0)
    cand = torch.randn(4, 6, 5, dtype=torch.float64)
    bias = torch.randn(6, dtype=torch.float64)
    x = torch.randn(3, 2, 5, dtype=torch.float64)
    r = torch.randn(3, 2, 6, dtype=torch.float64)
    z0 = torch.randn(4, dtype=torch.float64)
    t = 0.8

    def loss(z):
        y = _MixLinearFn.apply(x, torch.softmax(z / t, 0), cand, bias)
        return (torch.tanh(y) * r).sum()

    z = z0.clone().requires_grad_(True)
    loss(z).backward()
    eps = 1e-6
    fd = torch.stack([(loss(z0 + eps * e) - loss(z0 - eps * e)) / (2 * eps)
                      for e in torch.eye(4, dtype=torch.float64)])
    torch.testing.assert_close(z.grad, fd, rtol=1e-6, atol=1e-8)
    # x and bias too, and the embedding's function.
    xg = x.clone().requires_grad_(True)
    bg = bias.clone().requires_grad_(True)
    zg = z0.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x_, z_, b_: _MixLinearFn.apply(x_, torch.softmax(z_ / t, 0), cand, b_),
        (xg, zg, bg))
    ids = torch.tensor([[0, 5, 2], [5, 5, 1]])
    assert torch.autograd.gradcheck(
        lambda z_: _MixEmbeddingFn.apply(ids, torch.softmax(z_ / t, 0), cand, torch.float64),
        (zg,))


def test_bf16_candidates_accumulate_in_float32():
    torch.manual_seed(0)
    cand = torch.randn(3, 8, 16).to(torch.bfloat16)
    lin = MixedQuantLinear(cand, None, nbytes=[3, 2, 1])
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    y = lin(x)
    assert y.dtype == torch.bfloat16
    w = (lin.probs()[:, None, None] * cand.float()).sum(0)
    torch.testing.assert_close(y.float(), x.float() @ w.T, rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    assert lin.logits.grad is not None and torch.isfinite(lin.logits.grad).all()


@pytest.mark.parametrize("tied", [True, False])
def test_one_hot_gate_equals_candidate_model(tied):
    model, _, cands, _, _, specs = gated_llama(tied=tied)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    for k in range(len(TYPES)):
        with torch.no_grad():
            for mw in mixed_weights(model).values():
                mw.logits.fill_(-1e4)
                mw.logits[k] = 0.0
        ref = tiny_llama(tied=tied)
        with torch.no_grad():
            for s in specs:
                ref.get_submodule(s.module_name).weight.copy_(cands[s.gguf_name][k])
        if tied:
            assert ref.lm_head.weight is ref.model.embed_tokens.weight
        with torch.no_grad():
            got = model(input_ids=ids).logits
            want = ref(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tied_embedding_and_head_share_one_gate():
    model, _, _, nbytes, _, _ = gated_llama(tied=True)
    assert isinstance(model.model.embed_tokens, MixedQuantEmbedding)
    assert isinstance(model.lm_head, MixedQuantLinear)
    assert model.model.embed_tokens.mixed is model.lm_head.mixed
    state = gate_state(model)
    assert "token_embd.weight" in state and "output.weight" not in state
    assert len(state) == 15
    # Counted once: uniform gates -> mean bytes per tensor.
    want = sum(sum(b) / len(b) for b in nbytes.values())
    assert model_expected_bytes(model).item() == pytest.approx(want, rel=1e-6)
    # Gradient reaches the shared gate through both paths; only gates train.
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids).logits.logsumexp(-1).sum().backward()
    g = model.lm_head.logits.grad
    assert g is not None and g.abs().sum() > 0
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(n.endswith("logits") for n in trainable) and len(trainable) == 15


def test_gate_state_roundtrip_and_temperature():
    model, *_ = gated_llama()
    with torch.no_grad():
        for i, mw in enumerate(mixed_weights(model).values()):
            mw.logits.copy_(torch.tensor([0.1 * i, -0.2, 0.3]))
    st = gate_state(model)
    other, *_ = gated_llama()
    load_gate_state(other, st)
    assert all(torch.equal(st[n], v) for n, v in gate_state(other).items())
    with pytest.raises(ValueError, match="missing"):
        load_gate_state(other, {"blk.0.attn_q.weight": st["blk.0.attn_q.weight"]})
    set_temperature(model, 0.25)
    assert all(m.temperature.item() == 0.25 for m in mixed_weights(model).values())
    with pytest.raises(ValueError):
        set_temperature(model, 0.0)


def test_budget_init_favours_nearest_type():
    cand = torch.zeros(3, 4, 64)
    mw = MixedWeight(cand, [tensor_nbytes(t, 4, 64) for t in TYPES], "t")
    init_gates({"t": mw}, "budget", init_bpw=5.4, strength=2.0)  # Q5_0 is 5.5 bpw
    assert mw.logits.argmax().item() == 1
    assert mw.logits[1].item() == pytest.approx(-0.2, abs=1e-6)
    with pytest.raises(ValueError, match="init_bpw"):
        init_gates({"t": mw}, "budget")
    with pytest.raises(ValueError, match="unknown gate init"):
        init_gates({"t": mw}, "random")


def test_install_rejects_bad_shapes_and_modules():
    model = tiny_llama()
    specs = tiny_specs(model)
    cands, nbytes, _ = synthetic_candidates(model, specs)
    cands["blk.0.attn_q.weight"] = cands["blk.0.attn_q.weight"][:, :10]
    with pytest.raises(ValueError, match="blk.0.attn_q.weight"):
        install_gates(model, specs, cands, nbytes)
    model = tiny_llama()
    bad = [SimpleNamespace(gguf_name="x", module_name="model.norm", tied_to=[])]
    with pytest.raises(ValueError, match="RMSNorm|expected nn.Linear"):
        install_gates(model, bad, {"x": torch.zeros(2, 64, 64)}, {"x": [2, 1]})
    with pytest.raises(ValueError, match="byte sizes"):
        MixedWeight(torch.zeros(2, 3, 4), [1, 2, 3])
    assert isinstance(nn.Linear, type)


def test_model_to_dtype_keeps_gates_float32():
    model, *_ = gated_llama()
    model.to(torch.bfloat16)
    mw = mixed_weights(model)["token_embd.weight"]
    assert mw.candidates.dtype == torch.bfloat16
    assert mw.logits.dtype == mw.nbytes.dtype == mw.temperature.dtype == torch.float32
    assert mw.logits.requires_grad
    assert model.model.embed_tokens.dtype == torch.bfloat16
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
