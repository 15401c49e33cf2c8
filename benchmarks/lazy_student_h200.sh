#!/usr/bin/env bash
# The lazy student on one H200 (benchmarks/results/lazy_student/). From the repository root, on
# the GPU machine, after `source .device/setup.sh`. Writes JSON and logs under ${OUT:-.}.
#   bash benchmarks/lazy_student_h200.sh 14b   # Qwen3-14B shape: --lazy --gradient_checkpointing
#                                               # --teacher_quant Q8_0, one GPU, then TorchTrainer
#   bash benchmarks/lazy_student_h200.sh 3b    # Llama-3.2-3B shape, eager vs lazy side by side
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
O=${OUT:-.}
B=benchmarks/gpu_gate_step.py
S14="--hidden 5120 --intermediate 17408 --layers 40 --heads 40 --kv_heads 8 --vocab 151936"
case "${1:-14b}" in
  14b)
    python3 $B $S14 --k 6 --tokens 8192 --single --n 3 --lazy on --gradient_checkpointing \
      --teacher_quant Q8_0 --json $O/h200_single_14b_lazy_ckpt_q8teacher.json 2>&1 \
      | grep -v "use_cache=True" | tee $O/log_14b_single.txt
    python3 $B $S14 --k 6 --tokens 8192 --ray --ray_steps ${RAY_STEPS:-5} --lazy on \
      --gradient_checkpointing --teacher_quant Q8_0 \
      --json $O/h200_ray1_14b_lazy_ckpt_q8teacher.json 2>&1 \
      | grep -v "use_cache=True\|PlacementGroupCleaner" | tee $O/log_14b_ray.txt ;;
  3b)
    python3 $B --k 6 --tokens 8192 --single --n 3 --lazy both --teacher_quant ${TQ:-BF16} \
      --json $O/h200_single_3b_eager_vs_lazy.json 2>&1 | tee $O/log_3b.txt ;;
esac
