#!/usr/bin/env bash
# The whole main job on one GPU through Ray: `voodoo run --ray --use_gpu` (imatrix, candidates on
# Ray actors, Ray Train with one GPU worker, bake, export, llama-perplexity eval with a stock
# file beside it), on a SmolLM2-135M-shaped Llama with random weights. Stage as for run.sh
# (benchmarks/gpu_cli/stage.sh, ../shared/device/stage.sh); on the GPU machine, carrying
# .device and .gpu:   bash benchmarks/gpu_cli/main_run.sh   (env: LAYERS NB STEPS TMO OUT)
set -uo pipefail
source benchmarks/gpu_cli/setup.sh
M=/tmp/smol-random-${LAYERS:-30}
[ -f $M/model.safetensors ] || python3 benchmarks/gpu_cli/make_model.py .gpu/tokenizer $M ${LAYERS:-30} 2>&1 | tail -1
t1=$(date +%s)
timeout -k 20 ${TMO:-420} python3 -m voodoo.cli run --model $M --data_name $PWD/.gpu/calib.txt \
  --seq_len 512 --n_train_blocks ${NB:-32} --n_eval_blocks 4 --compression_ratio 0.55 \
  --max_steps ${STEPS:-8} --device cuda --dtype bfloat16 --ray --use_gpu --num_workers 1 \
  --eval_text $PWD/.gpu/calib.txt --chunks 8 --stock_types Q4_K_M --output_dir $O/run \
  2>&1 | python3 -u -c "
import sys, time
t0 = time.time()
for l in sys.stdin: sys.stdout.write(f'{time.time() - t0:7.1f} {l}')" > $O/run.log; rc=${PIPESTATUS[0]}
echo "[gpu] run rc=$rc in $(( $(date +%s) - t1 )) s" | tee -a $O/progress.txt
grep -E "baked|peak|predicted device|GGUF|KLD|Q4_K_M|Voodoo|step" $O/run.log | tail -25
tail -15 $O/run.log
cp $O/run/*.md $O/ 2>/dev/null; rm -f $O/run/*.gguf; find $O/run -name "*.gguf" -delete
