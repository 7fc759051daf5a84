"""The browse env written as an OpenAI-client agent (examples/browse_agent.py: its harness keeps the
newest 2 tool outputs) against the built-in browse env under keep_last_cursors (n = 2), on the SFT'd
SmolLM2 browse policy, greedy, the same held-out questions: are the traces the same, token for token,
evictions included? Writes docs/agent_equivalence.json.

    python scripts/agent_equivalence.py [--episodes 16] [--model MODEL_DIR]
"""

import argparse
import json
import platform
import shutil
from pathlib import Path

import numpy as np
import torch

from compactrl.agent.batch import RolloutConfig, rollout
from compactrl.config import load_config
from compactrl.trace import load_traces

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--episodes", type=int, default=16)
p.add_argument("--model", default="runs/browse/sft_smollm2/checkpoints/step_00000160/model")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--out", default="docs/agent_equivalence.json")
args = p.parse_args()
common = [
    f"model.path={args.model}",
    f"episodes={args.episodes}",
    f"concurrency={args.episodes}",
    f"threads={args.threads}",
    "seed=1000000000",
    "rollout.max_turns=16",
    "rollout.temperature=0",
]
rows = {
    "built-in env, keep_last_cursors n=2": ["mode=stream", "strategy.name=keep_last_cursors", "strategy.n=2"],
    "agent (examples/browse_agent.py)": [
        "mode=full",
        "strategy.name=none",
        "env=",
        "env.name=agent",
        "env.agent=examples/browse_agent.py:solve",
        "env.tasks=examples/browse_agent.py:task",
    ],
}
runs = {}
for name, sets in rows.items():
    out = Path("/tmp/agent_equivalence") / name.split()[0]
    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(RolloutConfig, "configs/rollout/browse.toml", [*common, *sets, f"out={out}"])
    summary = rollout(cfg)
    episodes = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    runs[name] = summary, load_traces(out / "traces.jsonl"), episodes
(a_sum, a, a_rows), (b_sum, b, b_rows) = runs.values()
same = [x.tokens.tolist() == y.tokens.tolist() for x, y in zip(a, b, strict=True)]
evict = [s and x.evict_at.tolist() == y.evict_at.tolist() for s, x, y in zip(same, a, b, strict=True)]
lp = [
    float(np.abs(x.logprobs[x.trainable] - y.logprobs[y.trainable]).max()) for s, x, y in zip(same, a, b) if s
]
result = {
    "machine": {
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
    },
    "model": args.model,
    "episodes": args.episodes,
    "traces_equal": sum(same),
    "evictions_equal": sum(evict),
    "evicted_tokens": [int(x.num_evicted) for x in a],
    "max_abs_logprob_diff": max(lp, default=None),
    "rewards": {name: [r["reward"] for r in rows_] for name, (_, _, rows_) in runs.items()},
    "mean_reward": {name: s["mean_reward"] for name, (s, _, _) in runs.items()},
}
Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps({k: v for k, v in result.items() if k != "rewards"}, indent=1))
