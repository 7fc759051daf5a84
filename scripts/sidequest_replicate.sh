#!/usr/bin/env bash
# The four-hop SideQuest headline, replicated (configs/bench/sidequest_replicate.toml): the policies
# and three thread adapters (training seeds 0, 1000, 2000: other initialisations and disjoint
# training questions) trained from nothing, each stage skipped when its checkpoint is there (one cut
# off resumes), then each question set's rows, two at a time on the 2 cores (a row waits for the
# rows it takes a budget or a rate from).
# On a 2-core CPU: about 40 + 35 minutes for the policies, 15 for two thread adapters at once,
# then 10-30 minutes a row of 200 questions.
# Usage: bash scripts/sidequest_replicate.sh [SET ...]   (default: a b c)
set -euo pipefail
cd "$(dirname "$0")/.."
hops4=runs/browse/sft_smollm2_hops4/checkpoints/step_00000080/model
stage() {  # stage DONE_PATH RUN_DIR CMD...: run CMD (resuming RUN_DIR if it has begun) unless DONE_PATH exists
  local done=$1 dir=$2; shift 2
  [ -e "$done" ] && return
  if [ -d "$dir/checkpoints" ]; then "$@" --resume; else "$@"; fi
}
thread() {  # thread SEED: the keep_calls call thread adapter of the four-hop headline, this training seed
  local out=runs/sidequest/thread_hops4_call_s$1
  stage "$out/checkpoints/step_00000012" "$out" compactrl train configs/sidequest/train_thread.toml \
    --set model.path="$hops4" --set env.max_hops=4 --set strategy.at=call --set strategy.keep_unread=true \
    --set strategy.keep_calls=true --set seed="$1" --set out="$out" --set threads=1
}
[ -f runs/smollm2/config.json ] || compactrl import-gguf --smollm2 runs/smollm2
stage runs/browse/sft_smollm2/checkpoints/step_00000160 runs/browse/sft_smollm2 \
  compactrl train configs/browse/sft_smollm2.toml
stage "$hops4" runs/browse/sft_smollm2_hops4 compactrl train configs/browse/sft_smollm2_hops4.toml --set threads=2
thread 0 & thread 1000 & wait
thread 2000
bench() { compactrl bench memory configs/bench/sidequest_replicate.toml --set threads=1 --only "$@"; }
sets=("$@")
[ ${#sets[@]} -gt 0 ] || sets=(a b c)
for s in "${sets[@]}"; do
  bench "$s-full" & bench "$s-sidequest-every2" & wait
  bench "$s-keep-last-cursors-2" & bench "$s-random-cursors" & wait
  bench "$s-snapkv-at-peak" & bench "$s-random-at-peak" & wait
  bench "$s-snapkv-matched" & bench "$s-random-matched" & wait
done
