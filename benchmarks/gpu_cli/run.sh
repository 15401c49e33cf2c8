#!/usr/bin/env bash
# The CLI on one GPU (issue 11): voodoo train --lazy --device cuda (Q8_0 teacher, checkpointing) and
# the eager student on cuda, on a SmolLM2-135M-shaped Llama with random weights; export; eval with
# llama-perplexity; MODES=ray: voodoo train --ray --use_gpu (Ray Train, one GPU worker). Stage first, here: bash benchmarks/gpu_cli/stage.sh (and ../shared/device/stage.sh
# for .device); then on the GPU machine, from the repo root, carrying .device and .gpu:
#   bash benchmarks/gpu_cli/run.sh        (env: LAYERS SEQ NB STEPS TMO MODES LIBONLY DEV DT OUT)
set -uo pipefail
DEV=${DEV:-cuda}
source benchmarks/gpu_cli/setup.sh
python3 -c "import torch; print('[gpu]', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')"
M=/tmp/smol-random-${LAYERS:-30}
[ -f $M/model.safetensors ] || python3 benchmarks/gpu_cli/make_model.py .gpu/tokenizer $M ${LAYERS:-30} 2>&1 | tail -1
C="--model $M --data_name $PWD/.gpu/calib.txt --seq_len ${SEQ:-512} --n_train_blocks ${NB:-32} --n_eval_blocks 4 --imatrix_blocks 8 --compression_ratio 0.55 --max_steps ${STEPS:-20} --device $DEV"
for mode in ${MODES:-lazy eager}; do
  t1=$(date +%s)
  case $mode in
    lazy) X="--no_ray --lazy --gradient_checkpointing --teacher_quant Q8_0 --dtype ${DT:-bfloat16}";;
    ray) X="--ray --use_gpu --num_workers 1 --dtype ${DT:-bfloat16}";;   # Ray Train, one GPU worker
    *) X="--no_ray --dtype ${DT:-bfloat16}";;
  esac
  timeout ${TMO:-200} python3 -m voodoo.cli train $C --output_dir $O/$mode $X > $O/train_$mode.log 2>&1; rc=$?
  echo "[gpu] train $mode rc=$rc in $(( $(date +%s) - t1 )) s" | tee -a $O/progress.txt
  grep -E "predicted device memory|peak|baked|gate training|steps/s|memory" $O/train_$mode.log | tail -8
  tail -3 $O/train_$mode.log
done
python3 - $O ${MODES:-lazy eager} <<'PY'
import json, sys, glob
o, modes = sys.argv[1], sys.argv[2:]
a = {m: json.load(open(g[0]))["tensors"] for m in modes if (g := glob.glob(f"{o}/{m}/*.assignment.json"))}
t = lambda v: v if isinstance(v, str) else v.get("type")
for m in list(a)[1:]:
    m0 = list(a)[0]
    diff = [k for k in a[m0] if t(a[m0][k]) != t(a[m].get(k))]
    print(f"[gpu] {m0} vs {m} assignments: {len(diff)} of {len(a[m0])} tensors differ", diff[:5])
PY
case " ${MODES:-lazy eager} " in *" lazy "*) ;; *) exit 0;; esac
t1=$(date +%s)
A=$(ls $O/lazy/*.assignment.json)
python3 -m voodoo.cli export --model $M --output_dir $O/lazy --no_ray --assignment $A > $O/export.log 2>&1; echo "[gpu] export rc=$? $(( $(date +%s) - t1 )) s" | tee -a $O/progress.txt
tail -4 $O/export.log
G=${A%.assignment.json}.gguf
python3 -m voodoo.cli eval --model $M --output_dir $O/lazy --gguf $G --eval_text $PWD/.gpu/calib.txt --chunks 8 > $O/eval.log 2>&1; echo "[gpu] eval rc=$?" | tee -a $O/progress.txt
tail -12 $O/eval.log
rm -f $O/*/*.gguf
