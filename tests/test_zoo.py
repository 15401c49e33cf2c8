"""The zoo (tests/zoo.py): every family converts with the pinned llama.cpp converter (through
``voodoo.models.prepare_model``, with the converter flags Voodoo derives) and llama.cpp's F32
GGUF agrees with transformers on the same tokens (``voodoo.agreement``)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from zoo import FAMILIES, ZOO_DISAGREE, make_tiny, zoo_tokens  # noqa: E402

#: families whose agreement runs in the default (not slow) selection: one plain, one hybrid
#: with 3-D experts, the multimodal wrapper; the rest are @slow (seconds each, but 16 of them)
FAST = ("llama", "granitemoehybrid", "gemma3_mm")
#: mean KLD (nats/token) below which llama.cpp's F32 GGUF counts as the same model; float32
#: and the base file's 16-bit log-probs give ~1e-6
MAX_KLD = 1e-4


@pytest.fixture(scope="session")
def converter_ready():
    from voodoo.llamacpp import LlamaCppNotBuilt, source_dir, tool_path
    try:
        source_dir()
        tool_path("llama-perplexity")
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def zoo_configs(converter_ready) -> dict:
    """family -> config.json dict; asks the converter about all of them in one subprocess."""
    from voodoo.models import converter_info
    cfgs = {f: json.loads((make_tiny(f) / "config.json").read_text())
            for f in [*FAMILIES, *ZOO_DISAGREE]}
    first, *rest = cfgs.values()
    converter_info(first, also=rest)
    return cfgs


_PREPARED: dict = {}


def _prepared(family: str, tmp_path_factory):
    """prepare_model on the zoo folder, once per session, into Voodoo's model cache (the
    default work_dir), where tests/test_arch_matrix.py's load_context finds the same
    conversion."""
    if family not in _PREPARED:
        from voodoo.models import prepare_model
        _PREPARED[family] = prepare_model(make_tiny(family))
    return _PREPARED[family]


def _agreement(family, tmp_path_factory):
    from voodoo.agreement import llama_vs_torch
    from voodoo.models import load_hf_model
    prep = _prepared(family, tmp_path_factory)
    model = load_hf_model(prep)
    vocab = model.config.get_text_config().vocab_size
    res = llama_vs_torch(prep.base_gguf, model, zoo_tokens(vocab, n_chunk=2, n_ctx=128))
    print(f"{family}: KLD {res['kld_mean']:.3g} (99.9% {res['kld_99_9']:.3g}), same top-p "
          f"{res['same_top_p']:.4f}, entropy {res['entropy_torch']:.2f} nats "
          f"(flat: {math.log(res['n_vocab']):.2f})")
    return res


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f in FAST else pytest.mark.slow)
                                    for f in FAMILIES])
def test_family_converts_and_llama_cpp_agrees(family, zoo_configs, tmp_path_factory,
                                              record_property):
    res = _agreement(family, tmp_path_factory)
    record_property("kld_mean", res["kld_mean"])
    record_property("same_top_p", res["same_top_p"])
    assert abs(res["kld_mean"]) < MAX_KLD
    assert res["same_top_p"] > 0.98
    # the distributions are far from flat (uniform: entropy log(n_vocab))
    assert res["entropy_torch"] < 0.8 * math.log(res["n_vocab"])


def test_converter_flags_are_read_from_the_converter(zoo_configs):
    from voodoo.models import converter_flags, converter_info
    flags = {f: converter_flags(c) for f, c in zoo_configs.items()}
    assert flags["qwen3_next"] == ["--no-mtp"]
    assert all(v == [] for f, v in flags.items() if f != "qwen3_next"), flags
    info = converter_info(zoo_configs["qwen3_next"])
    assert info["supports_mtp_export"] and "--no-mtp" in info["flags"]


def test_unknown_converter_flag_is_refused(zoo_configs):
    from voodoo.models import ModelPreparationError, converter_options
    assert converter_options(zoo_configs["llama"], ["--fuse-qkv"]) == ["--fuse-qkv"]
    with pytest.raises(ModelPreparationError, match="--no-such-flag"):
        converter_options(zoo_configs["llama"], ["--no-such-flag"])


@pytest.mark.slow
def test_qwen3_next_does_not_convert_without_no_mtp(zoo_configs, tmp_path):
    """Why converter_flags adds --no-mtp: the converter's Qwen3-Next class asserts it found MTP
    tensors, which a transformers checkpoint never has."""
    from voodoo.models import ModelPreparationError, convert_hf_to_f32_gguf
    with pytest.raises(ModelPreparationError, match="opt_num_mtp_layers|AssertionError"):
        convert_hf_to_f32_gguf(make_tiny("qwen3_next"), tmp_path / "x.gguf")


def test_unknown_architecture_fails_before_converting(converter_ready, tmp_path):
    from voodoo.models import ModelPreparationError, prepare_model
    d = tmp_path / "foo"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["FooBarForCausalLM"],
                                               "model_type": "foobar"}))
    work = tmp_path / "work"
    with pytest.raises(ModelPreparationError) as ei:
        prepare_model(d, work_dir=work)
    msg = str(ei.value)
    assert "FooBarForCausalLM" in msg and "convert_hf_to_gguf.py" in msg
    assert not (work.exists() and list(work.rglob("*.gguf")))     # refused before converting


def test_multimodal_gemma3_gives_the_language_model(zoo_configs, tmp_path_factory):
    from voodoo.ggufio import read_gguf
    prep = _prepared("gemma3_mm", tmp_path_factory)
    r = read_gguf(prep.base_gguf)
    assert r.fields["general.architecture"].contents() == "gemma3"
    names = [t.name for t in r.tensors]
    assert "token_embd.weight" in names and "blk.5.ffn_down.weight" in names
    assert not [n for n in names if n.startswith(("v.", "mm.", "vision"))]


def test_multimodal_is_announced(zoo_configs, tmp_path, capfd, monkeypatch):
    """prepare_model says the vision part is left to llama.cpp's --mmproj route (the
    conversion itself is stubbed out here; the test above runs the real one)."""
    import voodoo.models as vm
    seen = {}

    def fake_convert(hf_dir, out, timeout=None, extra_args=()):
        seen["args"] = list(extra_args)
        Path(out).write_bytes(b"")
        return Path(out)

    monkeypatch.setattr(vm, "convert_hf_to_f32_gguf", fake_convert)
    vm.prepare_model(make_tiny("gemma3_mm"), work_dir=tmp_path)
    assert seen["args"] == []
    err = capfd.readouterr().err
    assert "--mmproj" in err and "Gemma3ForConditionalGeneration" in err


@pytest.mark.parametrize("config", [
    pytest.param(c, marks=() if c == "gemma3_pattern_1_1" else pytest.mark.slow)
    for c in ZOO_DISAGREE])
def test_preflight_catches_a_config_llama_cpp_runs_differently(config, zoo_configs,
                                                                tmp_path_factory):
    """Configs transformers honours and the pinned llama.cpp does not: gemma3 with sliding/
    full alternating 1:1 (llama.cpp's gemma3 uses 5:1), granitemoehybrid with rope, smollm3
    with no_rope_layers other than every 4th. The pre-flight check stops them."""
    from voodoo.agreement import AgreementError, preflight
    from voodoo.models import load_hf_model
    prep = _prepared(config, tmp_path_factory)
    model = load_hf_model(prep)
    with pytest.raises(AgreementError, match="skip_preflight") as ei:
        preflight(model, prep.base_gguf, zoo_tokens(model.config.vocab_size, 2, 128))
    print(f"{config}: KLD {ei.value.result['kld_mean']:.3g}, same top-p "
          f"{ei.value.result['same_top_p']:.3f}")
    assert ei.value.result["kld_mean"] > 1e-2


#: a tiny AFMoE (Arcee's Trinity) with muP input scaling, which llama.cpp applies to every
#: afmoe model and transformers only with ``mup_enabled`` (the published checkpoints set it)
_AFMOE = dict(model_type="afmoe", hidden_size=128, intermediate_size=256,
              moe_intermediate_size=128, num_hidden_layers=4, num_dense_layers=1,
              num_experts=4, num_experts_per_tok=2, num_shared_experts=1, route_scale=2.0,
              sliding_window=32, global_attn_every_n_layers=4, mup_enabled=True,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def test_preflight_names_the_settings_the_converter_looked_for_and_did_not_find(
        tmp_path, converter_ready):
    """AFMoE as transformers 5.25 saves it has no ``route_norm``. Its converter class writes
    llama.cpp's router-weight normalisation only when config.json names it, so llama.cpp does
    not renormalise the top-k weights that transformers does renormalise: the pre-flight
    stops it, and its message names the key that the converter looked for and config.json
    lacks. With ``"route_norm": true`` in config.json, as the published checkpoints have,
    the two agree, and nothing is named. Generic probing by the converter's base class
    (``rope_scaling`` and the like) is never named."""
    from voodoo.agreement import AgreementError, preflight
    from voodoo.models import converter_defaults, load_hf_model, prepare_model
    from zoo import _build
    plain = _build("AfmoeForCausalLM", _AFMOE, {}, tmp_path / "afmoe", 0)
    prep = prepare_model(plain, work_dir=tmp_path / "c1")
    assert converter_defaults(prep.base_gguf) == ["route_norm"]
    model = load_hf_model(prep)
    tokens = zoo_tokens(model.config.vocab_size, 2, 128)
    with pytest.raises(AgreementError, match="skip_preflight") as ei:
        preflight(model, prep.base_gguf, tokens)
    assert ei.value.result["kld_mean"] > 1e-2
    assert "`route_norm`" in str(ei.value) and "rope_scaling" not in str(ei.value)
    print(f"without route_norm: KLD {ei.value.result['kld_mean']:.3g}")

    named = _build("AfmoeForCausalLM", _AFMOE, {"config_json": {"route_norm": True}},
                   tmp_path / "afmoe_norm", 0)
    prep = prepare_model(named, work_dir=tmp_path / "c2")
    assert converter_defaults(prep.base_gguf) == []
    res = preflight(load_hf_model(prep), prep.base_gguf, tokens)
    assert res["kld_mean"] < MAX_KLD and res["converter_defaults"] == []
    # a setting config.json gives as null is not given either: llama.cpp uses its default
    # (Gemma 4's final_logit_softcapping: null in config.json, 30.0 in llama.cpp)
    null = _build("AfmoeForCausalLM", _AFMOE, {"config_json": {"route_norm": None}},
                  tmp_path / "afmoe_null", 0)
    assert json.loads((null / "config.json").read_text())["route_norm"] is None
    prep = prepare_model(null, work_dir=tmp_path / "c3")
    assert converter_defaults(prep.base_gguf) == ["route_norm"]


#: a tiny Solar Open (GQA, MoE with a shared expert): llama.cpp's converter class for it reads
#: ``partial_rotary_factor`` from the rope parameters with a default of 0.5, transformers' with
#: a default of 1.0
_SOLAR = dict(model_type="solar_open", hidden_size=128, num_hidden_layers=2,
              moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2,
              n_shared_experts=1, n_group=1, topk_group=1, tie_word_embeddings=False,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              vocab_size=49216)   # room for the two special tokens its converter looks up


def test_preflight_names_a_rope_parameter_the_converter_looked_for(tmp_path, converter_ready):
    """Settings the converter's class reads from transformers 5's ``rope_parameters`` (not
    the top level) are named too, as ``rope_parameters.<key>``: Solar Open's config.json as
    transformers writes it has no ``partial_rotary_factor`` there, the converter then rotates
    half of each head and transformers all of it; the pre-flight stops it and names the key.
    With the key in rope_parameters nothing is named. A lookup whose default is a dict (a
    section: ``full_attention``) is never named."""
    from transformers import AutoTokenizer

    from voodoo.agreement import AgreementError, preflight
    from voodoo.models import converter_defaults, load_hf_model, prepare_model
    from zoo import _build

    def build(name, **rope):
        kw = {**_SOLAR, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default", **rope}}
        d = _build("SolarOpenForCausalLM", kw, {}, tmp_path / name, 0)
        tok = AutoTokenizer.from_pretrained(d)   # the converter looks these two up by text
        tok.add_special_tokens({"additional_special_tokens": ["<unk>", "<|startoftext|>"]})
        tok.save_pretrained(d)
        return prepare_model(d, work_dir=tmp_path / f"{name}-c")

    prep = build("plain")
    assert "rope_parameters.partial_rotary_factor" in converter_defaults(prep.base_gguf)
    model = load_hf_model(prep)
    with pytest.raises(AgreementError, match="skip_preflight") as ei:
        preflight(model, prep.base_gguf, zoo_tokens(model.config.vocab_size, 2, 128))
    assert "`rope_parameters.partial_rotary_factor`" in str(ei.value)
    assert "full_attention" not in str(ei.value)
    prep = build("named", partial_rotary_factor=1.0)
    assert not any(k.startswith("rope_parameters.") for k in converter_defaults(prep.base_gguf))


def test_a_load_failure_names_what_a_parent_converter_class_looked_for(tmp_path,
                                                                      converter_ready):
    """GLM-4.7-Flash's converter class inherits DeepSeek-V2's (another module), which reads
    ``first_k_dense_replace``; transformers 5 writes ``mlp_layer_types`` instead, so the
    converter marks no layer dense and llama.cpp cannot load the file. The load failure's
    message names that key (a parent class's read counts), so the user knows what to add."""
    from transformers import AutoTokenizer

    from voodoo.agreement import LlamaCppLoadError, preflight
    from voodoo.models import converter_defaults, load_hf_model, prepare_model
    from zoo import _build
    kw = dict(model_type="glm4_moe_lite", hidden_size=128, intermediate_size=256,
              num_hidden_layers=2, moe_intermediate_size=128, n_routed_experts=4,
              num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=64, q_lora_rank=64,
              qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, num_attention_heads=4,
              num_key_value_heads=4, n_group=1, topk_group=1,
              mlp_layer_types=["dense", "sparse"], tie_word_embeddings=False, vocab_size=49216)
    d = _build("Glm4MoeLiteForCausalLM", kw, {}, tmp_path / "glm", 0)
    tok = AutoTokenizer.from_pretrained(d)   # the special tokens its converter looks up
    tok.add_special_tokens({"additional_special_tokens": ["[gMASK]", "<|user|>",
                                                         "<|observation|>"]})
    tok.save_pretrained(d)
    prep = prepare_model(d, work_dir=tmp_path / "c")
    assert "first_k_dense_replace" in converter_defaults(prep.base_gguf)
    model = load_hf_model(prep)
    with pytest.raises(LlamaCppLoadError) as ei:
        preflight(model, prep.base_gguf, zoo_tokens(model.config.vocab_size, 2, 128))
    assert "`first_k_dense_replace`" in str(ei.value), str(ei.value)


def test_a_byte_level_bpe_for_a_sentencepiece_family_is_named(tmp_path, converter_ready):
    """Jamba's converter reads its tokenizer as SentencePiece (a tokenizer.model, or a
    byte-fallback BPE tokenizer.json); given SmolLM2's byte-level BPE it fails with "Cannot
    find Llama BPE tokenizer". The message says what the converter wanted and what the folder
    holds, not only "copy the tokenizer files", which are there."""
    from voodoo.models import ModelPreparationError, prepare_model
    from zoo import _build
    kw = dict(model_type="jamba", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
              attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
              num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
              mamba_dt_rank=8, use_mamba_kernels=False, tie_word_embeddings=False)
    d = _build("JambaForCausalLM", kw, {}, tmp_path / "jamba", 0)
    with pytest.raises(ModelPreparationError) as ei:
        prepare_model(d, work_dir=tmp_path / "c")
    msg = str(ei.value)
    assert "BPE model with byte_fallback false" in msg and "tokenizer.model" in msg, msg


def test_a_work_dir_holding_another_models_conversion_is_converted_again(tmp_path,
                                                                         converter_ready):
    """prepare_model(work_dir=...) given a folder that holds another model's F32 GGUF converts
    this model again instead of reusing the other one's file."""
    from voodoo.ggufio import read_gguf
    from voodoo.models import prepare_model
    a = prepare_model(make_tiny("qwen3"), work_dir=tmp_path / "w")
    b = prepare_model(make_tiny("llama"), work_dir=tmp_path / "w")
    arch = read_gguf(b.base_gguf).fields["general.architecture"].contents()
    assert a.base_gguf == b.base_gguf and arch == "llama", arch


def test_yarn_without_truncation_is_loaded_as_ggml_computes_it(tmp_path, converter_ready):
    """A YaRN RoPE with ``truncate: false`` (gpt-oss's default in transformers): ggml always
    rounds the correction range, transformers does not, and the two differ more the farther
    apart the tokens (window out of play here). load_hf_model loads it with truncate true:
    llama.cpp and the torch model then agree."""
    from transformers import AutoModelForCausalLM

    from voodoo.agreement import llama_vs_torch
    from voodoo.models import load_hf_model, prepare_model
    from zoo import GPT_OSS, _build
    arch, cfg, extra = GPT_OSS
    d = _build(arch, dict(cfg, sliding_window=256), extra, tmp_path / "oss", 0)
    assert json.loads((d / "config.json").read_text())["rope_parameters"]["truncate"] is False
    prep = prepare_model(d, work_dir=tmp_path / "c")
    tokens = zoo_tokens(json.loads((d / "config.json").read_text())["vocab_size"], 2, 128)
    raw = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    before = llama_vs_torch(prep.base_gguf, raw, tokens)["kld_mean"]
    model = load_hf_model(prep)
    assert model.config.rope_parameters["truncate"] is True
    after = llama_vs_torch(prep.base_gguf, model, tokens)["kld_mean"]
    print(f"YaRN truncate false: KLD {before:.3g}; loaded as ggml computes it: {after:.3g}")
    assert before > 1e-3 and after < MAX_KLD, (before, after)


def test_make_tiny_is_deterministic(tmp_path):
    from safetensors.torch import load_file
    a = make_tiny("qwen3", tmp_path / "a", seed=3)
    b = make_tiny("qwen3", tmp_path / "b", seed=3)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_preflight_runs_at_the_training_length(tmp_path, converter_ready):
    """A Mistral whose sliding window (160 tokens) llama.cpp does not apply (its converter
    writes Mistral as the llama architecture, full attention): on 128-token chunks the two agree,
    so a check shorter than the training blocks passed it and the gates trained on a model
    llama.cpp does not run (found by a tester at window 200, --seq_len 512: KL 4.3). The run's
    pre-flight uses chunks of --seq_len and stops it."""
    from test_cli_errors import error_line
    from test_pipeline import run_cli
    from voodoo.agreement import llama_vs_torch, preflight_shape
    from voodoo.models import load_hf_model, prepare_model
    from zoo import _build
    cfg = dict(FAMILIES["mistral"][1], sliding_window=160)
    d = _build("MistralForCausalLM", cfg, FAMILIES["mistral"][2], tmp_path / "mistral_w160", 0)
    prep = prepare_model(d, work_dir=tmp_path / "cache")
    model = load_hf_model(prep)
    short = llama_vs_torch(prep.base_gguf, model, zoo_tokens(model.config.vocab_size, 4, 128))
    assert short["kld_mean"] < 1e-3, short["kld_mean"]  # the window is out of play
    assert preflight_shape(256) == (2, 256) and preflight_shape(128) == (4, 128)
    assert preflight_shape(4096) == (1, 4096)
    rc, _, err = run_cli(["train", "--model", str(d), "--output_dir", str(tmp_path / "run"),
                          "--seq_len", "256", "--n_train_blocks", "2", "--n_eval_blocks", "1",
                          "--imatrix_blocks", "1", "--no_ray", "--max_steps", "1"])
    line = error_line(rc, err)
    assert "pre-flight check failed" in line and "2 chunks of 256 tokens" in line, line
    assert "--seq_len 256" in line and "--skip_preflight" in line, line


def test_llama_cpps_tokenizer_agrees_on_a_sentencepiece_vocabulary(tmp_path_factory):
    """The pre-flight's tokenizer comparison on the zoo's SentencePiece (unigram,
    ``tokenizer.model``) vocabulary, which llama.cpp reads with its SPM tokenizer: transformers
    and llama-tokenize cut English text (digits, runs of spaces, punctuation, a leading space)
    alike, the calibration text's way. (No newline: this tiny vocabulary has neither a newline
    piece nor byte pieces, and llama.cpp's SPM tokenizer aborts on a character it cannot map;
    real SentencePiece vocabularies carry byte fallback; such characters are replaced.)"""
    from voodoo.llamacpp import LlamaCppNotBuilt, tool_path
    try:
        tool_path("llama-tokenize")
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    import torch
    from transformers import AutoTokenizer

    from voodoo.agreement import calibration_text, tokenizer_agreement
    prep = _prepared("gemma2", tmp_path_factory)
    tok = AutoTokenizer.from_pretrained(make_tiny("gemma2"))
    text = ("The 2024 build, version 3.14 (beta) -- see docs/build.md.  Two   spaces and "
            "more; \"quoted\" words: llama.cpp's ggml_tensor, 100,000 rows! ") * 8
    res = tokenizer_agreement(prep.base_gguf, tok, text)
    assert res["same"] and res["n_differ"] == 0 and res["n_llama"] > 100, res
    ids = tok(" " + text, add_special_tokens=False).input_ids
    cal = calibration_text(tok, torch.tensor([ids]))
    assert not cal[0].isspace() and tokenizer_agreement(prep.base_gguf, tok, cal)["same"]
    # a newline it has no piece for: llama.cpp aborts on it, and the error says what that
    # means; the comparison replaces it by a space first, as Voodoo's other texts for llama.cpp
    from voodoo.agreement import llama_tokenize
    from voodoo.evaluate import PerplexityError
    with pytest.raises(PerplexityError, match=r"(?s)aborted \(signal 6\).*unordered_map::at.*"
                       "cannot tokenize this text"):
        llama_tokenize(prep.base_gguf, "one line\nanother")
    res = tokenizer_agreement(prep.base_gguf, tok, "one line\nanother")
    assert res["same"] and res["unreadable"] == ["\n"], res


def test_a_bpe_tokenizer_without_the_class_the_converter_reads_names_it(tmp_path):
    """Phi-3's converter reads a SentencePiece tokenizer.model unless tokenizer_config.json's
    tokenizer_class is "GPT2Tokenizer" (conversion/phi.py). A new user's Phi-3 with a BPE
    tokenizer.json was told to copy tokenizer.json and tokenizer_config.json, which were
    there; the message now names the class, read from the converter's source."""
    import shutil

    from voodoo.models import ModelPreparationError, prepare_model
    d = tmp_path / "my-small-model"
    shutil.copytree(make_tiny("phi3"), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg.pop("tokenizer_class") == "GPT2Tokenizer"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelPreparationError) as ei:   # no class at all
        prepare_model(d, work_dir=tmp_path / "work")
    msg = str(ei.value)
    assert f"{d / 'tokenizer_config.json'} has none: set \"tokenizer_class\": " \
           "\"GPT2Tokenizer\" there" in msg, msg
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"   # another class
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelPreparationError) as ei:
        prepare_model(d, work_dir=tmp_path / "work")
    msg = str(ei.value)
    assert "unless tokenizer_config.json's \"tokenizer_class\" is 'GPT2Tokenizer'" in msg, msg
    assert f"set \"tokenizer_class\": \"GPT2Tokenizer\" in {d / 'tokenizer_config.json'}" in msg
