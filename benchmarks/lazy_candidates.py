"""Lazy (quantized) candidates: exactness on any device, memory held, and mix/dots speed.

Three commands:

* ``reference OUT.npz`` (a machine with cython_ggml): for every type :mod:`voodoo.dequant`
  supports, ggml bytes (libggml-quantized random and SmolLM2-shaped weights with an imatrix,
  crafted -0.0 / subnormal fp16 scales, all-zero blocks, raw random bytes) and libggml's own
  ``to_float`` of them. Small enough (~10 MB) to carry to a GPU machine.
* ``check IN.npz [--device cuda]``: dequantizes every entry with :func:`voodoo.dequant.dequantize`
  on the device and prints, per type, whether the bits equal libggml's (non-NaN values bit for
  bit, NaNs in the same places; payloads of NaNs reported apart). Exit status 1 on a mismatch.
* ``bench [--device cuda] [--rows 4096 --cols 4096 --k 6]``: bytes held by
  :class:`voodoo.lazy.QuantizedCandidates` against K dense float32 / bf16 copies (the memory
  ratio), and the time of ``mix`` / ``dots`` against the eager path's dense arithmetic
  (``voodoo.kernels``), plus each type's dequantization throughput. Prints one JSON line.

* ``check-triton IN.npz [--device cuda]``: the same entries decoded by the hand-written Triton
  kernels (:mod:`voodoo.triton_lazy`, the types it supports) against libggml's bits, then a
  K = 6 mix of real requantized SmolLM2 bytes on the device (float32 and bf16 output) against
  the CPU eager loop bit for bit, and dots against it within float32 rounding.
* ``bench --kernels triton,inductor [--out X.json]``: only the kernel comparison: ``mix`` (bf16
  out) and ``dots`` (bf16 g) of :class:`~voodoo.lazy.QuantizedCandidates` with each kernel
  (``VOODOO_LAZY_KERNEL``), at 4096x4096 and a 3-D MoE-like shape, K = 6, against the dense bf16
  path (``voodoo.kernels``) measured in the same run; ratios printed, one JSON written.
  ``--triton_configs 8x4,16x8`` also times the Triton kernels at other rows-per-program x
  num_warps (``VOODOO_TRITON_ROWS`` / ``VOODOO_TRITON_WARPS``).

    python benchmarks/lazy_candidates.py reference /tmp/dq.npz
    python benchmarks/lazy_candidates.py check /tmp/dq.npz --device cuda
    python benchmarks/lazy_candidates.py check-triton /tmp/dq.npz --device cuda
    python benchmarks/lazy_candidates.py bench --device cuda
    python benchmarks/lazy_candidates.py bench --kernels triton,inductor --out X.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

MENU6 = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "IQ3_S")


# ------------------------------------------------------------------------ reference
def make_reference(path: str) -> None:
    import cython_ggml as cg
    from voodoo.dequant import SUPPORTED_TYPES
    from voodoo.quants import qtype
    rng = np.random.default_rng(0)
    out: dict[str, np.ndarray] = {}

    def add(key, name, data, n):
        data = np.ascontiguousarray(data)
        ref = (data.view(np.float32).reshape(-1, n) if name == "F32"
               else cg.dequantize(data, name, n))
        out[f"{name}|{key}|bytes"] = data
        out[f"{name}|{key}|ref"] = ref
        out[f"{name}|{key}|n"] = np.array(n)

    for name in SUPPORTED_TYPES:
        t = qtype(name)
        if name not in ("F32", "F16", "BF16"):
            for n in (1536, 576) if t.block_size == 32 else (1536, 256):
                w = (rng.standard_normal((16, n)) * rng.uniform(0.005, 0.2, (16, 1))).astype(np.float32)
                w[1] = 0.0
                w[2, ::3] = -0.0
                im = (rng.gamma(1.0, 1.0, n) ** 2).astype(np.float32)
                add(f"quantized{n}", name, cg.quantize(w, name, imatrix=im), n)
        # raw random bytes: NaN/inf scales included
        n = 512 if t.block_size == 256 else 96
        add("random", name, rng.integers(0, 256, (32, t.row_nbytes(n)), dtype=np.uint8), n)
        # crafted fp16 scales: random payloads, every fp16 scale field +-0, subnormal or finite
        if name not in ("F32", "F16", "BF16"):
            add("crafted", name, _crafted(name, rng), 32 * t.block_size)
    # real SmolLM2 tensors: as stored (Q8_0 token_embd, Q4_1 ffn_down) and re-quantized
    from gguf import GGUFReader
    from voodoo.models import default_model
    tensors = {x.name: x for x in GGUFReader(str(default_model())).tensors}
    add("smol_stored", "Q8_0", tensors["token_embd.weight"].data[:64], 576)
    down = np.ascontiguousarray(tensors["blk.0.ffn_down.weight"].data[:32])
    add("smol_stored", "Q4_1", down, 1536)
    w = cg.dequantize(down, "Q4_1", 1536)
    im = (rng.gamma(1.0, 1.0, 1536) ** 2).astype(np.float32)
    for name in SUPPORTED_TYPES:
        if name not in ("F32", "F16", "BF16"):
            add("smol_requantized", name, cg.quantize(w, name, imatrix=im), 1536)
    np.savez(path, **out)
    print(f"wrote {len(out) // 3} entries, {sum(v.nbytes for v in out.values()) / 2**20:.1f} MiB "
          f"to {path}")


#: Byte offsets of the fp16 scale fields of one block (``ggml-common.h``); IQ1_M's is spread
#: over the top nibbles of the uint16s at bytes 48..55.
F16_FIELDS = {
    "Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0],
    "IQ4_NL": [0], "IQ4_XS": [0], "IQ1_M": [],
}


def _crafted(name, rng):
    from voodoo.quants import qtype
    t = qtype(name)
    special = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x3C00, 0x7BFF,
                        0xFBFF], np.uint16)
    b = rng.integers(0, 256, (32, t.type_size), dtype=np.uint8)
    scales = np.concatenate([special, special, rng.integers(0, 0x7C00, 12, dtype=np.uint16)])
    if name == "IQ1_M":
        u16 = b[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            u16[:, k] = (u16[:, k] & 0x0FFF) | (((scales >> (4 * k)) & 0xF) << 12)
        b[:, 48:56] = u16.view(np.uint8)
    for off in F16_FIELDS[name]:
        b[:, off:off + 2] = rng.permutation(scales).astype("<u2").view(np.uint8).reshape(-1, 2)
    b[-1] = 0
    return b.reshape(1, -1)


def check(path: str, device: str, compiled: bool = False) -> int:
    from voodoo.dequant import (compile_recompile_limit, dequantize, dequantize_blocks,
                                exact_compile_options, warm_tables)
    from voodoo.quants import qtype
    if compiled:  # the fused Triton kernels that torch.compile makes of the same code
        comp = torch.compile(dequantize_blocks, dynamic=False, options=exact_compile_options())

        def dequantize(b, name, n):  # noqa: F811
            warm_tables([name], b.device)
            t = qtype(name)
            with torch._dynamo.config.patch(**compile_recompile_limit()):
                return comp(b.reshape(-1, t.type_size), t.name).reshape(-1, n)
        device_tag = device + "+compile"
        print("inductor options:", exact_compile_options())
    else:
        device_tag = device
    z = np.load(path)
    keys = sorted({k.rsplit("|", 1)[0] for k in z.files})
    per_type: dict[str, list[str]] = {}
    strict_nan: dict[str, bool] = {}
    for key in keys:
        name, case = key.split("|")
        data, ref, n = z[f"{key}|bytes"], z[f"{key}|ref"], int(z[f"{key}|n"])
        got = dequantize(torch.from_numpy(data).to(device), name, n).cpu().numpy()
        nan = np.isnan(ref)
        ok = (got.shape == ref.shape and np.array_equal(nan, np.isnan(got))
              and np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32)))
        strict_nan[name] = strict_nan.get(name, True) and np.array_equal(
            got.view(np.uint32), ref.view(np.uint32))
        per_type.setdefault(name, []).append(f"{case}:{'ok' if ok else 'DIFF'}")
    bad = 0
    for name, cases in per_type.items():
        exact = all(c.endswith(":ok") for c in cases)
        bad += not exact
        print(f"{device_tag} {name:8s} bit-identical={'yes' if exact else 'NO '} "
              f"nan-payloads-equal={'yes' if strict_nan[name] else 'no'}  {' '.join(cases)}")
    print(f"{device_tag}: {len(per_type) - bad}/{len(per_type)} types bit-identical to libggml")
    return 1 if bad else 0


def check_triton(path: str, device: str) -> int:
    """The Triton kernels' decode (a K = 1 mix with p = 1) of every reference entry of a type
    they support, against libggml's bits; then a K = 6 mix / dots on ``device`` against the CPU
    eager loop. Exit status 1 on any mismatch."""
    import os
    from voodoo import triton_lazy as tlz
    from voodoo.lazy import QuantizedCandidates, _triton_kernels
    if not tlz.available():
        print(f"triton does not import: {tlz._IMPORT_ERROR}")
        return 1
    z = np.load(path)
    keys = sorted({k.rsplit("|", 1)[0] for k in z.files})
    per_type: dict[str, list[str]] = {}
    for key in keys:
        name, case = key.split("|")
        if name not in tlz.TYPE_CODES:
            continue
        data, ref, n = z[f"{key}|bytes"], z[f"{key}|ref"], int(z[f"{key}|n"])
        got = tlz.dequantize(torch.from_numpy(data).to(device), name, n).cpu().numpy()
        nan = np.isnan(ref)
        ok = (got.shape == ref.shape and np.array_equal(nan, np.isnan(got))
              and np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32)))
        if not ok and got.shape == ref.shape:
            bad = np.flatnonzero((got.view(np.uint32) != ref.view(np.uint32)) & ~nan)
            case += f"({bad.size} differ, first {bad[:3].tolist()}: " \
                    f"{got.ravel()[bad[:3]].tolist()} vs {ref.ravel()[bad[:3]].tolist()})"
        per_type.setdefault(name, []).append(f"{case}:{'ok' if ok else 'DIFF'}")
    bad = 0
    for name, cases in per_type.items():
        exact = all(c.endswith(":ok") for c in cases)
        bad += not exact
        print(f"{device}+triton {name:8s} bit-identical={'yes' if exact else 'NO '}  "
              f"{' '.join(cases)}")
    print(f"{device}+triton: {len(per_type) - bad}/{len(per_type)} types bit-identical to libggml")
    # a K = 6 mix of real bytes on the device against the CPU eager loop
    menu = [t for t in MENU6 if f"{t}|smol_requantized|bytes" in z.files]
    blocks = [torch.from_numpy(z[f"{t}|smol_requantized|bytes"]).reshape(32, -1) for t in menu]
    shape = (32, 1536)
    eager = QuantizedCandidates(blocks, menu, shape, compile=False)
    os.environ["VOODOO_LAZY_KERNEL"] = "triton"
    fast = QuantizedCandidates([b.to(device) for b in blocks], menu, shape, compile=True)
    on_triton = _triton_kernels(fast, torch.float32) is not None
    print(f"{device}: QuantizedCandidates takes the Triton path: {on_triton}")
    bad += not on_triton
    gen = torch.Generator().manual_seed(0)
    for trial in range(3):
        p = torch.softmax(torch.randn(len(menu), generator=gen) * 2, 0)
        if trial == 2:
            p = torch.nn.functional.one_hot(torch.tensor(1), len(menu)).float()
        for dt in (torch.float32, torch.bfloat16):
            ref = eager.mix(p, dt)
            got = fast.mix(p.to(device), dt).cpu()
            iv = torch.int32 if dt == torch.float32 else torch.int16
            ok = torch.equal(ref.view(iv), got.view(iv))
            bad += not ok
            print(f"{device}+triton mix K={len(menu)} p#{trial} -> {dt}: "
                  f"{'bit-identical to the CPU eager loop' if ok else 'DIFF'}")
    g = torch.randn(shape, generator=gen)
    for gd in (torch.float32, torch.bfloat16):
        ref = eager.dots(g.to(gd))
        got = fast.dots(g.to(gd).to(device)).cpu()
        dense = torch.stack([eager.dense(k).double() for k in range(len(menu))])
        scale = (dense * g.to(gd).double()).abs().flatten(1).sum(1)
        rel = float(((got.double() - ref.double()).abs() / scale).max())
        ok = rel <= 1e-5
        bad += not ok
        print(f"{device}+triton dots g={gd}: |diff| / sum|w g| = {rel:.1e} {'ok' if ok else 'BAD'}")
    print("check-triton:", "all ok" if not bad else f"{bad} failures")
    return 1 if bad else 0


def bench_kernels(device: str, kernels: list[str], shapes: list[tuple[int, ...]], k: int,
                  triton_configs: list[str]) -> dict:
    """``mix`` (bf16 out) / ``dots`` (bf16 g) ms of each lazy kernel choice against the dense
    bf16 path, for every shape, in one run; plus exactness of triton against inductor."""
    import os
    from voodoo import kernels as dense_kernels
    from voodoo.lazy import QuantizedCandidates
    gen = torch.Generator(device=device).manual_seed(0)
    types = MENU6[:k]
    res: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                 "types": list(types), "torch": torch.__version__, "shapes": {}}
    try:
        import triton
        res["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        res["triton"] = f"not importable: {e}"
    n = 20 if device == "cuda" else 3
    env0 = {v: os.environ.get(v) for v in ("VOODOO_LAZY_KERNEL", "VOODOO_TRITON_ROWS",
                                           "VOODOO_TRITON_WARPS")}
    try:
        for shape in shapes:
            rows, cols = int(np.prod(shape[:-1])), shape[-1]
            blocks = [_random_blocks(t, rows, cols, device, gen) for t in types]
            probs = torch.softmax(torch.randn(k, device=device, generator=gen), 0)
            g = torch.randn(shape, device=device, generator=gen).to(torch.bfloat16)
            r: dict = {"weights": rows * cols,
                       "bytes_read_mix": sum(b.numel() for b in blocks),
                       "bytes_written_mix": rows * cols * 2}
            ref = QuantizedCandidates(blocks, types, shape, compile=False)
            dense = torch.stack([ref.dense(i).reshape(rows, cols) for i in range(k)]) \
                .to(torch.bfloat16)
            g2 = g.reshape(rows, cols)
            r["dense_bf16_mix_ms"] = _time(lambda: dense_kernels.mix(probs, dense,
                                                                      torch.bfloat16), device, n)
            r["dense_bf16_dots_ms"] = _time(lambda: dense_kernels.dots(dense, g2), device, n)
            del dense
            outs = {}
            for kern in kernels:
                os.environ["VOODOO_LAZY_KERNEL"] = kern
                lz = QuantizedCandidates(blocks, types, shape, compile=True)
                t0 = time.perf_counter()
                lz.mix(probs, torch.bfloat16), lz.dots(g)
                if device == "cuda":
                    torch.cuda.synchronize()
                r[f"{kern}_first_call_s"] = round(time.perf_counter() - t0, 2)
                r[f"{kern}_mix_ms"] = _time(lambda: lz.mix(probs, torch.bfloat16), device, n)
                r[f"{kern}_dots_ms"] = _time(lambda: lz.dots(g), device, n)
                r[f"{kern}_mix_GBps_read"] = round(r["bytes_read_mix"] / r[f"{kern}_mix_ms"]
                                                   / 1e6, 1)
                r[f"{kern}_mix_vs_dense_bf16"] = round(r[f"{kern}_mix_ms"]
                                                       / r["dense_bf16_mix_ms"], 3)
                r[f"{kern}_dots_vs_dense_bf16"] = round(r[f"{kern}_dots_ms"]
                                                        / r["dense_bf16_dots_ms"], 3)
                outs[kern] = (lz.mix(probs, torch.float32), lz.mix(probs, torch.bfloat16),
                              lz.dots(g))
                if kern == "triton":
                    for cfg in triton_configs:
                        rr, ww = cfg.split("x")
                        os.environ["VOODOO_TRITON_ROWS"], os.environ["VOODOO_TRITON_WARPS"] = rr, ww
                        lz.mix(probs, torch.bfloat16), lz.dots(g)
                        r[f"triton_{cfg}_mix_ms"] = _time(lambda: lz.mix(probs, torch.bfloat16),
                                                          device, n)
                        r[f"triton_{cfg}_dots_ms"] = _time(lambda: lz.dots(g), device, n)
                    for v in ("VOODOO_TRITON_ROWS", "VOODOO_TRITON_WARPS"):
                        os.environ.pop(v, None)
            if "triton" in outs and "inductor" in outs:
                a, b = outs["triton"], outs["inductor"]
                r["triton_mix_f32_equals_inductor"] = torch.equal(a[0].view(torch.int32),
                                                                  b[0].view(torch.int32))
                r["triton_mix_bf16_equals_inductor"] = torch.equal(a[1].view(torch.int16),
                                                                   b[1].view(torch.int16))
                r["triton_dots_rel_diff_vs_inductor"] = float((a[2] - b[2]).abs().max()
                                                              / b[2].abs().max())
                r["mix_ratio_triton_over_inductor"] = round(r["triton_mix_ms"]
                                                            / r["inductor_mix_ms"], 3)
                r["dots_ratio_triton_over_inductor"] = round(r["triton_dots_ms"]
                                                             / r["inductor_dots_ms"], 3)
            del outs, blocks
            key = "x".join(str(s) for s in shape)
            res["shapes"][key] = r
            print(f"{key}: " + ", ".join(f"{kk} {v}" for kk, v in r.items()), flush=True)
    finally:
        for v, x in env0.items():
            if x is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = x
    return res


# ---------------------------------------------------------------------------- bench
def _time(fn, device, n=10, warmup=2) -> float:
    """Median milliseconds of ``fn()``."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(n):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t))
    return statistics.median(ts)


