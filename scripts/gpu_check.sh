#!/usr/bin/env bash
# The CUDA checks that CI (CPU only) cannot run: the flex-attention trainer path with backward,
# in float32 and bfloat16, the trainer benchmark with flex vs chunked attention on the GPU, and
# the engine on CUDA (engine vs trainer log-probs, engine vs transformers throughput in bfloat16),
# and the token evictors on CUDA (engine vs trainer log-probs under each method's evictions).
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
# the token evictors on CUDA (their state on the KV's device): each method's short batched decode
# with evictions, engine log-probs vs the trainer's one-pass forward (float32 gated at 5e-5, the
# unevicted replay must differ by >= 0.1; bfloat16 must run and evict); random must replay given its
# seed. The same check runs on CPU: python - OUT.json cpu < (this heredoc)
$py - "$out/verify_evictors_cuda.json" cuda > "$out/verify_evictors_cuda.txt" 2>&1 <<'EOF'
import json
import sys

import torch

from compactrl.bench.evictors import METHODS
from compactrl.engine import Engine, EngineConfig, SamplingParams
from compactrl.models.tiny import init_random, tiny_config
from compactrl.rl.forward import full_context, stream_logprobs

path, device = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)


def decode(model, ev, n=4):
    eng = Engine(model, None, EngineConfig(kv_pool_tokens=4096, max_step_tokens=64))
    sessions = [eng.session(f"{ev.name}-{i}") for i in range(n)]
    for i, s in enumerate(sessions):
        s.append([(11 * i + 7 * j) % 290 + 2 for j in range(48)], role="system")
        s.use_evictor(ev, head=3)
        s.generate(SamplingParams(max_tokens=48, seed=i, ignore_eos=True, model_logprobs=True))
    eng.run()
    return sessions


rows, ok = {}, True
for dtype in (torch.float32, torch.bfloat16):
    cfg = tiny_config("qwen3", vocab_size=300, eos_token_id=[1])
    model = init_random(cfg, seed=0).to(device=device, dtype=dtype).eval()
    for name, cls in METHODS.items():
        ev = cls(budget=32, window=6, interval=8, protect_turn=False)
        sessions = decode(model, ev)
        traces = [s.trace() for s in sessions]
        diff = neg = 0.0
        with torch.no_grad():
            replayed = stream_logprobs(model, traces)
            unevicted = stream_logprobs(model, [full_context(t) for t in traces])
        for s, t, lp, un in zip(sessions, traces, replayed, unevicted, strict=True):
            m = torch.as_tensor(t.trainable)
            logged = torch.tensor(s.model_logprobs, dtype=torch.float64)[m]
            diff = max(diff, float((lp.double().cpu()[m] - logged).abs().max()))
            neg = max(neg, float((un.double().cpu()[m] - logged).abs().max()))
        evicted = sum(s.metrics.evicted_tokens for s in sessions)
        good = evicted > 0 and (dtype != torch.float32 or (diff <= 5e-5 and neg >= 0.1))
        if name == "random":  # seeded: the same streams evict the same tokens
            good &= [s.evict_at for s in decode(model, ev)] == [s.evict_at for s in sessions]
        row = {"evicted_tokens": evicted, "max_abs_logprob_diff": diff, "unevicted_diff": neg, "ok": good}
        rows[f"{name} {str(dtype).removeprefix('torch.')}"] = row
        print(name, dtype, row, flush=True)
        ok &= good
with open(path, "w") as f:
    json.dump({"device": device, "rows": rows, "ok": ok}, f, indent=2)
sys.exit(0 if ok else 1)
EOF
echo "verify evictors rc=$?"
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
