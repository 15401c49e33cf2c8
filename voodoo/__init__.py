"""Voodoo: learned per-tensor mixed-precision quantization, exported as a GGUF that stock
llama.cpp runs. The CLI is :mod:`voodoo.cli`; the design is in docs/method.md."""

import os as _os

# OpenMP threads that spin while they wait (GNU libgomp spins 300,000 times before it sleeps)
# fight for the cores on a shared machine. A SmolLM2-size forward+backward on 2 cores with 3
# busy processes beside it: 17.9 s with libgomp's default, 10.6 s with GOMP_SPINCOUNT=10000,
# 9.4 s with OMP_WAIT_POLICY=PASSIVE; on the idle cores 3.29, 3.05 and 3.34 s
# (benchmarks/omp_wait.py). llama.cpp's tools (ggml-cpu with OpenMP) inherit it. Set before
# torch is imported, i.e. only where Voodoo is imported first (the CLI, the tests); a policy
# the user set is kept.
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ.setdefault("GOMP_SPINCOUNT", "10000")
