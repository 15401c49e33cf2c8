"""Voodoo: learned per-tensor mixed-precision quantization, exported as a GGUF that stock
llama.cpp runs. The CLI is :mod:`voodoo.cli`; the design is in docs/method.md."""

import os as _os

# OpenMP threads that spin while they wait (GNU libgomp's default) fight for the cores on a
# shared machine: a SmolLM2-size forward+backward on 2 cores with 3-4 other busy processes took
# 15-55 s spinning and 6-11 s with passive waiting (benchmarks/omp_wait.py). Set before torch
# is imported, i.e. only where Voodoo is imported first (the CLI, the tests); a value the user
# set is kept.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
