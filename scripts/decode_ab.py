"""Decode speed of this checkout against an earlier commit, side by side in one run.

  python scripts/decode_ab.py --before 8a6b94b [--size small] [--rounds 5] [--threads 1]

Both trees decode the same batch (8 sessions, 128-token prompts, 64 new tokens, no evictor) in
subprocesses that take turns, ``--rounds`` times each; the JSON reports each tree's median decode
tokens/s and their ratio. Used to check that sessions without a token evictor decode as fast as
before the evictor hooks existed (the commit before them: 8a6b94b).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = """
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
from compactrl.engine import Engine, EngineConfig, SamplingParams
from compactrl.models.tiny import init_random, tiny_config
lm = init_random(tiny_config("qwen3", vocab_size=300, size=sys.argv[1], eos_token_id=[1]), seed=0).eval()
eng = Engine(lm, None, EngineConfig())
ss = [eng.session() for _ in range(8)]
for k, s in enumerate(ss):
    s.append([(k + i) % 290 + 2 for i in range(128)])
eng.run()
gens = [s.generate(SamplingParams(max_tokens=64, seed=k, ignore_eos=True)) for k, s in enumerate(ss)]
t = time.perf_counter()
eng.run()
print(json.dumps(8 * 64 / (time.perf_counter() - t)))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="git revision to compare with")
    p.add_argument("--size", default="small", help="generated model size: tiny | small | base")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(before), a.before],
                       check=True)  # fmt: skip
        try:
            rates: dict[str, list[float]] = {"before": [], "now": []}
            for r in range(a.rounds):
                order = [("before", before), ("now", ROOT)]
                for name, tree in order if r % 2 == 0 else order[::-1]:
                    env = {**os.environ, "PYTHONPATH": str(tree)}
                    out = subprocess.run([sys.executable, "-c", JOB, a.size, str(a.threads)], env=env,
                                         capture_output=True, text=True, check=True)  # fmt: skip
                    rates[name].append(json.loads(out.stdout))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(json.dumps({
        "before": a.before, "size": a.size, "threads": a.threads, "cores": os.cpu_count(), "rounds": a.rounds,
        "decode_tokens_per_s": med, "runs": rates, "ratio_now_vs_before": med["now"] / med["before"],
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
