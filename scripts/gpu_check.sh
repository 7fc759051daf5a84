#!/usr/bin/env bash
# The CUDA checks that CI (CPU only) cannot run: the flex-attention trainer path with backward,
# in float32 and bfloat16, and the trainer benchmark with flex vs chunked attention on the GPU.
# Usage: bash scripts/gpu_check.sh OUT_DIR   (needs a CUDA build of torch)
set -uo pipefail
out=${1:-gpu_check_out}
mkdir -p "$out"
py=${PYTHON:-python3}
$py -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt"
$py -m compactrl.cli verify trainer --device cuda --json > "$out/verify_trainer_cuda_fp32.json"; echo "verify fp32 rc=$?"
$py -m compactrl.cli verify trainer --device cuda --dtype bfloat16 --json > "$out/verify_trainer_cuda_bf16.json"; echo "verify bf16 rc=$?"
for backend in flex chunked; do
  $py -m compactrl.cli bench trainer --device cuda --backend "$backend" --tokens 16384 --budget 4096 \
    --turn-len 512 --repeats 3 --json --out "$out/bench_trainer_cuda_$backend.json" > /dev/null
  echo "bench $backend rc=$?"
done
