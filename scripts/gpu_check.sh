#!/usr/bin/env bash
# The CUDA checks that CI (CPU only) cannot run: the flex-attention trainer path with backward,
# in float32 and bfloat16, the trainer benchmark with flex vs chunked attention on the GPU, and
# the engine on CUDA (engine vs trainer log-probs, engine vs transformers throughput in bfloat16).
# Usage: bash scripts/gpu_check.sh OUT_DIR [SMOLLM2_DIR]   (needs a CUDA build of torch)
#   SMOLLM2_DIR: an imported SmolLM2 folder (compactrl import-gguf --smollm2 DIR); when given and
#   missing, the script tries to import it there; its engine checks are skipped if that fails.
#   VLLM_PYTHON=/path/to/venv/bin/python adds vLLM (CUDA build) to the engine benchmark.
set -uo pipefail
out=${1:-gpu_check_out}
smollm2=${2:-${SMOLLM2_DIR:-}}
mkdir -p "$out"
py=${PYTHON:-python3}
cli="$py -m compactrl.cli"
$py -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt"
$cli verify trainer --device cuda --json > "$out/verify_trainer_cuda_fp32.json"; echo "verify fp32 rc=$?"
$cli verify trainer --device cuda --dtype bfloat16 --json > "$out/verify_trainer_cuda_bf16.json"; echo "verify bf16 rc=$?"
for backend in flex chunked; do
  $cli bench trainer --device cuda --backend "$backend" --tokens 16384 --budget 4096 \
    --turn-len 512 --repeats 3 --json --out "$out/bench_trainer_cuda_$backend.json" > /dev/null
  echo "bench $backend rc=$?"
done

# the engine on CUDA: sampled log-probs vs the trainer (float32 gated at 5e-5, bfloat16 on mean KL)
for dtype in float32 bfloat16; do
  $cli verify engine --device cuda --dtype "$dtype" --json > "$out/verify_engine_cuda_$dtype.json"
  echo "verify engine $dtype rc=$?"
done
vllm=()
if [ -n "${VLLM_PYTHON:-}" ]; then vllm=(--vllm-python "$VLLM_PYTHON"); fi
# ours vs transformers generate (vs vLLM) in bfloat16 on the GPU, generated 24.7M-parameter model
$cli bench engine --device cuda --dtype bfloat16 --size base --new-tokens 64 --repeats 3 ${vllm[@]+"${vllm[@]}"} \
  --json --out "$out/bench_engine_cuda_bf16_base.json" > /dev/null
echo "bench engine base bf16 rc=$?"

if [ -n "$smollm2" ]; then
  if [ ! -f "$smollm2/config.json" ]; then
    $cli import-gguf --smollm2 "$smollm2" > "$out/import_smollm2.txt" 2>&1; echo "import smollm2 rc=$?"
  fi
  if [ -f "$smollm2/config.json" ]; then
    $cli verify engine --device cuda --dtype bfloat16 --model "$smollm2" --sessions 16 --json \
      > "$out/verify_engine_cuda_bf16_smollm2.json"
    echo "verify engine smollm2 bf16 rc=$?"
    for dtype in bfloat16 float32; do
      $cli bench engine --device cuda --dtype "$dtype" --model "$smollm2" --new-tokens 64 --repeats 3 \
        ${vllm[@]+"${vllm[@]}"} --json --out "$out/bench_engine_cuda_${dtype}_smollm2.json" > /dev/null
      echo "bench engine smollm2 $dtype rc=$?"
    done
  else
    echo "no SmolLM2 folder at $smollm2: its engine checks skipped"
  fi
fi
