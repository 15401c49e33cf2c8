"""A zoo of tiny random HF causal LMs of many families, built offline.

:func:`make_tiny` writes an HF folder that transformers loads and the pinned llama.cpp converter
(``convert_hf_to_gguf.py``) converts. Every family uses SmolLM2's tokenizer (vocab 49152, from
``voodoo.models._smollm2_tokenizer_dir``) except where the converter insists on a SentencePiece
``tokenizer.model`` (gemma2): there a tiny SentencePiece model is trained offline
(:func:`_spm_tokenizer_dir`). Shapes are tiny (hidden 128 or 256, 2 layers; hybrids have both
layer kinds) with row lengths (``n_per_row``) that are multiples of 32 (hidden 256 / expert
width 256 where the family allows), so every ggml type applies.

Weights (:func:`_spread_weights`): matrices ~ N(0, 1/hidden), matrices with a vocabulary axis
~ N(0, (2.5)^2/hidden) so logits have a standard deviation of ~2.5 (next-token distributions far
from uniform), 1-D parameters (norms, biases, SSM A/D/dt) their init plus N(0, 0.1^2) so that
norm shifts (Gemma's ``1 + w``) and biases matter. Seeded: the same family and seed give the
same bytes.

:data:`FAMILIES` is the table of configurations; ``ZOO_DISAGREE`` holds configurations that
llama.cpp is known to compute differently from transformers (for the pre-flight test).
Folders are cached per process under ``$VOODOO_ZOO_DIR`` or a temporary folder
(:func:`zoo_dir`), so tests can call :func:`make_tiny` freely.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["FAMILIES", "ZOO_DISAGREE", "make_tiny", "zoo_dir", "zoo_tokens", "VOCAB",
           "make_mxfp4_gpt_oss", "mxfp4_values"]

#: SmolLM2's vocabulary size; its BOS ``<|im_start|>`` = 1, EOS ``<|im_end|>`` = 2.
VOCAB = 49152
_TOK = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=2)
#: attention block shared by most families: 4 query heads, 2 KV heads of 32 (GQA, Q/K permute)
_ATT = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)

#: Gemma's post-norms scaled up (weight 1 + w, w += 3) so the layers' outputs are not drowned by
#: the sqrt(hidden)-scaled embedding (else every next-token argmax is the input token).
_GEMMA_POST = {"post_attention_layernorm": 3.0, "post_feedforward_layernorm": 3.0}

#: family -> (architecture class name, config kwargs, extra). ``extra``: ``tokenizer``
#: ("smollm2" | "spm"), ``tokenizer_class`` (override in tokenizer_config.json: phi3's converter
#: reads it to pick the GPT-2 vocab path), ``vocab_std``/``shift_1d`` (see _spread_weights:
#: granite's logits_scaling and falcon_h1's lm_head_multiplier shrink the logits, so their
#: vocabulary matrices are drawn wider), ``config_json`` (keys written over the saved
#: config.json).
FAMILIES: dict[str, tuple[str, dict, dict]] = {
    "llama": ("LlamaForCausalLM", dict(
        model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        tie_word_embeddings=False, **_ATT), {}),
    "mistral": ("MistralForCausalLM", dict(
        model_type="mistral", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        sliding_window=None, **_ATT), {}),
    "qwen2": ("Qwen2ForCausalLM", dict(
        model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        # transformers 5 swaps in Qwen2Tokenizer (Qwen's pre-tokenizer regex) for any qwen2
        # folder, whose hash the converter's get_vocab_base_pre() does not know: SentencePiece
        {"tokenizer": "spm"}),
    "qwen3": ("Qwen3ForCausalLM", dict(
        model_type="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        tie_word_embeddings=True, **_ATT), {}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(
        model_type="qwen3_moe", hidden_size=128, intermediate_size=256, moe_intermediate_size=256,
        num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        tie_word_embeddings=False, **_ATT), {}),
    "gemma2": ("Gemma2ForCausalLM", dict(
        model_type="gemma2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        query_pre_attn_scalar=32, sliding_window=32, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, **_ATT), {"tokenizer": "spm", "shift_1d": _GEMMA_POST}),
    # llama.cpp's gemma3 reads no sliding pattern from the converter's GGUF and uses 5 sliding
    # : 1 full (load_swa_pattern(ml, 6)), as transformers' default layer_types; 6 layers so
    # both kinds appear.
    "gemma3": ("Gemma3ForCausalLM", dict(
        model_type="gemma3_text", hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        query_pre_attn_scalar=32, sliding_window=32, **_ATT), {"shift_1d": _GEMMA_POST}),
    "gemma3_mm": ("Gemma3ForConditionalGeneration", dict(
        model_type="gemma3",
        text_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                         query_pre_attn_scalar=32, sliding_window=32, **_ATT, **_TOK),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=2, image_size=64, patch_size=16),
        mm_tokens_per_image=4, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
        image_token_index=VOCAB - 1), {"shift_1d": _GEMMA_POST}),
    # the converter's Mistral3Model hands every tensor to an inner model class with its own
    # GGUF writer (``impl``: Ministral3 here, Mistral4 for model_type mistral4)
    "mistral3": ("Mistral3ForConditionalGeneration", dict(
        model_type="mistral3",
        text_config=dict(model_type="mistral", hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, sliding_window=None, **_ATT, **_TOK),
        vision_config=dict(model_type="pixtral", hidden_size=64, intermediate_size=128,
                           num_hidden_layers=1, num_attention_heads=2, head_dim=32,
                           image_size=64, patch_size=16),
        image_token_index=VOCAB - 1, spatial_merge_size=2), {}),
    "phi3": ("Phi3ForCausalLM", dict(
        model_type="phi3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4), {"tokenizer_class": "GPT2Tokenizer"}),
    "lfm2": ("Lfm2ForCausalLM", dict(
        model_type="lfm2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, block_auto_adjust_ff_dim=False,
        layer_types=["conv", "full_attention"], full_attn_idxs=[1]), {}),
    # no rope (position_embedding_type None): llama.cpp's granite hybrid with rope disagrees
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", dict(
        model_type="granitemoehybrid", hidden_size=128, intermediate_size=256,
        shared_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=32,
        mamba_d_state=32, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=64, position_embedding_type=None, embedding_multiplier=2.0,
        logits_scaling=1.5, residual_multiplier=0.7, attention_multiplier=0.2),
        # transformers 5 saves layer_types as linear_attention/full_attention; the converter
        # only knows the checkpoints' own spelling (GraniteHybridModel.get_attn_layers looks
        # for "attention") and would write head_count_kv [0, 0] with attention tensors in
        # layer 1, a GGUF llama.cpp refuses. Written back as IBM's checkpoints spell it.
        {"vocab_std": 2.5 * 1.5, "config_json": {"layer_types": ["mamba", "attention"]}}),
    "falcon_h1": ("FalconH1ForCausalLM", dict(
        model_type="falcon_h1", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, mamba_d_ssm=256,
        mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=32,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64, lm_head_multiplier=0.5,
        embedding_multiplier=2.0, mlp_multipliers=[0.7, 1.3], key_multiplier=0.8,
        attention_out_multiplier=0.9, attention_in_multiplier=1.1,
        ssm_multipliers=[0.6, 0.7, 0.8, 0.9, 1.2], ssm_in_multiplier=1.1,
        ssm_out_multiplier=0.9), {"vocab_std": 2.5 / 0.5}),
    "qwen3_next": ("Qwen3NextForCausalLM", dict(
        model_type="qwen3_next", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], head_dim=32,
        num_attention_heads=4, num_key_value_heads=2, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128), {}),
    "olmo2": ("Olmo2ForCausalLM", dict(
        model_type="olmo2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2), {}),
    "gpt2": ("GPT2LMHeadModel", dict(
        # n_ctx: the converter reads hparams["n_ctx"], which transformers 5 no longer saves
        model_type="gpt2", n_embd=128, n_layer=2, n_head=4, n_positions=1024, n_ctx=1024,
        resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0), {}),
    # MLA (multi-head latent attention) + MoE with a shared expert: kv_b_proj is read by
    # two GGUF tensors, attn_k_b per head transposed and attn_v_b as it is (3-D, one imatrix
    # vector per head)
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(
        model_type="deepseek_v2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, num_attention_heads=4,
        num_key_value_heads=4, topk_method="greedy", n_group=1, topk_group=1,
        rope_scaling=None), {}),
    # parallel attention + MLP, partial rotary, LayerNorm with biases; rotary_pct written
    # into config.json as Pythia's checkpoints have it (transformers 5 saves
    # rope_parameters, which the pinned converter does not read)
    "gpt_neox": ("GPTNeoXForCausalLM", dict(
        model_type="gpt_neox", hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, rotary_pct=0.25, tie_word_embeddings=False),
        {"config_json": {"rotary_pct": 0.25}}),
    "mamba2": ("Mamba2ForCausalLM", dict(
        model_type="mamba2", hidden_size=128, num_hidden_layers=2, num_heads=8, head_dim=32,
        expand=2, state_size=32, n_groups=1, conv_kernel=4, chunk_size=64,
        tie_word_embeddings=False), {}),
    # untied head on a tied-by-default family: the converter drops output.weight when it
    # equals the embedding, so the tensor map's probe checkpoints must keep the two apart
    "falcon_mamba": ("FalconMambaForCausalLM", dict(
        model_type="falcon_mamba", hidden_size=128, num_hidden_layers=2, state_size=16,
        expand=2, conv_kernel=4, time_step_rank=32, use_mambapy=False,
        tie_word_embeddings=False), {}),
}

#: Configurations transformers runs but llama.cpp (pinned) computes differently: gemma3 with a
#: sliding/full pattern other than 5:1 (llama.cpp treats layer 1 as sliding too).
ZOO_DISAGREE: dict[str, tuple[str, dict, dict]] = {
    "gemma3_pattern_1_1": ("Gemma3ForCausalLM", dict(
        FAMILIES["gemma3"][1], num_hidden_layers=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"]), {}),
}

ZOO_DISAGREE["granitemoehybrid_rope"] = ("GraniteMoeHybridForCausalLM", dict(
    FAMILIES["granitemoehybrid"][1], position_embedding_type="rope"),
    FAMILIES["granitemoehybrid"][2])
ZOO_DISAGREE["smollm3_nope_1_1"] = ("SmolLM3ForCausalLM", dict(
    model_type="smollm3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    no_rope_layers=[1, 0], **_ATT), {})

_CACHE: dict[tuple[str, int], Path] = {}


def zoo_dir() -> Path:
    """Where :func:`make_tiny` caches folders when no ``out_dir`` is given:
    ``$VOODOO_ZOO_DIR`` or one temporary folder per process."""
    env = os.environ.get("VOODOO_ZOO_DIR")
    if env:
        return Path(env)
    global _TMP
    try:
        return _TMP
    except NameError:
        _TMP = Path(tempfile.mkdtemp(prefix="voodoo-zoo-"))
        atexit.register(shutil.rmtree, _TMP, ignore_errors=True)   # ~0.8 GB per test run
        return _TMP


def _spm_tokenizer_dir(vocab_size: int = 1024) -> Path:
    """A tiny SentencePiece (unigram) ``tokenizer.model`` trained offline on llama.cpp's own
    docs (pinned source, so deterministic), cached under ``<voodoo cache>/zoo/spm-<vocab>``.
    Ids: 0 <unk>, 1 <s>, 2 </s>, 3 <pad>."""
    from voodoo.llamacpp import cache_root, source_dir
    d = cache_root() / "zoo" / f"spm-{vocab_size}"
    if (d / "tokenizer.model").is_file():
        return d
    import sentencepiece as spm
    src = source_dir()
    text = "\n".join(p.read_text(errors="replace") for p in sorted((src / "docs").rglob("*.md")))
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.partial-", dir=d.parent))
    (tmp / "corpus.txt").write_text(text)
    spm.SentencePieceTrainer.train(
        input=str(tmp / "corpus.txt"), model_prefix=str(tmp / "tokenizer"),
        vocab_size=vocab_size, model_type="unigram", character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, num_threads=1, seed_sentencepiece_size=100000,
        input_sentence_size=200000, shuffle_input_sentence=False, minloglevel=2)
    (tmp / "corpus.txt").unlink()
    (tmp / "tokenizer.vocab").unlink(missing_ok=True)
    if d.exists():
        shutil.rmtree(d)
    os.replace(tmp, d)
    return d


def _spread_weights(model, seed: int, hidden: int, vocab: int, vocab_std: float = 2.5,
                    shift_1d: dict | None = None) -> None:
    """Re-draws every parameter (see the module docstring), in name order from one seeded
    generator, so the weights do not depend on transformers' init order. ``vocab_std``: std x
    sqrt(hidden) of matrices with a vocabulary axis; ``shift_1d``: {name substring: added
    constant} for 1-D parameters (e.g. Gemma's post-norms, so that the layers' outputs are not
    drowned by the sqrt(hidden)-scaled embedding)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() >= 2:
                std = (vocab_std if vocab in p.shape else 1.0) / hidden ** 0.5
                if p.dim() == 3 and p.shape[1] == 1:               # depthwise conv (C, 1, K)
                    std = 1.0 / p.shape[-1] ** 0.5
                if p.dim() == 2 and p.shape[0] <= 64 and p.shape[1] == hidden and \
                        ("router" in name or name.endswith("gate.weight")):
                    # MoE routers: decisive routing (expert logits ~6x apart in std), so that
                    # the 8-bit activations of llama.cpp's quantized matmuls do not flip the
                    # top-k experts at near-ties, which random routers are full of
                    std *= 6.0
                w = torch.randn(p.shape, generator=g) * std
                if vocab in p.shape:
                    # Zipf-like tokens: each token's row (or column) scaled by exp(N(0, 0.4^2)),
                    # renormalised to unit mean square, so the top of a next-token distribution
                    # is a few well-separated tokens (as in a trained LM) instead of a near-tie
                    # among 49152 Gaussian logits, where llama.cpp's 8-bit activation
                    # quantization flips the argmax at ~6% of positions.
                    ax = list(p.shape).index(vocab)
                    s = torch.exp(torch.randn(p.shape[ax], generator=g) * 0.4)
                    s = s / s.square().mean().sqrt()
                    w = w * s.reshape([-1 if i == ax else 1 for i in range(p.dim())])
                p.copy_(w)
            else:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
                for sub, c in (shift_1d or {}).items():
                    if sub in name:
                        p.add_(c)