def _peak(fn, device) -> int:
    """Peak bytes allocated by ``fn()`` above what was allocated before (CUDA only, else 0)."""
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _random_blocks(name, rows, cols, device, gen):
    """Well-formed bytes of ``name`` (finite scales) for timing: random payloads with every
    fp16 scale field set to a small finite value."""
    from voodoo.quants import qtype
    t = qtype(name)
    if name in ("F32", "F16", "BF16"):
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
        return (torch.randn(rows, cols, device=device, generator=gen) * 0.02).to(dt) \
            .view(torch.uint8).reshape(rows, -1)
    nb = rows * cols // t.block_size
    b = torch.randint(0, 256, (nb, t.type_size), dtype=torch.uint8, device=device, generator=gen)
    small = torch.tensor([0x2000], dtype=torch.int16).view(torch.uint8).to(device)  # 0.0078
    for off in F16_FIELDS.get(name, []):
        b[:, off:off + 2] = small
    if name == "IQ1_M":
        b[:, 49] = (b[:, 49] & 0x0F) | 0x00
        b[:, 51] = (b[:, 51] & 0x0F) | 0x00
        b[:, 53] = (b[:, 53] & 0x0F) | 0x00
        b[:, 55] = (b[:, 55] & 0x0F) | 0x20
    return b.reshape(rows, t.row_nbytes(cols))


