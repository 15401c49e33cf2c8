#!/usr/bin/env bash
# The main job on 2 CPU cores (scripts/main.sh's `voodoo run`, every flag spelled out):
# SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI) at 55% of its Q8_0 size, compared with llama.cpp's
# IQ2_XXS, IQ2_M and IQ4_XS files by llama-perplexity (8 chunks of 512 tokens).
set -euo pipefail
voodoo run --compression_ratio 0.55 --output_dir runs/smollm2-voodoo55 \
  --seq_len 512 --n_train_blocks 192 --n_eval_blocks 16 --hessian_blocks 192 --imatrix_blocks 16 \
  --rounding auto --max_steps 32 --lr 0.05 --teacher_quant BF16 \
  --stock_types IQ2_XXS,IQ2_M,IQ4_XS --chunks 8 "$@"
