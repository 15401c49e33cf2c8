#!/usr/bin/env bash
# Does `voodoo train --ray --use_gpu` exit after bake? (run3 hit its time limit right after the
# "baked:" line.) Runs run.sh's ray mode with every line time-stamped, and at TMO seconds sends
# SIGUSR1 (faulthandler dumps every thread's stack) before the kill. Stage as for run.sh.
# MODE=tune: `voodoo tune` instead, NS trials sharing the GPU (--gpus_per_trial 1/NS), --export.
# EXTRA: more flags for the command (e.g. --gradient_checkpointing).
set -uo pipefail
LIBONLY=${LIBONLY-1} source benchmarks/gpu_cli/setup.sh   # the tools are not needed
M=/tmp/smol-random-${LAYERS:-30}
[ -f $M/model.safetensors ] || python3 benchmarks/gpu_cli/make_model.py .gpu/tokenizer $M ${LAYERS:-30} 2>&1 | tail -1
C="--model $M --data_name $PWD/.gpu/calib.txt --seq_len 512 --n_train_blocks ${NB:-32} --n_eval_blocks 4 --imatrix_blocks 8 --compression_ratio 0.55 --max_steps ${STEPS:-8} --device cuda ${EXTRA:-}"
if [ "${MODE:-train}" = tune ]; then
  NS=${NS:-2}
  X="tune --num_samples $NS --max_concurrent_trials $NS --gpus_per_trial $(python3 -c "print(1/$NS)") --export --dtype bfloat16"
else
  X="train --ray --use_gpu --num_workers 1 --dtype bfloat16"
fi
t1=$(date +%s)
timeout -s USR1 -k 20 ${TMO:-300} python3 -c "
import faulthandler, signal, sys, runpy
faulthandler.register(signal.SIGUSR1, all_threads=True)
sys.argv = ['voodoo'] + sys.argv[1:]
runpy.run_module('voodoo.cli', run_name='__main__')" $X $C --output_dir $O/ray 2>&1 | \
  python3 -u -c "
import sys, time
t0 = time.time()
for l in sys.stdin: sys.stdout.write(f'{time.time() - t0:7.1f} {l}')" > $O/train_ray.log; rc=$?
echo "[gpu] ${MODE:-train} rc=$rc in $(( $(date +%s) - t1 )) s"
grep -n "baked\|Thread\|File \"" $O/train_ray.log | head -60
tail -5 $O/train_ray.log
ps aux | grep -c "ray::" 
