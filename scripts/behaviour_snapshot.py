"""Record what a refactor must not change, or compare two records: the quickstart's per-step
rewards, tokens, loss and gradient norm; `verify engine`'s and `verify trainer`'s max log-prob
differences; `bench modes`' token counts (prefilled, re-prefilled, compactions, KV reads) for every
strategy and mode. Everything runs in the tree this script sits in, float32, 1 thread, fixed seeds.

    python scripts/behaviour_snapshot.py record before.json     # on the old tree (~2 min)
    python scripts/behaviour_snapshot.py record after.json      # on the new tree
    python scripts/behaviour_snapshot.py compare before.json after.json   # exit 1 on any change
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_FIELDS = ("reward", "reward_max", "tokens", "compactions", "trained_tokens", "loss", "grad_norm")
COUNTS = ("turns", "compactions", "generated_tokens", "prefilled_tokens", "reprefilled_tokens",
          "peak_live_kv", "kv_reads", "preemptions")  # fmt: skip
EXACT = ("reward", "reward_max", "tokens", "compactions", "trained_tokens", *COUNTS)


def cli(*args: str) -> str:
    """Run ``python -m compactrl.cli ARGS`` from this tree (its own package first on the path)."""
    cmd = [sys.executable, "-m", "compactrl.cli", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"compactrl {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def record(path: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cli("train", "configs/quickstart.toml", "--set", f"out={tmp}/quickstart", "--set", "threads=1")
        steps = [json.loads(line) for line in open(f"{tmp}/quickstart/metrics.jsonl")]
        steps = [{k: s[k] for k in ("step", *STEP_FIELDS)} for s in steps if s.get("phase") == "rl"]
        modes_json = f"{tmp}/modes.json"
        cli("bench", "modes", "--repeats", "1", "--episodes", "4", "--rooms", "20", "--sweep", "2",
            "--out", modes_json, "--json")  # fmt: skip
        modes = json.load(open(modes_json))
    counts = {
        f"{s['strategy']}/{mode}": {k: s[mode][k] for k in COUNTS}
        for s in modes["strategies"]
        for mode in ("full", "reprefill", "stream")
    }
    engine = json.loads(cli("verify", "engine", "--json"))
    trainer = json.loads(cli("verify", "trainer", "--json"))
    snap = {
        "quickstart_steps": steps,
        "verify_engine_max_abs_logprob_diff": engine["max_abs_logprob_diff"],
        "verify_trainer_max_abs_logprob_diff": trainer["max_abs_logprob_diff"],
        "bench_modes_counts": counts,
    }
    path.write_text(json.dumps(snap, indent=1) + "\n")
    print(f"wrote {path}")


def _leaves(x, prefix=""):
    """(path, value) of every number in a nested dict/list."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{prefix}/{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{prefix}[{i}]")
    else:
        yield prefix, x


def compare(a_path: Path, b_path: Path) -> int:
    """Counts and rewards must be equal; other floats equal to 1e-6 relative (float32 summation order)."""
    a, b = (dict(_leaves(json.load(open(p)))) for p in (a_path, b_path))
    if a.keys() != b.keys():
        only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
        print(f"different fields: only before {only_a}, only after {only_b}")
        return 1
    bad = []
    for k in a:
        x, y = a[k], b[k]
        exact = k.rsplit("/", 1)[-1] in EXACT
        if x != y and (exact or abs(x - y) > 1e-6 * max(abs(x), abs(y), 1e-12)):
            bad.append(f"{k}: {x} -> {y}")
    print(f"{len(a)} values compared, {len(bad)} differ")
    print("\n".join(bad[:40]))
    return 1 if bad else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("record").add_argument("out", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = p.parse_args()
    if args.cmd == "record":
        record(args.out)
    else:
        sys.exit(compare(args.before, args.after))
