"""voodoo.actround: ggml-cpu's activation rounding, bit for bit, its table from llama.cpp's own
source, and a predicted cost that tracks the KL measured with that rounding in place."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest
import torch

from voodoo.actround import VEC_DOT_TYPE, activation_costs, round_activations, vec_dot_type
from voodoo.llamacpp import LlamaCppNotBuilt, source_dir

from test_pipeline import tiny_fixed  # noqa: F401  (fixture)


def test_vec_dot_table_is_ggml_cpus():
    """Every entry equals ``.vec_dot_type`` of ``type_traits_cpu`` in the pinned ggml-cpu.c."""
    try:
        src = source_dir() / "ggml" / "src" / "ggml-cpu" / "ggml-cpu.c"
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    text = src.read_text()
    start = text.index("type_traits_cpu[GGML_TYPE_COUNT]")
    table = text[text.index("{", start) + 1:]
    found = dict(re.findall(r"\[GGML_TYPE_(\w+)\]\s*=\s*\{[^}]*?\.vec_dot_type\s*=\s*"
                            r"GGML_TYPE_(\w+)", table))
    assert len(found) >= 25, found
    for t, v in VEC_DOT_TYPE.items():
        assert found.get(t) == v, (t, found.get(t), v)
    assert vec_dot_type("q5_1") == vec_dot_type("Q4_0") == "Q8_0"   # Q8_1 rounds like Q8_0
    assert vec_dot_type("IQ4_XS") == "Q8_K" and vec_dot_type("IQ4_NL") == "Q8_0"


def _libggml():
    try:
        import cython_ggml
    except ImportError as e:
        pytest.skip(str(e))
    return ctypes.CDLL(str(cython_ggml.library_path()))


@pytest.mark.parametrize("cls", ["Q8_0", "Q8_K"])
def test_rounding_is_libggmls(cls):
    """round_activations equals libggml's quantize_row_q8_0_ref / quantize_row_q8_K_ref
    followed by their dequantization, bit for bit, on activations with outliers and zeros."""
    lib = _libggml()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 1024)).astype(np.float32)
    x[:, ::97] *= 40.0                      # outliers, as a SwiGLU product has
    x[1, :256] = 0.0                        # an all-zero block
    x[2, 5] = -1e3                          # a negative maximum (Q8_K keeps its sign)
    n = x.size
    if cls == "Q8_0":
        blk = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
        y = np.zeros(n // 32, blk)
        lib.quantize_row_q8_0_ref(x.ctypes.data_as(ctypes.c_void_p),
                                  y.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n))
        want = (y["d"].astype(np.float32)[:, None] * y["qs"]).reshape(x.shape)
    else:
        blk = np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)])
        y = np.zeros(n // 256, blk)
        lib.quantize_row_q8_K_ref(x.ctypes.data_as(ctypes.c_void_p),
                                  y.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n))
        want = (y["d"][:, None] * y["qs"]).reshape(x.shape)
    got = round_activations(torch.from_numpy(x), cls).numpy()
    assert np.array_equal(got, want.astype(np.float32)), np.abs(got - want).max()
    with pytest.raises(ValueError, match="do not divide"):
        round_activations(torch.zeros(3, 96), "Q8_K")


def test_predicted_cost_tracks_the_measured_kl(tiny_fixed):
    """On the tiny llama: every Linear's input rounded per 256 (Q8_K) or per 32 (Q8_0) in
    torch; the KL of those logits to the unrounded model's, against the sum of the predicted
    costs (F32 reference). Within a factor of 2 of each other, and Q8_K costs more than Q8_0;
    a class equal to the reference's costs 0."""
    from transformers import AutoModelForCausalLM

    from voodoo.sensitivity import fisher_diagonal
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_fixed, dtype=torch.float32).eval()
    lin = {n: m for n, m in model.named_modules()
           if isinstance(m, torch.nn.Linear) and "lm_head" not in n}
    params = {f"{n}.weight": f"{n}.weight" for n in lin}
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, model.config.vocab_size, (4, 64), generator=g)
    from types import SimpleNamespace
    specs = [SimpleNamespace(gguf_name=p, param=p) for p in params]
    fisher = fisher_diagonal(model, specs, blocks, progress=False)
    costs = activation_costs(model, params, {p: ["Q8_0", "Q8_K", "F32"] for p in params},
                             {p: "F32" for p in params}, fisher, blocks)
    assert set(costs) == set(params) and all(c["F32"] == 0.0 for c in costs.values())

    @torch.no_grad()
    def measured(cls):
        hooks = [m.register_forward_pre_hook(
            lambda mod, inp: (round_activations(inp[0], cls),)) for m in lin.values()]
        try:
            kl = 0.0
            for b in blocks:
                q = torch.log_softmax(model(b[None]).logits.float(), -1)
                for h in hooks:
                    h.remove()
                p = torch.log_softmax(model(b[None]).logits.float(), -1)
                hooks = [m.register_forward_pre_hook(
                    lambda mod, inp: (round_activations(inp[0], cls),)) for m in lin.values()]
                kl += float((p.exp() * (p - q)).sum(-1).mean())
            return kl / len(blocks)
        finally:
            for h in hooks:
                h.remove()
    pred = {c: sum(v[c] for v in costs.values()) for c in ("Q8_0", "Q8_K")}
    meas = {c: measured(c) for c in ("Q8_0", "Q8_K")}
    assert pred["Q8_K"] > pred["Q8_0"] > 0 and meas["Q8_K"] > meas["Q8_0"] > 0, (pred, meas)
    for c in pred:
        assert 0.5 < pred[c] / meas[c] < 2.0, (c, pred, meas)
