#!/usr/bin/env bash
# The main job (README.md): install, build llama.cpp once (cached), then Voodoo55 on the default
# model (SmolLM2-135M-Instruct) and corpus, ending with a llama-perplexity table against the
# stock llama.cpp file types nearest in size. Extra flags go to `voodoo run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
voodoo doctor || true
exec voodoo run --compression_ratio 0.55 --output_dir runs/main "$@"
