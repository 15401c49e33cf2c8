#!/usr/bin/env bash
# The main job on 2 CPU cores: SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI) at 55% of its Q8_0
# size, compared with llama.cpp's IQ2_XXS, IQ2_M and IQ4_XS files by llama-perplexity.
set -euo pipefail
voodoo run --compression_ratio 0.55 --output_dir runs/smollm2-voodoo55 \
  --seq_len 512 --n_train_blocks 48 --imatrix_blocks 16 --max_steps 24 --lr 0.05 \
  --teacher_quant BF16 --stock_types IQ2_XXS,IQ2_M,IQ4_XS --chunks 8 "$@"
