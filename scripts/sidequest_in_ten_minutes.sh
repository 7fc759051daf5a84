#!/usr/bin/env bash
# SideQuest in about ten minutes on 2 CPU cores, from a fresh clone: the smallest runs that show an
# auxiliary thread deleting tool outputs from a browsing agent's KV. SmolLM2-135M-Instruct is taught
# the browse env's tool calls (12 SFT steps instead of the full recipe's 160), a thread adapter is
# trained on the solver's traces with hindsight labels (10 steps instead of 12; LoRA on the thread's
# tokens only, the main thread stays the policy), and 8 held-out two-hop episodes run with the
# thread called after every action. The rollout's summary shows the thread's calls, the cursors it
# deleted, their precision and recall, and the peak live KV. Each stage is skipped when its output
# is there (a stage cut off resumes from its checkpoint). The full results: docs/study_sidequest.md.
# Usage: bash scripts/sidequest_in_ten_minutes.sh [OUT]      (default OUT: runs/sidequest_quick)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/sidequest_quick}
policy=$out/sft/checkpoints/step_00000012/model
adapter=$out/thread/checkpoints/step_00000010
stage() {  # stage DONE_PATH RUN_DIR CMD...: run CMD (resuming RUN_DIR if it has begun) unless DONE_PATH exists
  local done=$1 dir=$2; shift 2
  [ -e "$done" ] && return
  if [ -d "$dir/checkpoints" ]; then "$@" --resume; else "$@"; fi
}
[ -f runs/smollm2/config.json ] || compactrl import-gguf --smollm2 runs/smollm2
stage "$policy" "$out/sft" compactrl train configs/browse/sft_smollm2.toml \
  --set steps=12 --set sft_steps=12 --set checkpoint_every=12 --set out="$out/sft"
stage "$adapter" "$out/thread" compactrl train configs/sidequest/train_thread.toml \
  --set steps=10 --set checkpoint_every=10 --set model.path="$policy" --set out="$out/thread"
compactrl rollout configs/rollout/sidequest.toml --overwrite --set strategy.every=1 \
  --set model.path="$policy" --set strategy.thread_adapter="$adapter" --set out="$out/rollout"
