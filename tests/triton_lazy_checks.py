"""Checks of voodoo.triton_lazy against voodoo.dequant / the eager QuantizedCandidates path.

Run by tests/test_triton_lazy.py in a subprocess under ``TRITON_INTERPRET=1`` (Triton's CPU
interpreter; the variable must be set before triton kernels are defined), or by hand on a GPU:

    TRITON_INTERPRET=1 python tests/triton_lazy_checks.py          # CPU, interpreter
    python tests/triton_lazy_checks.py --device cuda               # the compiled kernels

Prints one line per check and ``ALL OK`` at the end; exit status 1 on the first failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

import cython_ggml as cg
from voodoo import triton_lazy as tlz
from voodoo.dequant import dequantize
from voodoo.lazy import QuantizedCandidates, _triton_kernels
from voodoo.quants import qtype

FLOATS = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
#: byte offsets of each block's fp16 scale fields (ggml-common.h)
F16_FIELDS = {
    "Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "IQ4_NL": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ4_XS": [0], "IQ3_S": [0],
}
SPECIAL_F16 = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x3C00,
                        0x7BFF, 0xFBFF, 0x1234], dtype=np.uint16)
MENU6 = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "IQ3_S")


def _weights(rows, n, rng):
    w = (rng.standard_normal((rows, n)) * rng.uniform(0.005, 0.2, (rows, 1))).astype(np.float32)
    w[0, :5] *= 30.0
    if rows > 2:
        w[1] = 0.0
        w[2, ::3] = -0.0
    return w


def quantized_bytes(name, rows, n, rng, imatrix=False) -> torch.Tensor:
    """libggml-quantized random weights (F16/BF16/F32: the weights cast), (rows, row_bytes)."""
    w = _weights(rows, n, rng)
    if name in FLOATS:
        return torch.from_numpy(w).to(FLOATS[name]).view(torch.uint8).reshape(rows, -1)
    im = (rng.gamma(1.0, 1.0, n) ** 2).astype(np.float32) if imatrix else None
    q = cg.quantize(w, name, imatrix=im) if imatrix else cg.quantize(w, name)
    return torch.from_numpy(np.ascontiguousarray(q)).reshape(rows, -1).clone()


def _finite_f16(u16: np.ndarray) -> np.ndarray:
    """fp16 bit patterns with the inf/NaN ones made finite (exponent bit 14 cleared)."""
    bad = (u16 & 0x7C00) == 0x7C00
    return np.where(bad, u16 & ~np.uint16(0x4000), u16).astype(np.uint16)


def random_bytes(name, rows, n, rng, scales=None) -> torch.Tensor:
    """Raw random bytes with finite scales (or the given fp16 scale bit patterns)."""
    t = qtype(name)
    rb = t.row_nbytes(n)
    b = rng.integers(0, 256, (rows, rb), dtype=np.uint8)
    if name == "F16":
        b = _finite_f16(b.view(np.uint16)).view(np.uint8)
    elif name == "BF16":
        u = b.view(np.uint16)
        b = np.where((u & 0x7F80) == 0x7F80, u & ~np.uint16(0x4000), u).astype(np.uint16) \
            .view(np.uint8)
    elif name == "F32":
        u = b.view(np.uint32)
        b = np.where((u & 0x7F800000) == 0x7F800000, u & ~np.uint32(0x40000000), u) \
            .astype(np.uint32).view(np.uint8)
    else:
        blk = b.reshape(-1, t.type_size)
        for off in F16_FIELDS[name]:
            if scales is None:
                v = _finite_f16(blk[:, off:off + 2].copy().view(np.uint16)[:, 0])
            else:
                v = rng.choice(scales, blk.shape[0]).astype(np.uint16)
            blk[:, off:off + 2] = v.astype("<u2").view(np.uint8).reshape(-1, 2)
        b = blk.reshape(rows, rb)
    return torch.from_numpy(np.ascontiguousarray(b))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    if a.dtype in (torch.bfloat16, torch.float16):
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    return torch.equal(a, b)


class Failed(Exception):
    pass


def _expect(ok, what):
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        raise Failed(what)


def check_decode(names, device, rng):
    """Every type: the kernels' K = 1 decode equals voodoo.dequant.dequantize bit for bit."""
    for name in names:
        t = qtype(name)
        ns = (256, 512) if t.block_size == 256 else (256, 576)
        if name in FLOATS:
            ns = (256, 576)
        cases = []
        for n in ns:
            cases.append((f"quantized n={n}", quantized_bytes(name, 37, n, rng)))
            if name not in FLOATS:
                cases.append((f"quantized+imatrix n={n}",
                              quantized_bytes(name, 5, n, rng, imatrix=True)))
        cases.append(("random bytes", random_bytes(name, 11, ns[-1], rng)))
        if name not in FLOATS:
            cases.append(("crafted fp16 scales", random_bytes(name, 9, ns[-1], rng,
                                                              scales=SPECIAL_F16)))
        for what, b in cases:
            n = b.shape[1] * t.block_size // t.type_size
            ref = dequantize(b, name, n)
            got = tlz.dequantize(b.to(device), name, n)
            _expect(bits_equal(got, ref), f"decode {name:7s} {what} ({b.shape[0]}x{n})")


