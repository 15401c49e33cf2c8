#!/usr/bin/env bash
# Gate-step cost on H200s (random weights: speed and memory only). From the repository root.
# One GPU: plain bf16 fwd+bwd vs gated fwd+bwd vs a whole step, then TorchTrainer on 1 GPU.
# Two GPUs: tensor parallel 2 over NCCL and layer-wise over both, under TorchTrainer.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 benchmarks/gpu_gate_step.py --single --n 5 --json h200_single.json
python3 benchmarks/gpu_gate_step.py --ray --ray_steps 6 --json h200_ray1.json
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  python3 benchmarks/gpu_gate_step.py --tp 2 --ray_steps 6 --json x2_tp2.json
  python3 benchmarks/gpu_gate_step.py --device_map cuda:0,cuda:1 --ray_steps 6 --json x2_layerwise.json
fi
