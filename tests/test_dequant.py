"""voodoo.dequant against libggml's own to_float (cython_ggml.dequantize), bit for bit.

Every supported type, on the CPU and (when present) on CUDA: random weights quantized by
libggml (with an imatrix), several row lengths, all-zero blocks, -0.0 and subnormal fp16
scales written straight into raw bytes, raw random bytes (NaN-aware: a NaN must be a NaN in the
same place), and real SmolLM2 tensors, re-quantized to every type."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cython_ggml as cg
from voodoo.dequant import SUPPORTED_TYPES, dequantize
from voodoo.quants import qtype

QUANT_TYPES = [t for t in SUPPORTED_TYPES if t not in ("F32", "F16", "BF16")]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

#: Byte offsets of the fp16 scale fields in one block (``ggml-common.h``); IQ1_M's scale is
#: spread over the top nibbles of its four uint16 scales and is handled apart.
F16_FIELDS = {
    "Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0],
    "IQ4_NL": [0], "IQ4_XS": [0], "IQ1_M": [], "MXFP4": [],
}

#: fp16 bit patterns: +-0, the smallest and largest subnormals, the smallest normal, 1.0, a
#: large value, and a random spread of finite values is added per test.
SPECIAL_F16 = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x3C00,
                        0x7BFF, 0xFBFF, 0x1234], dtype=np.uint16)


def _row_lengths(name: str) -> list[int]:
    return [256, 512, 1536] if qtype(name).block_size == 256 else [32, 576, 1536]


def _weights(n_rows: int, n_per_row: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_rows, n_per_row)).astype(np.float32)
    w *= rng.uniform(0.005, 0.2, size=(n_rows, 1)).astype(np.float32)
    w[0, :5] *= 30.0
    return w


def _imatrix(n_per_row: int, seed: int = 1) -> np.ndarray:
    return (np.random.default_rng(seed).gamma(1.0, 1.0, n_per_row) ** 2).astype(np.float32)


def _bits_equal(ours: torch.Tensor, ref: np.ndarray, nan_aware: bool = False) -> None:
    """Asserts bit equality of float32 arrays; with ``nan_aware``, NaNs must coincide and every
    other value must have the same bits. Reports the first differing elements."""
    got = ours.cpu().numpy()
    assert got.dtype == np.float32 and got.shape == ref.shape, (got.shape, ref.shape)
    if nan_aware:
        nan = np.isnan(ref)
        assert np.array_equal(nan, np.isnan(got)), "NaNs in different places"
        got, ref = got[~nan], ref[~nan]
    bad = np.flatnonzero(got.view(np.uint32).ravel() != ref.view(np.uint32).ravel())
    assert bad.size == 0, (f"{bad.size} of {ref.size} values differ; first at {bad[:5]}: "
                           f"ours {got.ravel()[bad[:5]]} libggml {ref.ravel()[bad[:5]]}")


def _ref(data: np.ndarray, name: str, n_per_row: int) -> np.ndarray:
    """libggml's to_float; F32 has none (the bytes are the values)."""
    if name == "F32":
        return np.ascontiguousarray(data).view(np.float32).reshape(-1, n_per_row)
    return cg.dequantize(np.ascontiguousarray(data), name, n_per_row)


def _deq(data: np.ndarray, name: str, n_per_row: int, device: str) -> torch.Tensor:
    return dequantize(torch.from_numpy(np.ascontiguousarray(data)).to(device), name, n_per_row)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", QUANT_TYPES)
def test_quantized_weights_bit_identical(name, device):
    for i, n in enumerate(_row_lengths(name)):
        w = _weights(5, n, seed=i)
        w[1] = 0.0                              # an all-zero row
        w[2, :qtype(name).block_size] = 0.0     # an all-zero block
        w[3, ::3] = -0.0
        data = cg.quantize(w, name, imatrix=_imatrix(n))
        _bits_equal(_deq(data, name, n, device), cg.dequantize(data, name, n))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", QUANT_TYPES)
