"""voodoo.arch: registry, selectable tensors, and the Q/K row permutation checked against the
pinned llama.cpp converter's output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from voodoo.arch import (Adapter, TensorSpec, UnsupportedArchitecture, get_adapter, register,
                         supported_architectures)
from voodoo.arch.llama import LlamaAdapter, Qwen2Adapter, permute, unpermute


def _llama_config(tied=True, **kw):
    from transformers import LlamaConfig
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    base.update(kw)
    cfg = LlamaConfig(**base)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


# ------------------------------------------------------------------------------ registry
def test_get_adapter_by_architecture_and_model_type():
    cfg = _llama_config()
    assert type(get_adapter(cfg)) is LlamaAdapter
    cfg.architectures = None
    assert type(get_adapter(cfg)) is LlamaAdapter           # falls back to model_type
    from transformers import MistralConfig, Qwen2Config
    m = MistralConfig(num_hidden_layers=1)
    m.architectures = ["MistralForCausalLM"]
    assert type(get_adapter(m)) is LlamaAdapter
    q = Qwen2Config(num_hidden_layers=1)
    q.architectures = ["Qwen2ForCausalLM"]
    assert type(get_adapter(q)) is Qwen2Adapter


def test_unsupported_architecture_names_supported_ones():
    from transformers import GPT2Config
    cfg = GPT2Config()
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(UnsupportedArchitecture) as e:
        get_adapter(cfg)
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg and "Qwen2ForCausalLM" in msg
    assert "--device_map" in msg        # the way out: a family without a TP policy still trains
    assert supported_architectures() == sorted(supported_architectures())


def test_register_rejects_conflicts_and_non_adapters():
    with pytest.raises(ValueError, match="already registered"):
        @register("LlamaForCausalLM")
        class Other(Adapter):
            pass
    with pytest.raises(TypeError):
        register("FooForCausalLM")(object)


# -------------------------------------------------------------------------- selectable
@pytest.mark.parametrize("tied", [True, False])
def test_selectable_llama(tied):
    from transformers import LlamaForCausalLM
    cfg = _llama_config(tied=tied)
    model = LlamaForCausalLM(cfg)
    ad = get_adapter(cfg)
    specs = ad.selectable(model)
    names = [s.gguf_name for s in specs]
    assert names[0] == "token_embd.weight"
    assert len(specs) == 1 + 7 * 2 + (0 if tied else 1)
    assert ("output.weight" in names) is (not tied)
    assert len(set(names)) == len(names)
    by = {s.gguf_name: s for s in specs}
    emb = by["token_embd.weight"]
    assert emb == TensorSpec("token_embd.weight", "model.embed_tokens", "embedding",
                             (512, 64), "non_attention", None,
                             ["lm_head"] if tied else [])
    assert by["blk.1.attn_q.weight"] == TensorSpec(
        "blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj", "linear", (64, 64),
        "attention", "column", [])
    assert by["blk.0.attn_k.weight"].shape == (32, 64)       # 2 KV heads x 16
    assert by["blk.0.attn_v.weight"].tp == "column"
    assert by["blk.0.attn_output.weight"].tp == "row"
    assert by["blk.0.attn_output.weight"].role == "attention"
    assert by["blk.0.ffn_gate.weight"].shape == (128, 64)
    assert by["blk.0.ffn_up.weight"].tp == "column"
    assert by["blk.0.ffn_down.weight"] == TensorSpec(
        "blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj", "linear", (64, 128),
        "non_attention", "row", [])
    if not tied:
        assert by["output.weight"] == TensorSpec("output.weight", "lm_head", "linear",
                                                 (512, 64), "non_attention", None, [])
    for s in specs:   # every spec's module exists with that shape
        assert tuple(model.get_submodule(s.module_name).weight.shape) == s.shape


# ------------------------------------------------------------------------- permutation
def test_permute_roundtrip_and_layout():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4 * 8, 5)).astype(np.float32)      # 4 heads of 8 rows
    p = permute(w, 4)
    assert np.array_equal(unpermute(p, 4), w)
    # within head 0, rows [0..3 | 4..7] are interleaved as 0,4,1,5,2,6,3,7
    assert np.array_equal(p[:8], w[[0, 4, 1, 5, 2, 6, 3, 7]])
    assert np.array_equal(p[8:16], w[8 + np.array([0, 4, 1, 5, 2, 6, 3, 7])])
    # GQA: K is permuted over n_head_kv
    k = rng.standard_normal((2 * 8, 3)).astype(np.float32)
    assert np.array_equal(permute(k, 4, 2), permute(k, 2))
    assert np.array_equal(unpermute(permute(k, 4, 2), 4, 2), k)
    # torch in, torch out; 1-D (biases) too
    t = torch.from_numpy(w)
    pt = permute(t, 4)
    assert isinstance(pt, torch.Tensor) and torch.equal(pt, torch.from_numpy(p))
    b = np.arange(32, dtype=np.float32)
    assert np.array_equal(unpermute(permute(b, 4), 4), b)
    with pytest.raises(ValueError):
        permute(np.zeros((6, 2)), 4)


def test_adapter_permutes_only_q_and_k():
    cfg = _llama_config()
    ad = get_adapter(cfg)
    q = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    k = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
    assert np.array_equal(ad.hf_rows_to_gguf("blk.0.attn_q.weight", q), permute(q, 4))
    assert np.array_equal(ad.hf_rows_to_gguf("blk.1.attn_k.weight", k), permute(k, 2))
    for n in ("blk.0.attn_v.weight", "blk.0.attn_output.weight", "token_embd.weight",
              "blk.10.ffn_down.weight"):
        assert ad.hf_rows_to_gguf(n, q) is q and ad.gguf_rows_to_hf(n, q) is q
    for n, a in (("blk.0.attn_q.weight", q), ("blk.0.attn_k.weight", k)):
        assert np.array_equal(ad.gguf_rows_to_hf(n, ad.hf_rows_to_gguf(n, a)), a)
    from transformers import Qwen2Config
    qc = Qwen2Config(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    qc.architectures = ["Qwen2ForCausalLM"]
    assert get_adapter(qc).hf_rows_to_gguf("blk.0.attn_q.weight", q) is q


def test_adapter_matches_llama_cpp_converter(tiny_prepared):
    """The base F32 GGUF written by convert_hf_to_gguf.py holds exactly the HF weights with the
    adapter's permutation, for every selectable tensor."""
    from voodoo.ggufio import read_gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(tiny_prepared.hf_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_prepared.hf_dir, dtype=torch.float32)
    ad = get_adapter(cfg)
    specs = ad.selectable(model)
    assert [s.gguf_name for s in specs][:2] == ["token_embd.weight", "blk.0.attn_q.weight"]
    base = {t.name: np.asarray(t.data) for t in read_gguf(tiny_prepared.base_gguf).tensors}
    assert "output.weight" not in base                            # tied
    for s in specs:
        hf = model.get_submodule(s.module_name).weight.detach().numpy()
        g = base[s.gguf_name]
        assert g.shape == s.shape, s.gguf_name
        assert np.array_equal(ad.hf_rows_to_gguf(s.gguf_name, hf), g), s.gguf_name
        assert np.array_equal(ad.gguf_rows_to_hf(s.gguf_name, g), hf), s.gguf_name
    # the permutation is not a no-op on this model
    q = model.get_submodule("model.layers.0.self_attn.q_proj").weight.detach().numpy()
    assert not np.array_equal(q, base["blk.0.attn_q.weight"])
