#!/usr/bin/env bash
# Tensor-parallel-4 gate training of a large Llama-architecture model (e.g. a local
# Llama-3.1-70B-class HF folder; its candidates at K=6 in bf16 need the four GPUs' memory).
# Candidates are precached on the cluster's CPUs first (Ray actors, shared cache folder).
set -euo pipefail
MODEL=${MODEL:?set MODEL=/path/to/hf-folder}
OUT=${OUT:-runs/tp4}
voodoo precache --model "$MODEL" --output_dir "$OUT" --seq_len 4096 --n_train_blocks 256
voodoo tp --nproc 4 -- --model "$MODEL" --output_dir "$OUT" --compression_ratio 0.45 \
  --seq_len 4096 --batch_size 2 --max_steps 500 --lr 0.05 --dtype bfloat16 --device cuda \
  --teacher_quant Q8_0 --partial_save_interval 25 --run_name tp4 "$@"
voodoo export --model "$MODEL" --output_dir "$OUT" --assignment "$OUT"/*.assignment.json
