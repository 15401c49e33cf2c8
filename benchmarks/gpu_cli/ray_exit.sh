#!/usr/bin/env bash
# Does `voodoo train --ray --use_gpu` exit after bake? (run3 hit its time limit right after the
# "baked:" line.) Runs run.sh's ray mode with every line time-stamped, and at TMO seconds sends
# SIGUSR1 (faulthandler dumps every thread's stack) before the kill. Stage as for run.sh.
# MODE=tune: `voodoo tune` instead, NS trials sharing the GPU (--gpus_per_trial 1/NS), --export.
set -uo pipefail
O=${OUT:-/tmp/out}; mkdir -p $O
[ -f .device/setup.sh ] && source .device/setup.sh
export VOODOO_CACHE=${VOODOO_CACHE:-/tmp/vc} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
S=$VOODOO_CACHE/llama.cpp/0c1e57098
if [ ! -f $S/src/convert_hf_to_gguf.py ]; then mkdir -p $S && tar xJf .gpu/llama-src.tar.xz -C $S; fi
t0=$(date +%s)
ls cython_ggml/_ggml*.so 2>/dev/null | grep -q "$(python3 -c 'import sysconfig;print(sysconfig.get_config_var("EXT_SUFFIX"))')" || \
  (python3 setup.py build_ext --inplace > $O/build_ext.log 2>&1 || tail -20 $O/build_ext.log)
python3 -c "from voodoo.llamacpp import build_lib; print(build_lib())" > $O/bootstrap.log 2>&1 || tail -30 $O/bootstrap.log
echo "[gpu] built in $(( $(date +%s) - t0 )) s"
M=/tmp/smol-random-${LAYERS:-30}
[ -f $M/model.safetensors ] || python3 benchmarks/gpu_cli/make_model.py .gpu/tokenizer $M ${LAYERS:-30} 2>&1 | tail -1
C="--model $M --data_name $PWD/.gpu/calib.txt --seq_len 512 --n_train_blocks ${NB:-32} --n_eval_blocks 4 --imatrix_blocks 8 --compression_ratio 0.55 --max_steps ${STEPS:-8} --device cuda"
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
