"""voodoo.lazy: candidates held as ggml bytes mix and differentiate like the dense eager tensor.

The dense reference is the eager path's arithmetic on a ``(K, *shape)`` float32 tensor built
from libggml's own dequantization (cython_ggml): ``mix = probs @ cand.reshape(K, -1)`` and
``dots = cand.reshape(K, -1) @ g.reshape(-1)``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cython_ggml as cg
from voodoo.lazy import QuantizedCandidates, lazy_mix
from voodoo.quants import qtype

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

MENU_256 = ["Q8_0", "Q5_K", "IQ4_XS", "IQ3_S", "IQ2_XXS"]
MENU_576 = ["Q8_0", "Q5_0", "IQ4_NL", "Q4_0"]


def _make(types, shape, seed=0, tile_elements=1 << 22):
    """(QuantizedCandidates, dense (K, *shape) float32 from cython_ggml)."""
    rng = np.random.default_rng(seed)
    n_rows, n = int(np.prod(shape[:-1])), shape[-1]
    w = (rng.standard_normal((n_rows, n)) * 0.05).astype(np.float32)
    im = (rng.gamma(1.0, 1.0, n) ** 2).astype(np.float32)
    blocks, dense = [], []
    for t in types:
        data = cg.quantize(w, t, imatrix=im)
        blocks.append(torch.from_numpy(data))
        dense.append(torch.from_numpy(cg.dequantize(data, t, n)).reshape(shape))
    return QuantizedCandidates(blocks, types, shape, tile_elements), torch.stack(dense)


CASES = [(MENU_256, (48, 512)), (MENU_576, (40, 576)), (MENU_256, (3, 16, 256))]


#: (device, compile): the torch.compile'd tile kernels are exercised on CUDA only (Inductor on
#: the CPU would need minutes of C++ compilation here).
MODES = [("cpu", False)] + ([("cuda", False), ("cuda", True)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device,compiled", MODES)
@pytest.mark.parametrize("types,shape", CASES)
def test_mix_and_dots_match_dense(types, shape, device, compiled):
    # a small tile (5 rows) forces several tiles and a ragged last one
    cands, cand = _make(types, shape, tile_elements=5 * shape[-1])
    cands.compile = compiled
    cands, cand = cands.to(device), cand.to(device)
    K = len(types)
    assert cands.k == K and cands.shape == tuple(shape) and cands.tile_rows == 5
    probs = torch.softmax(torch.randn(K, generator=torch.Generator().manual_seed(1)), 0).to(device)
    ref = (probs @ cand.reshape(K, -1)).reshape(shape)
    w = cands.mix(probs)
    assert w.shape == tuple(shape) and w.dtype == torch.float32
    torch.testing.assert_close(w, ref, rtol=1e-6, atol=1e-7)
    assert cands.mix(probs, torch.bfloat16).dtype == torch.bfloat16
    g = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(device)
    torch.testing.assert_close(cands.dots(g), cand.reshape(K, -1) @ g.reshape(-1),
                               rtol=1e-5, atol=1e-4)
    for k in range(K):
        onehot = torch.nn.functional.one_hot(torch.tensor(k), K).float().to(device)
        assert torch.equal(cands.mix(onehot), cand[k])            # exact: a pure candidate
        assert torch.equal(cands.dense(k), cand[k])               # bit-identical to libggml
        assert torch.equal(cands.dense(k).view(torch.int32), cand[k].view(torch.int32))


def test_autograd_gradcheck_float64():
    cands, _ = _make(["Q8_0", "IQ4_XS", "IQ2_XXS"], (6, 256), tile_elements=2 * 256)
    probs = torch.softmax(torch.randn(3, dtype=torch.float64), 0).requires_grad_()
    r = torch.randn(6, 256, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda p: (lazy_mix(cands, p, torch.float64) * r).sum(),
                                    (probs,))


@pytest.mark.parametrize("device", DEVICES)
def test_gate_gradient_matches_dense_autograd(device):
    types, shape = MENU_256, (24, 512)
    cands, cand = _make(types, shape, tile_elements=7 * 512)
    cands, cand = cands.to(device), cand.to(device)
    logits = torch.randn(len(types), device=device, requires_grad=True)
    x = torch.randn(9, 512, device=device)
    y = torch.randn(9, 24, device=device)

    def loss(w):
        return ((x @ w.T - y) ** 2).mean()

    loss(lazy_mix(cands, torch.softmax(logits / 0.7, 0))).backward()
    g_lazy = logits.grad.clone()
    logits.grad = None
    probs = torch.softmax(logits / 0.7, 0)
    loss((probs @ cand.reshape(len(types), -1)).reshape(shape)).backward()
    torch.testing.assert_close(g_lazy, logits.grad, rtol=1e-4, atol=1e-6)
    assert g_lazy.abs().max() > 0


def test_bytes_held_and_device_moves():
    cands, cand = _make(MENU_256, (8, 512))
    expected = sum(qtype(t).row_nbytes(512) * 8 for t in MENU_256)
    assert cands.nbytes == expected
    assert cands.dense_nbytes(torch.float32) == cand.numel() * 4
    # five types averaging ~4.6 bpw against 5 dense float32 copies
    assert cands.nbytes / cands.dense_nbytes(torch.float32) == pytest.approx(
        sum(qtype(t).bpw for t in MENU_256) / (32 * len(MENU_256)))
    moved = cands.to(torch.device("meta"))
    assert all(moved.blocks(k).device.type == "meta" for k in range(moved.k))


def test_errors():
    cands, _ = _make(["Q8_0", "Q4_0"], (4, 64))
    b = [cands.blocks(0), cands.blocks(1)]
    with pytest.raises(ValueError, match="one type per candidate"):
        QuantizedCandidates(b, ["Q8_0"], (4, 64))
    with pytest.raises(ValueError, match="needs 4 rows"):
        QuantizedCandidates([b[0], b[0]], ["Q8_0", "Q4_0"], (4, 64))
    with pytest.raises(ValueError, match="multiple of"):
        QuantizedCandidates(b, ["Q8_0", "Q4_K"], (4, 64))
    with pytest.raises(TypeError, match="uint8"):
        QuantizedCandidates([b[0].to(torch.int8)], ["Q8_0"], (4, 64))
    with pytest.raises(ValueError, match=r"expected \(2,\)"):
        cands.mix(torch.ones(3))
    with pytest.raises(ValueError, match="shape"):
        cands.dots(torch.ones(4, 32))


def test_narrow_is_a_shard_of_the_dense_tensor():
    cands, cand = _make(MENU_256, (2, 12, 512))          # (n_expert, n_rows, n_per_row)
    probs = torch.softmax(torch.randn(len(MENU_256)), 0)
    full = cands.mix(probs)
    rows = cands.narrow(1, 4, 6)                          # a row shard of every expert
    assert rows.shape == (2, 6, 512) and rows.nbytes * 2 == cands.nbytes
    torch.testing.assert_close(rows.mix(probs), full[:, 4:10], rtol=0, atol=0)
    cols = cands.narrow(-1, 256, 256)                     # a block-aligned column shard
    assert cols.shape == (2, 12, 256)
    for k in range(cands.k):
        assert torch.equal(cols.dense(k), cand[k][..., 256:])
    g = torch.randn(2, 12, 256)
    torch.testing.assert_close(cols.dots(g), cand[..., 256:].reshape(cands.k, -1) @ g.reshape(-1),
                               rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="block size 256"):
        cands.narrow(-1, 32, 256)
    with pytest.raises(ValueError, match="out of range"):
        cands.narrow(0, 1, 2)


def test_numpy_bytes_accepted():
    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    data = cg.quantize(w, "Q8_0")
    c = QuantizedCandidates([data], ["Q8_0"], (4, 64))
    assert torch.equal(c.dense(0), torch.from_numpy(cg.dequantize(data, "Q8_0", 64)))
