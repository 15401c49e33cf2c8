#!/usr/bin/env bash
# A Qwen2.5-32B-shaped Llama (hidden 5120, intermediate 27648, 64 layers, 40 heads, 8 KV heads,
# vocab 152064; random weights: speed and memory do not depend on the values) at K = 6, 8192
# tokens a step, --lazy --gradient_checkpointing --teacher_quant Q8_0, under Ray Train's
# TorchTrainer over N = 2 or 4 GPUs of one host (issue 12):
#   tp         tensor parallel over all N GPUs (NCCL, one worker a GPU)
#   layerwise  layer-wise over the same GPUs (--device_map cuda:0,...; one worker)
#   agree      a smaller shape (2048/8192, 8 layers, float32) sharded both ways and in one
#              process (one GPU, same construction and seed): the first-step losses compared
# From the repository root, on the GPU machine (through the device tool: after
# `source .device/setup.sh`). Each part is one command of a few minutes:
#   bash recipes/qwen32b_lazy_multi_gpu.sh [tp|layerwise|agree|all] [N]
# JSON: benchmarks/results/lazy_multi_gpu/x${N}_{tp${N},layerwise}_32b_lazy.json and
# x${N}_agreement_small.json (copied to $OUT too when it is set), logs next to them.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
PART=${1:-all}
N=${2:-$(nvidia-smi -L | wc -l)}
case "$N" in 2|4) ;; *) echo "need 2 or 4 GPUs, got N=$N" >&2; exit 2 ;; esac
R=${RESULTS:-benchmarks/results/lazy_multi_gpu}
mkdir -p "$R"
B=benchmarks/gpu_gate_step.py
MAP=$(seq -s, -f 'cuda:%g' 0 $((N - 1)))
S32="--hidden 5120 --intermediate 27648 --layers 64 --heads 40 --kv_heads 8 --vocab 152064"
SMALL="--hidden 2048 --intermediate 8192 --layers 8 --heads 16 --kv_heads 8 --vocab 32000"
LAZY="--lazy on --gradient_checkpointing --teacher_quant Q8_0"
run() {  # name, args...
  local name=$1; shift
  python3 $B "$@" --json "$R/$name.json" 2>&1 \
    | grep -v "use_cache=True\|PlacementGroupCleaner" | tee "$R/log_$name.txt"
  [ -n "${OUT:-}" ] && cp "$R/$name.json" "$R/log_$name.txt" "$OUT/" 2>/dev/null
  return 0
}
if [ "$PART" = tp ] || [ "$PART" = all ]; then
  run x${N}_tp${N}_32b_lazy $S32 --k 6 --tokens 8192 $LAZY --tp "$N" --ray_steps ${RAY_STEPS:-4}
fi
if [ "$PART" = layerwise ] || [ "$PART" = all ]; then
  run x${N}_layerwise_32b_lazy $S32 --k 6 --tokens 8192 $LAZY --device_map "$MAP" \
    --ray_steps ${RAY_STEPS:-4}
fi
if [ "$PART" = agree ] || [ "$PART" = all ]; then
  # float32: the sharded and one-process first-step losses agree to float32 rounding
  # (all-reduce order); the one-process run takes one GPU
  run x${N}_agreement_small $SMALL --k 6 --tokens 2048 $LAZY --dtype float32 --tp "$N" \
    --device_map "$MAP" --agree --agree_tol 1e-4 --ray_steps 3
fi
