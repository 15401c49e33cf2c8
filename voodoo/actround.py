"""The activation rounding of llama.cpp's CPU backend, and what it costs in KL.

ggml-cpu computes a matmul with a quantized weight by first rounding the activations to the
weight type's ``vec_dot_type`` (``type_traits_cpu`` in ``ggml/src/ggml-cpu/ggml-cpu.c``): Q8_K
(one float32 scale per 256 values) for every K- and IQ type, Q8_0 or Q8_1 (one float16 scale
per 32 values; the same rounded values) for the 32-block types, F16/BF16/F32 for float
weights. The rounding is part of what llama.cpp serves, and it differs by candidate type: at
SmolLM2's Q4_K_M size, ``ffn_down`` as Q6_K measured a *higher* KLD than as Q4_K, while the
32-block Q5_1 took 0.0024 off (``benchmarks/results/actround/``).

The cost of a candidate's activation rounding, relative to the reference's own (zero when the
two round alike), is estimated like the weights' Fisher cost: for a matmul ``y = W x`` with the
activation error ``d = x_c - x_r`` (``x_c`` rounded as the candidate's ``vec_dot_type``,
``x_r`` as the reference tensor's),

    KL ~ 1/2 sum_ij F_ij W_ij^2 E[d_j^2] / E[x_j^2]     (nats per token)

with ``F`` the Fisher diagonal of ``W`` (:func:`voodoo.sensitivity.fisher_diagonal`), errors of
different inputs taken as independent and ``g_i^2`` (the output gradient) as independent of
``d_j^2 / x_j^2``. On SmolLM2's ``ffn_down`` the prediction matched the measured change of
three groups of layers (0-4, 5-24, 25-28: predicted 0.00063, 0.00105, 0.00057 nats; measured in
llama.cpp 0.00095, 0.00103, 0.00045).

This is the CPU backend's rule; CUDA's MMQ kernels round activations per 32 values for every
type. The module holds no architecture names: it hooks the ``nn.Linear`` modules that read a
selectable weight.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

__all__ = ["VEC_DOT_TYPE", "vec_dot_type", "round_activations", "activation_costs"]

#: ggml type -> the type ggml-cpu rounds a matmul's activations to (``.vec_dot_type`` of
#: ``type_traits_cpu`` in ``ggml/src/ggml-cpu/ggml-cpu.c`` of the pinned llama.cpp;
#: ``tests/test_actround.py`` checks this table against that file).
VEC_DOT_TYPE: dict[str, str] = {
    "F32": "F32", "F16": "F16", "BF16": "BF16",
    "Q4_0": "Q8_0", "Q4_1": "Q8_1", "Q5_0": "Q8_0", "Q5_1": "Q8_1", "Q8_0": "Q8_0",
    "Q8_1": "Q8_1", "MXFP4": "Q8_0", "IQ4_NL": "Q8_0",
    "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K",
    "IQ2_XXS": "Q8_K", "IQ2_XS": "Q8_K", "IQ2_S": "Q8_K", "IQ3_XXS": "Q8_K", "IQ3_S": "Q8_K",
    "IQ1_S": "Q8_K", "IQ1_M": "Q8_K", "IQ4_XS": "Q8_K", "TQ1_0": "Q8_K", "TQ2_0": "Q8_K",
}

#: Rounding classes: Q8_0 and Q8_1 round to the same values (one float16 scale per 32).
_CLASS = {"Q8_1": "Q8_0"}


def vec_dot_type(type_name: str) -> str:
    """The rounding class of a matmul's activations for a weight of ``type_name`` on the CPU
    backend: ``"Q8_0"`` (Q8_0 and Q8_1 alike), ``"Q8_K"``, ``"F16"``, ``"BF16"`` or ``"F32"``.
    Raises KeyError for a type ggml-cpu has no matmul for."""
    t = VEC_DOT_TYPE[str(type_name).upper()]
    return _CLASS.get(t, t)


def round_activations(x: torch.Tensor, cls: str) -> torch.Tensor:
    """``x`` (..., n) float32 rounded as ggml-cpu rounds a matmul's activations of class
    ``cls`` (:func:`vec_dot_type`), returned dequantized, float32, same shape.

    Q8_0: per 32 values, ``d = amax / 127``, ``q = round(x * (1 / d))`` (half away from zero),
    dequantized with ``fp16(d)`` (``quantize_row_q8_0_ref``). Q8_K: per 256 values, ``iscale = -127
    / max`` with ``max`` the value of largest magnitude (sign kept), ``q = min(127,
    nearest_int(iscale * x))``, ``d = 1 / iscale`` in float32 (``quantize_row_q8_K_ref``,
    ``ggml-quants.c``). F16/BF16: a cast. Raises ValueError when ``n`` is not a multiple of the
    block or ``cls`` is unknown."""
    x = x.float()
    if cls == "F32":
        return x
    if cls == "F16":
        return x.half().float()
    if cls == "BF16":
        return x.bfloat16().float()
    bs = {"Q8_0": 32, "Q8_K": 256}.get(cls)
    if bs is None:
        raise ValueError(f"unknown activation rounding class {cls!r}")
    n = x.shape[-1]
    if n % bs:
        raise ValueError(f"{cls} rounds blocks of {bs} values; rows of {n} do not divide")
    b = x.reshape(*x.shape[:-1], n // bs, bs)
    if cls == "Q8_0":
        d = b.abs().amax(-1, keepdim=True) / 127
        v = b * torch.where(d > 0, torch.div(torch.ones_like(d), torch.where(d > 0, d, 1)), 0)
        q = torch.sign(v) * torch.floor(v.abs() + 0.5)
        return (q * d.half().float()).reshape(x.shape)  # rounded with d, stored as fp16(d)
    mx = torch.gather(b, -1, b.abs().argmax(-1, keepdim=True))
    # true float32 divisions, as the C code does (torch's scalar / tensor is reciprocal * scalar)
    safe = torch.where(mx != 0, mx, torch.ones_like(mx))
    iscale = torch.where(mx != 0, torch.div(torch.full_like(mx, -127.0), safe), 0)
    q = torch.round(iscale * b).clamp(max=127)
    d = torch.div(torch.ones_like(iscale), torch.where(mx != 0, iscale, 1))  # stored as f32
    return torch.where(mx != 0, q * d, torch.zeros_like(b)).reshape(x.shape)


@torch.no_grad()
def activation_costs(model: nn.Module, params: Mapping[str, str],
                     classes: Mapping[str, Sequence[str]],
                     reference: Mapping[str, str], fisher: Mapping[str, torch.Tensor],
                     blocks: torch.Tensor) -> dict[str, dict[str, float]]:
    """Predicted KL (nats per token) of each activation rounding class for each selectable
    weight, relative to the reference's class (see the module docstring).

    Args:
        model: the teacher, an HF causal LM with ordinary float weights.
        params: gguf_name -> HF parameter name of a weight read by one or more ``nn.Linear``
            (a tied embedding: the head); weights no ``nn.Linear`` reads get no entry.
        classes: gguf_name -> the classes to price (:func:`vec_dot_type` of its menu).
        reference: gguf_name -> the reference tensor's class (``"F32"`` for a float one).
        fisher: HF parameter name -> Fisher diagonal of the parameter's shape (per token).
        blocks: (N, T) int64 calibration tokens.

    Returns gguf_name -> {class: cost}; the reference's own class costs 0.0."""
    named = dict(model.named_parameters(remove_duplicate=False))
    want = {id(named[p]): n for n, p in params.items() if p in named}
    stats: dict[str, dict] = {}
    hooks = []
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and id(mod.weight) in want:
            name = want[id(mod.weight)]
            cls = [c for c in dict.fromkeys(classes.get(name, ())) if c != reference[name]]
            if not cls:
                continue

            def hook(m, inp, out, name=name, cls=cls):
                x = inp[0].detach().reshape(-1, inp[0].shape[-1]).float()
                xr = round_activations(x, reference[name])
                st = stats.setdefault(name, {"x2": 0.0, "n": 0, **{c: 0.0 for c in cls}})
                st["x2"] = st["x2"] + x.square().sum(0)
                st["n"] += x.shape[0]
                for c in cls:
                    st[c] = st[c] + (round_activations(x, c) - xr).square().sum(0)
            hooks.append(mod.register_forward_hook(hook))
    was = model.training
    model.eval()
    try:
        dev = next(model.parameters()).device
        for i in range(len(blocks)):
            model(input_ids=blocks[i:i + 1].to(dev), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    out: dict[str, dict[str, float]] = {}
    for name, st in stats.items():
        p = params[name]
        a = (fisher[p].float().to(named[p].device) * named[p].detach().float().square()).sum(0)
        ex2 = st["x2"] / st["n"]
        ok = ex2 > 0
        res = {reference[name]: 0.0}
        for c in classes[name]:
            if c in res:
                continue
            rho = torch.where(ok, (st[c] / st["n"]) / torch.where(ok, ex2, 1), 0)
            res[c] = 0.5 * float((a * rho).sum(dtype=torch.float64))
        out[name] = res
    return out