def bench(device: str, rows: int, cols: int, k: int, tiles: list[int]) -> dict:
    from voodoo import kernels
    from voodoo.dequant import SUPPORTED_TYPES, dequantize
    from voodoo.lazy import QuantizedCandidates
    from voodoo.quants import qtype
    gen = torch.Generator(device=device).manual_seed(0)
    types = MENU6[:k]
    blocks = [_random_blocks(t, rows, cols, device, gen) for t in types]
    res: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                 "shape": [rows, cols], "types": list(types)}

    lazy = QuantizedCandidates(blocks, types, (rows, cols))
    res["lazy_bytes"] = lazy.nbytes
    res["dense_f32_bytes"] = lazy.dense_nbytes(torch.float32)
    res["dense_bf16_bytes"] = lazy.dense_nbytes(torch.bfloat16)
    res["memory_ratio_vs_f32"] = round(lazy.nbytes / res["dense_f32_bytes"], 4)
    res["memory_ratio_vs_bf16"] = round(lazy.nbytes / res["dense_bf16_bytes"], 4)
    res["lazy_bytes_per_weight"] = round(lazy.nbytes / (rows * cols), 4)

    dense = torch.stack([lazy.dense(i) for i in range(k)]).to(torch.bfloat16)   # (K, R, C)
    probs = torch.softmax(torch.randn(k, device=device, generator=gen), 0)
    g = torch.randn(rows, cols, device=device, generator=gen).to(torch.bfloat16)
    # agreement of the lazy path with the dense bf16 one (bf16 candidates round the weights)
    w_lazy = lazy.mix(probs, torch.float32)
    w_dense = kernels.mix(probs, dense, torch.float32)
    res["mix_max_abs_diff_vs_bf16_dense"] = float((w_lazy - w_dense).abs().max())
    res["dots_rel_diff_vs_bf16_dense"] = float(
        ((lazy.dots(g) - kernels.dots(dense, g)).abs().max() / kernels.dots(dense, g).abs().max()))
    del w_lazy, w_dense

    n = 5 if device == "cpu" else 20
    res["dense_mix_ms"] = _time(lambda: kernels.mix(probs, dense, torch.bfloat16), device, n)
    res["dense_dots_ms"] = _time(lambda: kernels.dots(dense, g), device, n)
    for comp in ([False, True] if device == "cuda" else [False]):
        for te in tiles:
            lz = QuantizedCandidates(blocks, types, (rows, cols), tile_elements=te, compile=comp)
            tag = f"{'compiled' if comp else 'eager'}_tile{te // cols}rows"
            t0 = time.perf_counter()
            lz.mix(probs, torch.bfloat16), lz.dots(g)
            res[f"first_call_s_{tag}"] = round(time.perf_counter() - t0, 1)
            res[f"lazy_mix_ms_{tag}"] = _time(lambda: lz.mix(probs, torch.bfloat16), device, n)
            res[f"lazy_dots_ms_{tag}"] = _time(lambda: lz.dots(g), device, n)
            res[f"lazy_mix_peak_bytes_{tag}"] = _peak(lambda: lz.mix(probs, torch.bfloat16),
                                                      device)
            res[f"lazy_dots_peak_bytes_{tag}"] = _peak(lambda: lz.dots(g), device)
            # one-hot probabilities give each candidate's libggml bits exactly
            # (values: 1*(-0.0) + 0*x is +0.0)
            res[f"onehot_exact_{tag}"] = all(
                torch.equal(lz.mix(torch.nn.functional.one_hot(torch.tensor(i), k).float()
                                   .to(device)), lz.dense(i)) for i in range(k))
            res[f"dots_rel_diff_vs_f32_{tag}"] = float(
                (lz.dots(g) - torch.stack([(lz.dense(i) * g.float()).sum() for i in range(k)]))
                .abs().max() / lz.dots(g).abs().max())
    # reference: a bf16 matmul of this weight with 8192 tokens (what the mix feeds)
    x = torch.randn(8192, cols, device=device, dtype=torch.bfloat16, generator=gen) \
        if device == "cuda" else torch.randn(64, cols, generator=gen)
    wt = dense[0] if device == "cuda" else dense[0].float()
    res["matmul_ms_tokens"] = x.shape[0]
    res["matmul_ms"] = _time(lambda: x @ wt.T, device, n)

    # every type's dequantization throughput on this shape (output float32 GB/s)
    per = {}
    for name in SUPPORTED_TYPES:
        b = _random_blocks(name, rows, cols, device, gen)
        ms = _time(lambda: dequantize(b, name, cols), device, 5 if device == "cpu" else 10)
        per[name] = {"ms": round(ms, 3), "out_GBps": round(rows * cols * 4 / ms / 1e6, 1),
                     "peak_bytes": _peak(lambda: dequantize(b, name, cols), device)}
        del b
    res["dequantize"] = per
    if device == "cuda":  # the same, compiled (Inductor, exact options), and where mix's time goes
        from voodoo.dequant import (compile_recompile_limit, dequantize_blocks,
                                    exact_compile_options, warm_tables)
        comp = torch.compile(dequantize_blocks, dynamic=False, options=exact_compile_options())
        perc = {}
        with torch._dynamo.config.patch(**compile_recompile_limit()):
            for name in SUPPORTED_TYPES:
                t = qtype(name)
                warm_tables([name], device)
                b = _random_blocks(name, rows, cols, device, gen).reshape(-1, t.type_size)
                ms = _time(lambda: comp(b, name), device, 10)
                perc[name] = {"ms": round(ms, 3),
                              "out_GBps": round(rows * cols * 4 / ms / 1e6, 1),
                              "in_GBps": round(b.numel() / ms / 1e6, 1)}
                del b
        res["dequantize_compiled"] = perc
        lz = QuantizedCandidates(blocks, types, (rows, cols), tile_elements=1024 * cols,
                                 compile=True)
        lz.mix(probs, torch.bfloat16)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            lz.mix(probs, torch.bfloat16)
            torch.cuda.synchronize()
        res["compiled_mix_kernels"] = [
            (e.key[:80], e.count, round(e.device_time_total / 1e3, 3))
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference")
    r.add_argument("out")
    c = sub.add_parser("check")
    c.add_argument("path")
    c.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    c.add_argument("--compile", action="store_true", help="check the torch.compile'd kernels")
    b = sub.add_parser("bench")
    b.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    b.add_argument("--rows", type=int, default=4096)
    b.add_argument("--cols", type=int, default=4096)
    b.add_argument("--k", type=int, default=6)
    b.add_argument("--tile_rows", type=int, nargs="*", default=[1024, 4096])
    b.add_argument("--json", "--out", dest="json", help="also write the result here")
    b.add_argument("--kernels", help="only compare lazy kernels, e.g. triton,inductor "
                   "(VOODOO_LAZY_KERNEL values), at 4096x4096 and --moe_shape")
    b.add_argument("--moe_shape", default="128x768x2048",
                   help="the 3-D (n_expert x rows x cols) shape of the --kernels comparison")
    b.add_argument("--triton_configs", default="",
                   help="with --kernels: also time Triton at these ROWSxWARPS, e.g. 4x4,16x8")
    t = sub.add_parser("check-triton")
    t.add_argument("path")
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    if a.cmd == "check-triton":
        return check_triton(a.path, a.device)
    if a.cmd == "reference":
        make_reference(a.out)
        return 0
    if a.cmd == "check":
        return check(a.path, a.device, a.compile)
    if a.kernels:
        shapes = [(a.rows, a.cols), tuple(int(x) for x in a.moe_shape.split("x"))]
        res = bench_kernels(a.device, [x.strip() for x in a.kernels.split(",") if x.strip()],
                            shapes, a.k, [c for c in a.triton_configs.split(",") if c])
    else:
        res = bench(a.device, a.rows, a.cols, a.k, [t * a.cols for t in a.tile_rows])
    line = json.dumps(res)
    print(line)
    if a.json:
        with open(a.json, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
