#!/usr/bin/env bash
# The four-hop SideQuest study from nothing, one stage after another (each skipped when its
# checkpoint is there; a stage cut off resumes from its newest checkpoint): the SmolLM2 import,
# the two-hop browse policy, the 2-4 hop policy, the keep_calls call thread adapter (and one
# trained with keep_titles), the bench rows that decide the issue's bar and their replicate, and
# last RL of the policy under the thread (per-prompt group baselines, rl_main_hops4_group.toml;
# the earlier leave-one-out run is rl_main_hops4.toml). On a 2-core CPU: about 30 + 35 + 15 + 15
# minutes of training, 5-20 minutes a bench row, then about 4 minutes an RL step (12 steps).
# Thread counts are the ones docs/study_sidequest.md's numbers were measured with. The build depends on the
# CPU: the AMD EPYC build of its earlier rows gave the 2-4 hop policy's full row as 0.34
# at 671, the Intel Xeon builds 0.35 at 685 (see docs/study_sidequest.md).
# Usage: bash scripts/sidequest_hops4.sh [BENCH_ROW ...]   (default: the rows that decide the bar:
# full context, SideQuest every 2nd action, SnapKV, keep_last_cursors; then the replicate)
set -euo pipefail
cd "$(dirname "$0")/.."
hops4=runs/browse/sft_smollm2_hops4/checkpoints/step_00000080/model
thread=runs/sidequest/thread_hops4_call_keep_calls
stage() {  # stage DONE_PATH RUN_DIR CMD...: run CMD (resuming RUN_DIR if it has begun) unless DONE_PATH exists
  local done=$1 dir=$2; shift 2
  [ -e "$done" ] && return
  if [ -d "$dir/checkpoints" ]; then "$@" --resume; else "$@"; fi
}
[ -f runs/smollm2/config.json ] || compactrl import-gguf --smollm2 runs/smollm2
stage runs/browse/sft_smollm2/checkpoints/step_00000160 runs/browse/sft_smollm2 \
  compactrl train configs/browse/sft_smollm2.toml
stage "$hops4" runs/browse/sft_smollm2_hops4 compactrl train configs/browse/sft_smollm2_hops4.toml
stage "$thread/checkpoints/step_00000012" "$thread" compactrl train configs/sidequest/train_thread.toml \
  --set model.path="$hops4" --set env.max_hops=4 --set strategy.at=call --set strategy.keep_unread=true \
  --set strategy.keep_calls=true --set out="$thread" --set threads=1
stage "${thread}_titles/checkpoints/step_00000012" "${thread}_titles" compactrl train configs/sidequest/train_thread.toml \
  --set model.path="$hops4" --set env.max_hops=4 --set strategy.at=call --set strategy.keep_unread=true \
  --set strategy.keep_calls=true --set strategy.keep_titles=true --set out="${thread}_titles" --set threads=1
rows=("$@")
[ ${#rows[@]} -gt 0 ] || rows=(hops4-policy-full hops4-thread4call-sequential-every2 hops4-snapkv-310
                               hops4-snapkv-at-every2-peak hops4-keep-last-cursors-2
                               hops4-thread4call-keep-calls-sequential-every2)
for row in "${rows[@]}"; do
  compactrl bench memory configs/bench/sidequest_hops4.toml --only "$row" --set threads=1
done
[ $# -gt 0 ] || compactrl bench memory configs/bench/sidequest_hops4_replicate.toml --set threads=1
# the RL run under the thread (its rows: rl-group-*), last: the rows above do not need it
stage runs/sidequest/rl_main_hops4_group/checkpoints/step_00000012 runs/sidequest/rl_main_hops4_group \
  compactrl train configs/sidequest/rl_main_hops4_group.toml