def test_crafted_scales_zero_negzero_subnormal(name, device):
    """Random payload bytes with every fp16 scale overwritten by +-0, subnormals and other
    finite values, plus one all-zero block: exact bits, no NaN-awareness needed."""
    t = qtype(name)
    rng = np.random.default_rng(7)
    n_blocks = 4 * len(SPECIAL_F16)
    b = rng.integers(0, 256, size=(n_blocks, t.type_size), dtype=np.uint8)
    finite = rng.integers(0, 0x7C00, size=n_blocks, dtype=np.uint16) | \
        (rng.integers(0, 2, size=n_blocks, dtype=np.uint16) << 15)
    scales = np.concatenate([np.resize(SPECIAL_F16, 2 * len(SPECIAL_F16)), finite[: n_blocks - 2 * len(SPECIAL_F16)]])
    if name == "IQ1_M":  # scale f16 = top nibbles of the four uint16 at bytes 48..55
        u16 = b[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            u16[:, k] = (u16[:, k] & 0x0FFF) | (((scales >> (4 * k)) & 0xF) << 12)
        b[:, 48:56] = u16.view(np.uint8)
    for off in F16_FIELDS[name]:
        b[:, off:off + 2] = rng.permutation(scales).astype("<u2").view(np.uint8).reshape(-1, 2)
    if name == "MXFP4":  # E8M0 exponent byte: subnormal scales (0, 1), 1.0 (128), the largest
        # whose values stay finite (252: 12 * 2^124), and a random spread in between
        e = np.resize(np.array([0, 1, 2, 127, 128, 252], np.uint8), n_blocks)
        b[:, 0] = np.where(np.arange(n_blocks) < 12, e, rng.integers(0, 253, n_blocks))
    b[-1] = 0                                   # an all-zero block
    ref = cg.dequantize(b.reshape(1, -1), name, n_blocks * t.block_size)
    assert np.isfinite(ref).all() and np.all(ref[0, -t.block_size:] == 0)
    _bits_equal(_deq(b.reshape(1, -1), name, n_blocks * t.block_size, device), ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_random_bytes_nan_aware(name, device):
    """Arbitrary bytes, NaN and inf scales included: NaNs coincide, all other bits equal."""
    t = qtype(name)
    n = 512 if t.block_size == 256 else 96
    rng = np.random.default_rng(3)
    b = rng.integers(0, 256, size=(9, t.row_nbytes(n)), dtype=np.uint8)
    _bits_equal(_deq(b, name, n, device), _ref(b, name, n), nan_aware=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["F16", "BF16", "F32"])
def test_float_types_with_subnormals_and_signed_zeros(name, device):
    n = 64
    vals = np.array([0.0, -0.0, 1e-40, -1e-45, 6e-8, -6e-8, 1.0, -2.5, 65504.0], np.float32)
    w = np.resize(vals, (3, n)).astype(np.float32)
    if name == "F32":
        data = w.view(np.uint8)
    elif name == "F16":
        data = w.astype(np.float16).view(np.uint8)
    else:
        data = (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    ref = _ref(data, name, n)
    assert ref[0, 1] == 0 and np.signbit(ref[0, 1])          # -0.0 survives
    if name == "F16":
        assert ref[0, 4] != 0                                  # an f16 subnormal (6e-8)
    else:
        assert 0 < abs(ref[0, 2]) < np.finfo(np.float32).tiny  # a float32 subnormal (1e-40)
    _bits_equal(_deq(data, name, n, device), ref)


@pytest.fixture(scope="module")
def smol_tensors(smol_gguf):
    """Real SmolLM2 tensors: token_embd (Q8_0) and ffn_down (Q4_1) bytes as stored, and float
    weights of rows 1536 wide (ffn_down's source) and 576 wide (attn_q's)."""
    from voodoo.ggufio import read_gguf
    r = read_gguf(str(smol_gguf))
    t = {x.name: x for x in r.tensors}
    emb, down, q = t["token_embd.weight"], t["blk.0.ffn_down.weight"], t["blk.0.attn_q.weight"]
    return {
        "emb": np.array(emb.data[:64]),                   # (64, 612) Q8_0 bytes, 576 wide
        "down": np.array(down.data[:48]),                 # (48, 960) Q4_1 bytes, 1536 wide
        "w1536": cg.dequantize(np.ascontiguousarray(down.data[:24]), "Q4_1", 1536),
        "w576": cg.dequantize(np.ascontiguousarray(q.data[:24]), "Q4_1", 576),
    }


@pytest.mark.parametrize("device", DEVICES)
def test_real_smollm2_bytes_as_stored(smol_tensors, device):
    _bits_equal(_deq(smol_tensors["emb"], "Q8_0", 576, device),
                cg.dequantize(smol_tensors["emb"], "Q8_0", 576))
    _bits_equal(_deq(smol_tensors["down"], "Q4_1", 1536, device),
                cg.dequantize(smol_tensors["down"], "Q4_1", 1536))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", QUANT_TYPES)
def test_real_smollm2_requantized(smol_tensors, name, device):
    w = smol_tensors["w1536"] if qtype(name).block_size == 256 else smol_tensors["w576"]
    n = w.shape[1]
    data = cg.quantize(w, name, imatrix=_imatrix(n, seed=5))
    ref = cg.dequantize(data, name, n)
    assert np.abs(ref - w).mean() < np.abs(w).mean()   # the bytes really encode the weights
    _bits_equal(_deq(data, name, n, device), ref)


def test_flat_input_and_shape():
    w = _weights(3, 512, seed=0)
    data = cg.quantize(w, "Q4_K")
    flat = torch.from_numpy(data.reshape(-1).copy())
    out = dequantize(flat, "q4_k", 512)
    assert out.shape == (3, 512) and out.dtype == torch.float32
    _bits_equal(out, cg.dequantize(data, "Q4_K", 512))


def test_errors_name_the_problem():
    with pytest.raises(TypeError, match="uint8"):
        dequantize(torch.zeros(34, dtype=torch.int8), "Q8_0", 32)
    with pytest.raises(ValueError, match="multiple of"):
        dequantize(torch.zeros(144, dtype=torch.uint8), "Q4_K", 128)
    with pytest.raises(ValueError, match="whole number of"):
        dequantize(torch.zeros(35, dtype=torch.uint8), "Q8_0", 32)
    with pytest.raises(ValueError, match="unknown or unsupported"):
        dequantize(torch.zeros(34, dtype=torch.uint8), "Q9_9", 32)
