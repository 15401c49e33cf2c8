"""Checkpoints that ship quantized weights (gpt-oss's MXFP4 experts): loaded dequantized,
quantized from the values llama.cpp's converter keeps, their own type offered, llama-quantize
and the pre-flight working on the base GGUF that holds them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from zoo import make_mxfp4_gpt_oss, mxfp4_values, zoo_tokens  # noqa: E402


def test_a_method_transformers_cannot_dequantize_is_refused_with_the_fix(tmp_path):
    from voodoo.models import ModelPreparationError, dequantizing_config, load_hf_model
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}))
    with pytest.raises(ModelPreparationError) as e:
        load_hf_model(tmp_path)
    msg = str(e.value)
    assert "gptq-quantized" in msg and "BF16/F16/F32 copy" in msg and "mxfp4" in msg
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}))
    assert dequantizing_config(tmp_path).dequantize is True
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert dequantizing_config(tmp_path) is None


@pytest.mark.slow
def test_mxfp4_experts_from_the_checkpoint_to_llama_cpp(tmp_path):
    import cython_ggml as cg
    import torch
    from safetensors.torch import load_file

    from voodoo.agreement import llama_vs_torch, preflight
    from voodoo.cli import _source_type_menus
    from voodoo.export import (dequantized_copy, prequantized_tensors, quantize_with_llama,
                               requantize_args)
    from voodoo.ggufio import read_gguf
    from voodoo.pipeline import base_weights, load_context, make_menus

    hf = make_mxfp4_gpt_oss()
    # loads dequantized, and the tensor map's check against the base GGUF passes
    ctx = load_context(str(hf), work_dir=tmp_path / "work")
    base = ctx.prepared.base_gguf
    pre = prequantized_tensors(base)
    assert pre and set(pre.values()) == {"MXFP4"}
    assert len(pre) == 3 * 2  # gate, up, down experts of both layers
    assert requantize_args(base) == ["--allow-requantize"]

    # base_weights decodes them to the checkpoint's own values (decoded here without ggml)
    st = load_file(next(hf.glob("*.safetensors")))
    w = base_weights(base, names=list(pre))
    down = mxfp4_values(st["model.layers.0.mlp.experts.down_proj_blocks"],
                        st["model.layers.0.mlp.experts.down_proj_scales"])
    got = w["blk.0.ffn_down_exps.weight"]
    assert got.dtype == np.float32 and got.shape == (down.shape[0] * down.shape[1], down.shape[2])
    np.testing.assert_array_equal(got, down.reshape(got.shape).numpy())

    # MXFP4 joins those tensors' menus, and libggml re-quantizing the values gives them back
    menus = _source_type_menus(ctx, make_menus(ctx.specs))
    for n in pre:
        assert "MXFP4" in menus[n]
    again = cg.dequantize(cg.quantize(np.ascontiguousarray(got), "MXFP4").reshape(-1), "MXFP4",
                          got.shape[1])
    np.testing.assert_array_equal(again, got)
    others = [n for n in menus if n not in pre]
    assert others and all("MXFP4" not in menus[n] for n in others)

    # llama-quantize quantizes them again only with --allow-requantize (added for this base)
    out = quantize_with_llama(base, tmp_path / "q8.gguf", default_type="Q8_0")
    types = {t.name: t.tensor_type.name for t in read_gguf(out).tensors}
    assert all(types[n] == "Q8_0" for n in pre)

    # the pre-flight compares transformers with a dequantized copy: llama.cpp's activation
    # rounding for MXFP4 matmuls is not an architecture disagreement
    deq = dequantized_copy(base)
    assert deq != base and not prequantized_tensors(deq)
    tokens = zoo_tokens(int(ctx.model.config.vocab_size), 4, 64)
    with torch.no_grad():
        res = preflight(ctx.model, base, tokens)
    raw = llama_vs_torch(base, ctx.model, tokens)
    assert res["kld_mean"] <= res["max_kld"]
    assert res["kld_mean"] < raw["kld_mean"] and raw["kld_mean"] > res["max_kld"]


def _fp8_copy(src: Path, dst: Path, block: int = 128) -> Path:
    """``src`` (an HF folder) with every Linear ``*proj.weight`` stored as DeepSeek-style block
    FP8: float8_e4m3fn values and a ``weight_scale_inv`` per ``block x block`` tile
    (amax / 448), ``quantization_config`` ``{"quant_method": "fp8", ...}``."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    f = next(dst.glob("*.safetensors"))
    out = {}
    for k, v in load_file(f).items():
        if not (k.endswith("proj.weight") and v.ndim == 2):
            out[k] = v
            continue
        n_o, n_i = -(-v.shape[0] // block), -(-v.shape[1] // block)
        s = torch.zeros(n_o, n_i)
        q = torch.empty_like(v, dtype=torch.float8_e4m3fn)
        for a in range(n_o):
            for b in range(n_i):
                tile = v[a * block:(a + 1) * block, b * block:(b + 1) * block]
                s[a, b] = tile.abs().max() / 448.0
                q[a * block:(a + 1) * block, b * block:(b + 1) * block] = \
                    (tile / s[a, b]).to(torch.float8_e4m3fn)
        out[k], out[k + "_scale_inv"] = q, s
    f.unlink()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cj = dst / "config.json"
    cfg = json.loads(cj.read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "fmt": "e4m3", "weight_block_size": [block, block]}
    cj.write_text(json.dumps(cfg, indent=2))
    return dst


def test_block_fp8_checkpoint_loads_as_the_converter_dequantizes_it(tmp_path):
    """transformers' FP8 dequantization equals the converter's (``dequant_simple`` in the pinned
    ``conversion/base.py``): the tensor map's check against the base GGUF passes, and the
    base holds no quantized weight (the converter dequantizes FP8 itself). Without a GPU
    transformers dequantizes FP8 on its own; with one it keeps FP8 Linears unless asked, which
    :func:`voodoo.models.dequantizing_config` does."""
    from zoo import make_tiny

    from voodoo.export import prequantized_tensors
    from voodoo.models import dequantizing_config
    from voodoo.pipeline import load_context
    hf = _fp8_copy(make_tiny("llama"), tmp_path / "llama-fp8")
    qc = dequantizing_config(hf)
    assert type(qc).__name__ == "FineGrainedFP8Config" and qc.dequantize is True
    ctx = load_context(str(hf), work_dir=tmp_path / "work")
    assert ctx.model.model.layers[0].self_attn.q_proj.weight.dtype.is_floating_point
    assert ctx.model.model.layers[0].self_attn.q_proj.weight.dtype.itemsize == 4
    assert not prequantized_tensors(ctx.prepared.base_gguf)
