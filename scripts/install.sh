#!/usr/bin/env bash
# Installs Voodoo and what it needs on a fresh machine, then fetches the pinned llama.cpp and
# builds libggml-base and the llama.cpp tools into ~/.cache/voodoo (reused when present).
set -euo pipefail
cd "$(dirname "$0")/.."
# torch first: on these machines pip takes the local CPU wheel for torch==2.13.0; an
# unpinned torch would pull a multi-GB CUDA build.
python3 -c 'import torch' 2>/dev/null || python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[test]"
voodoo bootstrap
