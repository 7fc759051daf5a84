"""Prefill and decode speed of this checkout against an earlier commit, side by side in one run.

  python scripts/decode_ab.py --before 8a6b94b [--size small | --model runs/smollm2] [--batch 8]
                              [--context 128] [--new-tokens 64] [--rounds 5] [--threads 1]
                              [--dtype float32] [--workload plain | sessions]

Both trees prefill and decode the same batch (``--batch`` sessions of ``--context`` random prompt
tokens, ``--new-tokens`` each, no evictor) in subprocesses that take turns, ``--rounds`` times
each; the JSON reports each tree's median tokens/s and their ratios. ``--workload sessions`` adds
what agents' sessions do: a fork of every other session, a token evictor on each (H2O and SnapKV
in turn, keeping half the prompt) and a pool too small for all of them, so sessions are preempted
and re-prefilled; each round records the preemptions and evictions, equal for equal work. Used
to check that sessions without a token evictor decode as fast as before the evictor hooks
existed (8a6b94b), and to measure each engine change alone (e.g. the oneDNN GEMMs: ``--before
65bead3 --model runs/smollm2``).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = """
import json, sys, time, torch
size, threads, batch, context, new = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6])
dtype = sys.argv[6]
torch.set_num_threads(threads)
from compactrl.engine import Engine, EngineConfig, SamplingParams
if size.startswith("model="):
    from compactrl.models.loading import load_model
    lm = load_model(size[len("model="):], dtype=dtype)
else:
    from compactrl.models.tiny import init_random, tiny_config
    lm = init_random(tiny_config("qwen3", vocab_size=300, size=size, eos_token_id=[1]), seed=0).eval()
    lm = lm.to(getattr(torch, dtype))
vocab = lm.config.vocab_size
sessions = sys.argv[7] == "sessions"
# sessions: every other session forked (1.5 x batch), a pool of budget + new tokens each, which
# the prompts the forks share while their evictors cut them down overrun: the scheduler preempts
pool = (3 * batch * (context // 2 + new)) // 2 if sessions else batch * (context + new + 8)
eng = Engine(lm, None, EngineConfig(kv_pool_tokens=pool, max_step_tokens=max(2048, context)))
ss = [eng.session() for _ in range(batch)]
t = time.perf_counter()
for k, s in enumerate(ss):
    s.append([(7 * k + 13 * i) % (vocab - 10) + 5 for i in range(context)])
eng.run()
prefill = batch * context / (time.perf_counter() - t)
if sessions:  # token evictors (SnapKV and H2O in turn) keeping half the prompt, and forks
    from compactrl.compaction.evictors import H2O, SnapKV
    ss += [s.fork() for s in ss[::2]]
    for k, s in enumerate(ss):
        s.use_evictor((SnapKV if k % 2 else H2O)(budget=context // 2, window=8, interval=16))
gens = [s.generate(SamplingParams(max_tokens=new, seed=k, ignore_eos=True)) for k, s in enumerate(ss)]
t = time.perf_counter()
eng.run()
m = eng.metrics()
print(json.dumps([prefill, len(ss) * new / (time.perf_counter() - t),
                  {k: m[k] for k in ("preemptions", "reprefilled_tokens", "evictions", "evicted_tokens")}]))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="git revision to compare with")
    p.add_argument("--size", default="small", help="generated model size: tiny | small | base")
    p.add_argument("--model", default=None, help="a model folder instead (e.g. runs/smollm2)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--workload", default="plain", choices=["plain", "sessions"],
                   help="sessions: token evictors, forks and a pool that forces preemption")  # fmt: skip
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(before), a.before],
                       check=True)  # fmt: skip
        try:
            rates: dict[str, list[list[float]]] = {"before": [], "now": []}
            model = f"model={Path(a.model).resolve()}" if a.model else a.size
            args = [model, str(a.threads), str(a.batch), str(a.context), str(a.new_tokens)]
            args += [a.dtype, a.workload]
            for r in range(a.rounds):
                order = [("before", before), ("now", ROOT)]
                for name, tree in order if r % 2 == 0 else order[::-1]:
                    env = {**os.environ, "PYTHONPATH": str(tree)}  # and cwd: python -c puts it first
                    out = subprocess.run([sys.executable, "-c", JOB, *args], env=env, cwd=tree,
                                         capture_output=True, text=True, check=True)  # fmt: skip
                    rates[name].append(json.loads(out.stdout))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=True)
    pre, dec = ({k: statistics.median(r[i] for r in v) for k, v in rates.items()} for i in (0, 1))
    print(json.dumps({
        "before": a.before, "model": a.model or a.size, "dtype": a.dtype, "workload": a.workload,
        "batch": a.batch, "context": a.context, "new_tokens": a.new_tokens, "threads": a.threads,
        "cores": os.cpu_count(), "rounds": a.rounds,
        "cpu": platform.processor() or platform.machine(),
        "prefill_tokens_per_s": pre, "decode_tokens_per_s": dec,
        "decode_now_vs_before": dec["now"] / dec["before"],
        "prefill_now_vs_before": pre["now"] / pre["before"],
        "runs": rates,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
