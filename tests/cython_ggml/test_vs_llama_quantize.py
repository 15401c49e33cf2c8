"""Byte-identity with the built llama-quantize: an F32 GGUF (written with gguf's writer) whose
tensors have 256-multiple and non-256 row lengths is quantized by llama-quantize with one
--tensor-type override per tensor and an imatrix; every tensor must equal cython_ggml's bytes
for the type llama.cpp wrote (its shape fallback applied) and the same imatrix."""

import subprocess

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from voodoo.ggufio import read_gguf

import cython_ggml as cg
from voodoo import llamacpp
from voodoo.quants import fallback_type

pytestmark = pytest.mark.slow

TYPES = ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "Q3_K", "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_S",
         "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S", "IQ4_NL", "Q5_1", "Q5_0", "Q4_1", "Q4_0",
         "MXFP4"]
ROLES = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
#: per block: the row length of its tensors. Blocks 0-2 (256-multiples) hold every type
#: natively; 576 (SmolLM2's width) exercises the 32-block fallbacks, and 200, which fits no
#: quantized block, the F16 fallback.
WIDTHS = [512, 1536, 512, 576, 576, 200]


def _tool(name):
    try:
        return llamacpp.tool_path(name)
    except llamacpp.LlamaCppNotBuilt as e:
        pytest.skip(str(e))


def _plan():
    """[(gguf name, weights f32 (rows, n_per_row), requested type)]"""
    rng = np.random.default_rng(42)
    native = TYPES + TYPES[:1]  # 21 tensors in blocks 0-2
    asked = native + ["Q6_K", "Q5_K", "Q4_K", "Q3_K", "IQ4_XS", "IQ2_XXS", "Q8_0",
                      "Q2_K", "IQ1_S", "IQ3_S", "Q5_1", "Q4_0", "IQ4_NL", "MXFP4",
                      "Q8_0", "Q4_K", "IQ2_S", "Q6_K", "Q4_0", "IQ4_NL", "MXFP4"]
    plan, i = [], 0
    for blk, width in enumerate(WIDTHS):
        for role in ROLES:
            w = (rng.standard_normal((32, width)) * rng.uniform(0.005, 0.1)).astype(np.float32)
            w[3, :64] = 0.0  # a zero stretch, as real models have
            plan.append((f"blk.{blk}.{role}.weight", w, asked[i]))
            i += 1
    return plan


def _write_model(path, plan):
    wr = GGUFWriter(str(path), "llama")
    wr.add_context_length(256)
    wr.add_embedding_length(512)
    wr.add_block_count(len(WIDTHS))
    wr.add_feed_forward_length(1024)
    wr.add_head_count(4)
    wr.add_head_count_kv(4)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_file_type(0)  # ALL_F32
    for name, w, _ in plan:
        wr.add_tensor(name, w)
    for blk in range(len(WIDTHS)):
        wr.add_tensor(f"blk.{blk}.attn_norm.weight", np.ones(512, np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def _write_imatrix(path, plan):
    """llama.cpp's GGUF imatrix: <name>.in_sum2 (f32, n_per_row) and <name>.counts (f32, 1)."""
    rng = np.random.default_rng(7)
    sums, counts = {}, {}
    wr = GGUFWriter(str(path), "")  # no architecture KV, as llama-imatrix writes
    wr.add_type("imatrix")
    wr.add_array("imatrix.datasets", ["voodoo-test"])
    wr.add_uint32("imatrix.chunk_count", 3)
    wr.add_uint32("imatrix.chunk_size", 512)
    for name, w, _ in plan:
        s = (rng.gamma(0.8, 1.0, w.shape[1]) ** 2 * 300).astype(np.float32)
        s[:5] = 0.0
        c = np.array([1536.0], np.float32)
        sums[name], counts[name] = s, c
        wr.add_tensor(f"{name}.in_sum2", s)
        wr.add_tensor(f"{name}.counts", c)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    # what llama-quantize's load_imatrix hands to ggml_quantize_chunk: sums / count in float32
    return {n: (sums[n] / counts[n][0]).astype(np.float32) for n in sums}


def test_every_tensor_byte_identical_to_llama_quantize(tmp_path):
    quantize = _tool("llama-quantize")
    plan = _plan()
    f32 = tmp_path / "model-f32.gguf"
    _write_model(f32, plan)
    imatrix = _write_imatrix(tmp_path / "imatrix.gguf", plan)
    ttf = tmp_path / "tensor-types.txt"
    ttf.write_text("".join(f"^{n.replace('.', chr(92) + '.')}$={t}\n" for n, _, t in plan))
    out = tmp_path / "model-mixed.gguf"
    r = subprocess.run([str(quantize), "--imatrix", str(tmp_path / "imatrix.gguf"),
                        "--tensor-type-file", str(ttf), str(f32), str(out), "Q8_0", "2"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    got = {t.name: t for t in read_gguf(str(out)).tensors}
    seen_types = set()
    for name, w, asked in plan:
        want_type = fallback_type(asked, w.shape[1])
        t = got[name]
        assert t.tensor_type == want_type.ggml_type, (name, asked, t.tensor_type)
        ours = cg.quantize(w, want_type.name, imatrix=imatrix[name], tensor_name=name)
        theirs = np.asarray(t.data).view(np.uint8).reshape(ours.shape)
        assert np.array_equal(ours, theirs), f"{name}: {asked}->{want_type.name} bytes differ"
        seen_types.add(want_type.name)
    # every type was compared natively, and the fallbacks (IQ4_NL, Q4_0, Q5_0, Q5_1, Q8_0, F16)
    # were exercised by the 576- and 200-wide blocks
    assert set(TYPES) | {"F16"} <= seen_types, set(TYPES) - seen_types
    fell_back = {fallback_type(t, n_per_row).name for (_, w, t) in plan
                 for n_per_row in [w.shape[1]] if n_per_row in (576, 200)}
    assert {"IQ4_NL", "Q4_0", "Q5_0", "Q5_1", "Q8_0", "F16"} <= fell_back
    assert {T[t] for t in TYPES} <= {got[n].tensor_type for n, _, _ in plan}
