"""Compile voodoo.triton_lazy's kernels for a GPU architecture without a GPU and report their
registers, SASS size and PTX checks (no ``fma``, no ``.ftz``): for tuning tile sizes offline.

    PYTHONPATH=. python benchmarks/triton_lazy_sass.py --menu Q8_0,Q6_K,Q5_K,Q4_K,IQ4_XS,IQ3_S \\
        --configs 8x4,16x4,16x8 [--arch 90] [--uneven] [--fp32-out]

Needs only triton (its bundled ptxas and cuobjdump); measured with triton 3.9.0. "warp instr /
weight" is the static SASS count x warps / weights of a tile: the instructions issued per
output weight (all K candidates), the kernels having no loops at CT = 1.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from voodoo import triton_lazy as T


def compile_kernel(codes, r, c, warps, *, dots, even=True, bf16_out=True, ct=1, arch=90):
    fn = T._dots_kernel if dots else T._mix_kernel
    names = list(fn.arg_names)
    sig, cst, attrs = {}, {}, {}
    ptr_t = {14: "*fp16", 15: "*i16", 16: "*fp32"}
    for i, n in enumerate(names):
        if n.startswith("Q") and n[1:].isdigit():
            sig[n] = ptr_t.get(codes[int(n[1:])], "*u8")
        elif n.startswith("RB"):
            sig[n] = "i64"
        elif n in ("n_rows", "n_per_row", "n_groups", "n_programs"):
            sig[n] = "i32"
        elif n == "out_ptr":
            sig[n] = "*bf16" if bf16_out else "*fp32"
        elif n in ("p_ptr", "part_ptr", "kv_ptr"):
            sig[n] = "*fp32"
        elif n == "g_ptr":
            sig[n] = "*bf16"
        elif n == "g3_ptr":
            sig[n] = "*i32"
        else:  # constexprs
            sig[n] = "constexpr"
            val = {"R": r, "C": c, "CT": ct, "BF16_OUT": False, "EVEN_ROWS": even}.get(n)
            cst[(i,)] = codes[int(n[1:])] if val is None else val
        # what a real launch specializes on: 16-byte aligned pointers and row strides
        if sig[n].startswith("*") or n.startswith("RB") or n == "n_per_row":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=cst, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "enable_fp_fusion": False})


def stats(kernel) -> dict:
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        res = subprocess.run([f"{bindir}/cuobjdump", "-res-usage", f.name],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([f"{bindir}/cuobjdump", "-sass", f.name],
                              capture_output=True, text=True).stdout
    ins = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    ops = Counter(re.sub(r"^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?", "", ln).split()[0]
                  .split(".")[0] for ln in ins)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    ptx = kernel.asm["ptx"]
    return {"regs": int(m.group(1)) if m else None, "stack": int(m.group(2)) if m else None,
            "sass": len(ins), "ops": ops.most_common(8),
            "ptx_fma": len(re.findall(r"\bfma\.", ptx)), "ptx_ftz": len(re.findall(r"\.ftz", ptx))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--menu", default="Q8_0,Q6_K,Q5_K,Q4_K,IQ4_XS,IQ3_S")
    ap.add_argument("--configs", default="8x4", help="ROWSxWARPS,...")
    ap.add_argument("--cols", type=int, default=4096, help="row length (picks C)")
    ap.add_argument("--ct", type=int, default=1)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--uneven", action="store_true", help="the masked (last row tile) kernel")
    ap.add_argument("--fp32-out", action="store_true")
    a = ap.parse_args(argv)
    menu = a.menu.split(",")
    codes = [T.TYPE_CODES[t] for t in menu] + [0] * (T.MAX_K - len(menu))
    c = T._col_tile(menu, a.cols)
    bad = 0
    for cfg in a.configs.split(","):
        r, w = (int(x) for x in cfg.split("x"))
        for dots in (False, True):
            k = compile_kernel(codes, r, c, w, dots=dots, even=not a.uneven,
                               bf16_out=not a.fp32_out, ct=a.ct, arch=a.arch)
            st = stats(k)
            bad += st["ptx_fma"] + st["ptx_ftz"] > 0
            print(f"{'dots' if dots else 'mix '} R={r} C={c} warps={w} CT={a.ct}: regs "
                  f"{st['regs']} stack {st['stack']}, SASS {st['sass']}, warp instr / weight "
                  f"{st['sass'] * w / (r * c * a.ct):.2f}, PTX fma {st['ptx_fma']} ftz "
                  f"{st['ptx_ftz']}; {st['ops']}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
