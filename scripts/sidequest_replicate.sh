#!/usr/bin/env bash
# The SideQuest headlines, replicated: four hops (sets a, b, c: configs/bench/sidequest_replicate.toml)
# and two hops (sets 2a, 2b, 2c: configs/bench/sidequest_twohop_replicate.toml). The policies trained
# from nothing, then per question set its thread adapter (the same recipe; training seed 0, 1000 or
# 2000 for set a, b or c: other initialisations and disjoint training questions) and its rows, two
# at a time on the 2 cores (a row waits for the rows it takes a budget or a rate from).
# Each stage is skipped when its checkpoint is there (one cut off resumes); a set's rows compare
# only with its own full-context row, so sets may come from different machines (weight builds).
# On a 2-core CPU: about 30 + 20 minutes for the policies, 10 for a thread adapter, then 15-30
# minutes a row of 200 questions (8 rows a four-hop set, 6 a two-hop set).
# Usage: bash scripts/sidequest_replicate.sh [SET ...]   (default: a b c 2a 2b 2c)
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
thread2() {  # thread2 SEED: the two-hop thread adapter (configs/sidequest/train_thread.toml), this training seed
  local out=runs/sidequest/thread_hops2_s$1
  stage "$out/checkpoints/step_00000012" "$out" compactrl train configs/sidequest/train_thread.toml \
    --set seed="$1" --set out="$out" --set threads=1
}
[ -f runs/smollm2/config.json ] || compactrl import-gguf --smollm2 runs/smollm2
stage runs/browse/sft_smollm2/checkpoints/step_00000160 runs/browse/sft_smollm2 \
  compactrl train configs/browse/sft_smollm2.toml
bench() { compactrl bench memory configs/bench/sidequest_replicate.toml --set threads=1 --only "$@"; }
bench2() { compactrl bench memory configs/bench/sidequest_twohop_replicate.toml --set threads=1 --only "$@"; }
sets=("$@")
[ ${#sets[@]} -gt 0 ] || sets=(a b c 2a 2b 2c)
declare -A seed=([a]=0 [b]=1000 [c]=2000)
for s in "${sets[@]}"; do
  case $s in
    [abc])
      stage "$hops4" runs/browse/sft_smollm2_hops4 compactrl train configs/browse/sft_smollm2_hops4.toml --set threads=2
      bench "$s-full" & thread "${seed[$s]}" & wait
      bench "$s-sidequest-every2" & bench "$s-keep-last-cursors-2" & wait
      bench "$s-random-cursors" & bench "$s-snapkv-at-peak" & wait
      bench "$s-random-at-peak" & bench "$s-snapkv-matched" & wait
      bench "$s-random-matched" ;;
    2[abc])
      t=${s#2}
      bench2 "$t-full" & thread2 "${seed[$t]}" & wait
      bench2 "$t-thread-sequential" & bench2 "$t-thread-parallel" & wait
      bench2 "$t-random-cursors" & bench2 "$t-snapkv-at-peak" & wait
      bench2 "$t-random-at-peak" ;;
    *) echo "unknown set $s: give a, b, c (four hops) or 2a, 2b, 2c (two hops)" >&2; exit 2 ;;
  esac
done