def _mix_case(types, shape, device, rng, what, out_dtypes=(torch.float32, torch.bfloat16),
              onehot=True):
    rows = int(np.prod(shape[:-1]))
    n = shape[-1]
    blocks = [quantized_bytes(t, rows, n, rng, imatrix=(i % 2 == 1)) for i, t in enumerate(types)]
    eager = QuantizedCandidates(blocks, types, shape, compile=False)
    dev_blocks = [b.to(device) for b in blocks]
    fast = QuantizedCandidates(dev_blocks, types, shape, compile=True)
    probs = torch.softmax(torch.from_numpy(rng.standard_normal(len(types))).float() * 2, 0)
    _expect(tlz.supports(types, n) and _triton_kernels(fast, torch.float32) is tlz,
            f"QuantizedCandidates{tuple(shape)} {list(types)} takes the Triton path")
    for dt in out_dtypes:
        ref = eager.mix(probs, dt)
        got = fast.mix(probs.to(device), dt)
        _expect(got.shape == tuple(shape) and bits_equal(got, ref),
                f"mix  {what} {list(types)} {tuple(shape)} -> {dt}")
        # the kernel directly as well (lazy.py's branch could silently fall back)
        direct = tlz.mix(probs.to(device), dev_blocks, types, n, dt).reshape(shape)
        _expect(bits_equal(direct, ref), f"mix  {what} direct kernel -> {dt}")
    for k in range(len(types) if onehot else 0):   # one-hot: the eager arithmetic, p = e_k
        p = torch.zeros(len(types))
        p[k] = 1.0
        _expect(bits_equal(fast.mix(p.to(device)), eager.mix(p)),
                f"mix  {what} one-hot e_{k} ({types[k]})")
        # dense(k) (a Q8_0 teacher's weights) runs the mix kernel with p = 1 on one candidate
        for dt in out_dtypes:
            _expect(bits_equal(fast.dense(k, dt), eager.dense(k, dt)),
                    f"dense {what} candidate {k} ({types[k]}) -> {dt}")
    g = torch.from_numpy(rng.standard_normal(shape)).float()
    dense = torch.stack([eager.dense(k).double() for k in range(len(types))])
    for gd in (torch.float32, torch.bfloat16):
        ref = eager.dots(g.to(gd))
        got = fast.dots(g.to(gd).to(device)).cpu()
        direct = tlz.dots(g.to(gd).reshape(rows, n).to(device), dev_blocks, types, n).cpu()
        # float32 rounding: differences measured against sum_i |w_i g_i| (the scale of a sum's
        # rounding error), and against max_k |dot_k| as the benchmark reports them
        prods = dense * g.to(gd).double()
        scale = prods.abs().flatten(1).sum(1).float()
        exact = prods.flatten(1).sum(1).float()
        rel = max(float(((x - ref).abs() / scale).max()) for x in (got, direct))
        rel_max = max(float((x - ref).abs().max() / ref.abs().max()) for x in (got, direct))
        err64 = float(((got - exact).abs() / scale).max())
        err64_eager = float(((ref - exact).abs() / scale).max())
        _expect(got.dtype == torch.float32 and rel <= 1e-5 and rel_max <= 1e-5,
                f"dots {what} g={gd}: |diff| / sum|w g| {rel:.1e}, / max|dot| {rel_max:.1e}"
                f" (vs float64: triton {err64:.1e}, eager {err64_eager:.1e})")


