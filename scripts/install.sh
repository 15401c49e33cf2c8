#!/usr/bin/env bash
# Installs Voodoo and what it needs on a fresh machine, then fetches the pinned llama.cpp and
# builds libggml-base and the llama.cpp tools into ~/.cache/voodoo (reused when present; only
# what is missing is built).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
say() { echo "[install] $* ($((SECONDS - t0)) s)" >&2; }
# as root (containers, CI), pip's "Running pip as the 'root' user" warning is noise here
export PIP_ROOT_USER_ACTION=ignore
# torch first: on these machines pip takes the local CPU wheel for torch==2.13.0; an
# unpinned torch would pull a multi-GB CUDA build.
if python3 -c 'import torch' 2>/dev/null; then
    say "torch $(python3 -c 'import torch; print(torch.__version__)') already installed"
else
    say "installing torch==2.13.0"
    python3 -m pip install -q "torch==2.13.0"
fi
say "pip install -e .[test] (Voodoo, its dependencies and the cython_ggml extension; about a minute the first time)"
python3 -m pip install -q -e ".[test]"
say "voodoo bootstrap (llama.cpp: cached builds are reused)"
voodoo bootstrap
say "done"
