"""cython_ggml against independent references: gguf-py's numpy codecs (dequantize for every type,
quantize where gguf-py implements it), thread invariance, edge values and errors."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

import cython_ggml as cg

#: Every type of the default menus and of llama.cpp's shape fallbacks.
ALL_TYPES = ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "Q3_K", "IQ3_S", "IQ3_XXS", "Q2_K",
             "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S", "IQ4_NL", "Q5_1", "Q5_0", "Q4_1",
             "Q4_0", "MXFP4"]
#: Types gguf-py can quantize (its reference, non-imatrix path).
GGUF_QUANTIZABLE = ["Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"]


def _weights(n_rows, n_per_row, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_rows, n_per_row)).astype(np.float32)
    w *= rng.uniform(0.01, 0.2, size=(n_rows, 1)).astype(np.float32)  # per-row scales
    w[0, :7] *= 40.0  # outliers
    return w


def _imatrix(n_per_row, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.gamma(1.0, 1.0, n_per_row) ** 2).astype(np.float32)


@pytest.mark.parametrize("name", ALL_TYPES + ["F32", "F16", "BF16"])  # F32: no to_float in ggml
def test_dequantize_matches_gguf_py_bit_for_bit(name):
    w = _weights(24, 512)
    data = cg.quantize(w, name, imatrix=_imatrix(512))
    ours = cg.dequantize(data, name, 512)
    ref = gq.dequantize(data, T[name]).reshape(ours.shape)
    assert ours.dtype == np.float32 and ours.shape == (24, 512)
    assert np.array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("name", GGUF_QUANTIZABLE)
def test_quantize_bytes_match_gguf_py(name):
    w = _weights(16, 256 * 3)
    ours = cg.quantize(w, name)
    ref = gq.quantize(w, T[name])
    assert ref.dtype == np.uint8 and ours.shape == ref.shape
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("name", ["Q4_K", "IQ2_XXS", "IQ1_S", "Q8_0"])
def test_bytes_do_not_depend_on_thread_count(name):
    w = _weights(37, 512)  # 37 rows: uneven splits
    im = _imatrix(512)
    one = cg.quantize(w, name, imatrix=im, n_threads=1)
    for n in (2, 3, 8):
        assert np.array_equal(one, cg.quantize(w, name, imatrix=im, n_threads=n))
    deq1 = cg.dequantize(one, name, 512, n_threads=1)
    assert np.array_equal(deq1, cg.dequantize(one, name, 512, n_threads=4))


def test_imatrix_changes_the_bytes():
    w = _weights(8, 256)
    im = _imatrix(256)
    assert not np.array_equal(cg.quantize(w, "Q4_K"), cg.quantize(w, "Q4_K", imatrix=im))


@pytest.mark.parametrize("name", ALL_TYPES)
def test_zero_rows_blocks_negative_zero_and_subnormals(name):
    w = _weights(6, 512)
    w[1] = 0.0                       # an all-zero row
    w[2, :256] = 0.0                 # an all-zero 256-block
    w[3] = -0.0                      # negative zeros
    w[4, ::2] = np.float32(1e-40)    # subnormals
    w[5, :256] = np.float32(-1e-45)  # smallest subnormal
    data = cg.quantize(w, name, imatrix=_imatrix(512))
    out = cg.dequantize(data, name, 512)
    assert np.isfinite(out).all()
    assert np.all(out[1] == 0.0)
    assert np.all(out[2, :256] == 0.0)
    assert np.all(out[3] == 0.0)
    # and with an imatrix that is zero where the weights are zero
    im = _imatrix(512)
    im[:256] = 0.0
    out2 = cg.dequantize(cg.quantize(w, name, imatrix=im), name, 512)
    assert np.isfinite(out2).all() and np.all(out2[1] == 0.0)


def test_type_facts_agree_with_gguf_table():
    from gguf import GGML_QUANT_SIZES
    cg.check_abi()
    for name in ALL_TYPES + ["F16", "BF16", "F32"]:
        bs, ts = GGML_QUANT_SIZES[T[name]]
        assert cg.block_size(name) == bs and cg.type_size(name) == ts
        assert cg.row_size(name, 1024) == 1024 // bs * ts
    assert cg.type_id(T.IQ2_XXS) == cg.type_id("iq2_xxs") == int(T.IQ2_XXS)


def test_requires_imatrix_is_llama_quantize_rule():
    strict = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS"}
    for name in ALL_TYPES:
        assert cg.requires_imatrix(name, "blk.0.ffn_down.weight") == (name in strict), name
    # libggml's own rule is looser
    assert not cg.requires_imatrix_ggml("IQ2_S") and cg.requires_imatrix("IQ2_S")
    # token_embd / output are exempt (unless libggml itself would abort)
    assert not cg.requires_imatrix("IQ2_S", "token_embd.weight")
    assert not cg.requires_imatrix("IQ3_XXS", "output.weight")


# ----------------------------------------------------------------------------------- errors
def test_errors_name_the_problem():
    w = _weights(4, 512)
    with pytest.raises(ValueError, match=r"\(4, 300\).*Q4_K.*block size 256"):
        cg.quantize(np.zeros((4, 300), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="IQ2_S needs an importance matrix.*blk.0.attn_q"):
        cg.quantize(w, "IQ2_S", tensor_name="blk.0.attn_q.weight")
    with pytest.raises(ValueError, match="IQ3_XXS needs an importance matrix"):
        cg.quantize(w, "IQ3_XXS")
    with pytest.raises(TypeError, match="float32.*float64"):
        cg.quantize(w.astype(np.float64), "Q8_0")
    with pytest.raises(TypeError, match="C-contiguous"):
        cg.quantize(np.asfortranarray(w), "Q8_0")
    with pytest.raises(TypeError, match="numpy float32 array"):
        cg.quantize(w.tolist(), "Q8_0")
    bad = w.copy()
    bad[1, 3] = np.nan
    with pytest.raises(ValueError, match="NaN/Inf"):
        cg.quantize(bad, "Q4_K")
    bad[1, 3] = np.inf
    with pytest.raises(ValueError, match="NaN/Inf"):
        cg.quantize(bad, "Q8_0")
    im = _imatrix(512)
    im[5] = np.nan
    with pytest.raises(ValueError, match="imatrix.*NaN/Inf"):
        cg.quantize(w, "IQ2_XXS", imatrix=im)
    with pytest.raises(ValueError, match=r"imatrix has shape \(256,\).*needs \(512,\)"):
        cg.quantize(w, "Q4_K", imatrix=_imatrix(256))
    with pytest.raises(ValueError, match="unknown ggml type"):
        cg.quantize(w, "Q9_9")
    with pytest.raises(ValueError, match="whole number of Q4_K rows"):
        cg.dequantize(np.zeros(100, np.uint8), "Q4_K", 256)
    # token_embd may skip the imatrix even for IQ2_S
    assert cg.quantize(w, "IQ2_S", tensor_name="token_embd.weight").shape == (4, 82 * 2)