def check_mix_dots(device, rng, full=True):
    _mix_case(MENU6, (37, 512), device, rng, "menu6")
    _mix_case(MENU6, (3, 5, 256), device, rng, "menu6 3-D")
    _mix_case(("Q8_0", "Q4_0", "IQ4_NL", "Q5_0", "Q5_1", "Q4_1", "F16", "BF16"), (13, 576),
              device, rng, "32-block K=8")
    _mix_case(("Q8_0", "Q4_0", "F32"), (2, 3, 96), device, rng, "32-block 3-D n=96")
    if full:
        _mix_case(("Q3_K", "Q2_K", "Q6_K", "F32", "Q8_0"), (9, 256), device, rng, "K-quants")
        _mix_case(MENU6[:3], (3, 4096), device, rng, "n=4096", out_dtypes=(torch.bfloat16,))


def check_launch_configs(device, rng):
    """Other tilings (rows a tile, warps, column tiles a program) give the same bits."""
    for env in ({"VOODOO_TRITON_CT": "2"}, {"VOODOO_TRITON_ROWS": "4", "VOODOO_TRITON_CT": "4"},
                {"VOODOO_TRITON_ROWS": "16", "VOODOO_TRITON_WARPS": "2"}):
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            tag = " ".join(f"{k[14:]}={v}" for k, v in env.items())
            _mix_case(MENU6[:3] + ("Q4_0",), (37, 1024), device, rng, tag,
                      out_dtypes=(torch.bfloat16,), onehot=False)
            _mix_case(("Q8_0", "IQ4_NL", "BF16"), (5, 512), device, rng, tag,
                      out_dtypes=(torch.float32,), onehot=False)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def check_fallback():
    _expect(not tlz.supports(("Q8_0", "IQ2_XXS")), "supports() refuses IQ2_XXS")
    _expect(not tlz.supports(("Q8_0",) * 9), "supports() refuses K > 8")
    _expect(not tlz.supports(("Q4_K",), 576), "supports() refuses Q4_K at n=576")
    _expect(tlz.supports(MENU6, 4096), "supports() takes the benchmark menu")
    q = QuantizedCandidates([torch.zeros(34, dtype=torch.uint8)], ["Q8_0"], (1, 32),
                            compile=True)
    old = os.environ.get("VOODOO_LAZY_KERNEL")
    try:
        os.environ["VOODOO_LAZY_KERNEL"] = "inductor"
        _expect(_triton_kernels(q, torch.float32) is None, "VOODOO_LAZY_KERNEL=inductor")
        os.environ["VOODOO_LAZY_KERNEL"] = "cuda"
        try:
            _triton_kernels(q, torch.float32)
            _expect(False, "VOODOO_LAZY_KERNEL=cuda raises ValueError")
        except ValueError:
            _expect(True, "VOODOO_LAZY_KERNEL=cuda raises ValueError")
    finally:
        if old is None:
            os.environ.pop("VOODOO_LAZY_KERNEL", None)
        else:
            os.environ["VOODOO_LAZY_KERNEL"] = old
    _expect(_triton_kernels(q, torch.float64) is None, "float64 accumulation falls back")

    # no rows (an empty shard or row selection): empty results, as on the eager path
    z = QuantizedCandidates([torch.zeros(0, dtype=torch.uint8)] * 2, ["Q8_0", "Q4_0"], (0, 64),
                            compile=True)
    if z.device.type == "cpu" or _triton_kernels(z, torch.float32) is tlz:
        w = tlz.mix(torch.full((2,), 0.5), [z.blocks(0), z.blocks(1)], z.types, 64)
        d = tlz.dots(torch.zeros(0, 64), [z.blocks(0), z.blocks(1)], z.types, 64)
        _expect(w.shape == (0, 64) and d.tolist() == [0.0, 0.0], "zero rows: mix (0, 64), dots 0")
    # probabilities on another device than the bytes: a clear error (on a GPU machine)
    if torch.cuda.is_available():
        try:
            tlz.mix(torch.ones(1), [torch.zeros(34, dtype=torch.uint8, device="cuda")], ["Q8_0"],
                    32)
            _expect(False, "probs on the CPU, bytes on cuda: ValueError")
        except ValueError:
            _expect(True, "probs on the CPU, bytes on cuda: ValueError")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--types", default=",".join(tlz.TYPE_CODES))
    ap.add_argument("--quick", action="store_true", help="fewer mix shapes")
    a = ap.parse_args(argv)
    if not tlz.available():
        print(f"triton not importable: {tlz._IMPORT_ERROR}")
        return 2
    rng = np.random.default_rng(0)
    t0 = time.time()
    try:
        check_fallback()
        check_decode(a.types.split(","), a.device, rng)
        check_mix_dots(a.device, rng, full=not a.quick)
        check_launch_configs(a.device, rng)
    except Failed as e:
        print(f"FAILED: {e}")
        return 1
    print(f"ALL OK ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
