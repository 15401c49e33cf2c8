"""benchmarks/rotated_model.py: folding the RMSNorms and rotating the residual stream changes
no logit (torch, float32 rounding only), unties the head, leaves every norm at one and moves the
weights off any grid."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from rotated_model import random_orthogonal, rotate_  # noqa: E402


def _tiny(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms, so that folding matters
        for n, p in m.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 2.0)
    return m


def test_random_orthogonal_is_orthogonal_and_seeded():
    q = random_orthogonal(48, 3)
    assert torch.allclose(q @ q.T, torch.eye(48, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, random_orthogonal(48, 3)) and not torch.equal(q, random_orthogonal(48, 4))


@pytest.mark.parametrize("tied", [True, False])
def test_rotation_keeps_the_logits(tied):
    m = _tiny(tied)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(ids).logits
        emb0 = m.model.embed_tokens.weight.clone()
        rotate_(m, seed=0)
        got = m(ids).logits
    assert (got - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    assert m.config.tie_word_embeddings is False
    assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()
    for n, p in m.named_parameters():
        if "norm" in n:
            assert torch.equal(p, torch.ones_like(p)), n
    # the embedding really moved (rotated), with its row norms kept
    assert (m.model.embed_tokens.weight - emb0).abs().max() > 1e-3
    assert torch.allclose(m.model.embed_tokens.weight.norm(dim=1), emb0.norm(dim=1), rtol=1e-5)


def test_unknown_layout_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel
    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(SystemExit, match="llama layout"):
        rotate_(m)