def _build(arch: str, cfg_kw: dict, extra: dict, out: Path, seed: int) -> Path:
    import torch
    import transformers
    from transformers import AutoConfig

    from voodoo.models import _smollm2_tokenizer_dir
    kw = dict(cfg_kw)
    model_type = kw.pop("model_type")
    tok_kind = extra.get("tokenizer", "smollm2")
    if tok_kind == "spm":
        tok_dir = _spm_tokenizer_dir()
        kw.update(vocab_size=1024, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    elif "text_config" not in kw:
        tok_dir = _smollm2_tokenizer_dir()
        kw = {**_TOK, **kw}
    else:
        tok_dir = _smollm2_tokenizer_dir()
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).float().eval()
    text = cfg.get_text_config()
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd")
    _spread_weights(model, seed, hidden, text.vocab_size, extra.get("vocab_std", 2.5),
                    extra.get("shift_1d"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        for f in tok_dir.iterdir():
            if f.is_file():
                shutil.copy(f, tmp / f.name)
        if tok_kind == "spm":
            (tmp / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "GemmaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                 "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True,
                 "add_eos_token": False}, indent=1))
        if extra.get("config_json"):
            cj = tmp / "config.json"
            cj.write_text(json.dumps({**json.loads(cj.read_text()), **extra["config_json"]},
                                     indent=2))
        if extra.get("tokenizer_class"):
            tc = tmp / "tokenizer_config.json"
            d = json.loads(tc.read_text())
            d["tokenizer_class"] = extra["tokenizer_class"]
            tc.write_text(json.dumps(d, indent=1))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def make_tiny(family: str, out_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Writes (once) a tiny random HF folder of ``family`` and returns its path.

    Args:
        family: a key of :data:`FAMILIES` or :data:`ZOO_DISAGREE`.
        out_dir: the folder to write; default ``zoo_dir()/<family>-s<seed>`` ("phi3" spelt
            "phi_3": llama.cpp special-cases a general.name containing "phi3"). An existing
            complete folder (``config.json`` and safetensors) is reused, not rewritten.
        seed: seeds transformers' init and :func:`_spread_weights`.

    Written to a temporary folder and renamed into place. Raises KeyError for an unknown
    family."""
    table = {**FAMILIES, **ZOO_DISAGREE}
    if family not in table:
        raise KeyError(f"unknown zoo family {family!r}; known: {', '.join(sorted(table))}")
    key = (family, seed) if out_dir is None else (str(out_dir), seed)
    if key in _CACHE and (_CACHE[key] / "config.json").is_file():
        return _CACHE[key]
    # llama.cpp's vocab loader special-cases models whose general.name (from the folder name)
    # contains "phi3" and then requires "</s>", "<unk>", "<s>" tokens: keep it out of the name
    out = Path(out_dir) if out_dir is not None else \
        zoo_dir() / f"{family.replace('phi3', 'phi_3')}-s{seed}"
    if not ((out / "config.json").is_file() and any(out.glob("*.safetensors"))):
        arch, cfg_kw, extra = table[family]
        _build(arch, cfg_kw, extra, out, seed)
    _CACHE[key] = out
    return out


#: gpt-oss as OpenAI ships it: experts as MXFP4 blocks (``*_blocks``/``*_scales`` and a
#: ``quantization_config``), which llama.cpp's converter repacks into MXFP4 tensors
GPT_OSS = ("GptOssForCausalLM", dict(
    model_type="gpt_oss", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
    layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32), {})
#: the 16 values an MXFP4 (E2M1) code stands for (ggml's ``kvalues_mxfp4`` / 2)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def make_mxfp4_gpt_oss(seed: int = 0) -> Path:
    """A tiny gpt-oss folder whose expert weights are stored as MXFP4 the way OpenAI's
    checkpoints store them: ``<name>_blocks`` (uint8, two E2M1 codes a byte, low nibble first,
    ``[experts, rows, cols/32, 16]``) and ``<name>_scales`` (uint8 E8M0 exponents + 127,
    ``[experts, rows, cols/32]``), rows being the output features, and ``quantization_config``
    ``{"quant_method": "mxfp4"}``. Scale per 32 values: ``2^ceil(log2(amax / 6))``. Written
    once under :func:`zoo_dir`."""
    import torch
    from safetensors.torch import load_file, save_file
    out = zoo_dir() / f"gpt_oss_mxfp4-s{seed}"
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    tmp = _build(*GPT_OSS, zoo_dir() / f".gpt_oss_float-s{seed}", seed)
    fp4 = torch.tensor(FP4_VALUES)
    d = {}
    for f in sorted(tmp.glob("*.safetensors")):
        d.update(load_file(f))
        f.unlink()
    packed = {}
    for k, v in d.items():
        if not (k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj")):
            packed[k] = v
            continue
        w = v.transpose(1, 2).contiguous()             # [experts, out, in]
        g = w.reshape(*w.shape[:2], -1, 32)
        e = torch.ceil(torch.log2(g.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
        idx = ((g / torch.pow(2.0, e)[..., None])[..., None] - fp4).abs().argmin(-1)
        idx = idx.to(torch.uint8)
        packed[k + "_blocks"] = (idx[..., 0::2] | (idx[..., 1::2] << 4)).contiguous()
        packed[k + "_scales"] = (e + 127).to(torch.uint8).contiguous()
    save_file(packed, tmp / "model.safetensors", metadata={"format": "pt"})
    idx_file = tmp / "model.safetensors.index.json"
    if idx_file.exists():
        idx_file.unlink()
    cj = tmp / "config.json"
    cfg = json.loads(cj.read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    cj.write_text(json.dumps(cfg, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def mxfp4_values(blocks, scales):
    """Float values of MXFP4 ``blocks``/``scales`` as :func:`make_mxfp4_gpt_oss` stores them:
    ``[..., rows, cols]`` float32, decoded with :data:`FP4_VALUES` (independently of ggml)."""
    import torch
    fp4 = torch.tensor(FP4_VALUES)
    lo, hi = (blocks & 15).long(), (blocks >> 4).long()
    codes = torch.stack([lo, hi], -1).reshape(*blocks.shape[:-1], 32)
    vals = fp4[codes] * torch.pow(2.0, scales.float() - 127)[..., None]
    return vals.reshape(*vals.shape[:-2], -1)


def zoo_tokens(vocab_size: int, n_chunk: int = 4, n_ctx: int = 128, seed: int = 0):
    """LongTensor ``(n_chunk, n_ctx)`` of token ids drawn uniformly from ``[4, vocab_size)``
    (seeded): llama.cpp and transformers see ids only, so any ids test agreement."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab_size, (n_chunk, n_ctx), generator=g)
