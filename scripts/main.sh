#!/usr/bin/env bash
# The main job (README.md): install, build llama.cpp once (cached), then Voodoo55 on the default
# model (SmolLM2-135M-Instruct) and corpus, ending with a llama-perplexity table against the
# stock llama.cpp file types nearest in size. Candidate bytes: --rounding auto (per tensor and
# type, llama-quantize's or error-feedback rounding, whichever is better on held-out blocks;
# docs/method.md), the best measured. More calibration text than the CLI's defaults: 192 blocks
# for the input Hessians and gate training, 16 held-out, 32 gate steps (issue 14: lower KLD at
# four of five equal-size benchmarks, none worse; docs/method.md). Extra flags go to
# `voodoo run` (later ones win).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
voodoo doctor || true
exec voodoo run --compression_ratio 0.55 --rounding auto --n_train_blocks 192 --n_eval_blocks 16 \
    --hessian_blocks 192 --max_steps 32 --output_dir runs/main "$@"
