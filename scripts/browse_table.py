"""The browse env's memory table: the base policy on held-out questions under full context and each
cursor rule, in stream and reprefill mode, one `compactrl rollout` run per row.

  python scripts/browse_table.py [--config configs/rollout/browse.toml] [--set KEY=VALUE ...]

Each row is configs/rollout/browse.toml with the row's overrides, written to runs/browse/<row>; a
row whose run folder holds a summary.json of the same config is read back, not run again, so a
killed table resumes. Rows -> docs/browse_rules.json; the markdown table is printed.
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

from compactrl.agent.batch import RolloutConfig, rollout
from compactrl.config import load_config

RULES = {
    "full": ["strategy.name=none"],
    "keep_last_cursors_2": ["strategy.name=keep_last_cursors", "strategy.n=2"],
    "keep_last_cursors_1": ["strategy.name=keep_last_cursors", "strategy.n=1"],
    "drop_opened_search": ["strategy.name=drop_opened_search"],
    "drop_unreferenced_2": ["strategy.name=drop_unreferenced", "strategy.m=2"],
}


def rows(base: Path, extra: list[str]):
    for rule, sets in RULES.items():
        for mode in ("full",) if rule == "full" else ("stream", "reprefill"):
            name = rule if rule == "full" else f"{rule}-{mode}"
            cfg = load_config(RolloutConfig, base, [*extra, *sets, f"mode={mode}"])
            yield name, rule, cfg.model_copy(update={"out": str(Path(cfg.out) / name)})


def run(cfg: RolloutConfig) -> tuple[dict, list[dict]]:
    out = Path(cfg.out)
    done = out / "summary.json"
    if not (done.exists() and json.loads((out / "config.json").read_text()) == cfg.model_dump(mode="json")):
        print(f"running {out}", flush=True)
        rollout(cfg)
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    return json.loads(done.read_text()), episodes


def by_hops(episodes: list[dict]) -> dict[str, float]:
    correct = defaultdict(list)
    for e in episodes:
        correct[str(e["info"]["hops"])].append(bool(e["info"].get("correct")))
    return {h: sum(v) / len(v) for h, v in sorted(correct.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=Path("configs/rollout/browse.toml"))
    ap.add_argument("--set", dest="sets", action="append", default=[], help="override for every row")
    ap.add_argument("--results", type=Path, default=Path("docs/browse_rules.json"))
    args = ap.parse_args()
    table = []
    for name, rule, cfg in rows(args.config, args.sets):
        s, episodes = run(cfg)
        n = s["episodes"]
        table.append({
            "row": name, "rule": rule, "mode": cfg.mode, "episodes": n, "accuracy": s["accuracy"],
            "accuracy_by_hops": by_hops(episodes), "mean_peak_live_kv": s["mean_peak_live_kv"],
            "peak_live_kv": s["peak_live_kv"], "kv_reads_per_episode": s["kv_reads"] / n,
            "reprefilled_tokens_per_episode": s["reprefilled_tokens"] / n, "mean_turns": s["mean_turns"],
            "malformed_calls_per_episode": sum(e["info"].get("malformed_calls", 0) for e in episodes) / n,
            "non_completion": s["non_completion"], "wall_s": s["wall_s"], "threads": cfg.threads,
            "model": cfg.model.path,
        })  # fmt: skip
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(table, indent=1) + "\n")
    full = table[0]
    print("| rule | mode | accuracy | peak live KV | KV reads / episode | re-prefilled / episode "
          "| turn limit | unparsable | position limit |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        nc = r["non_completion"]
        peak, reads = r["mean_peak_live_kv"], r["kv_reads_per_episode"]
        cells = [
            r["rule"], r["mode"], f"{r['accuracy']:.2f}",
            f"{peak:.0f} ({peak / full['mean_peak_live_kv']:.2f}x)",
            f"{reads:.0f} ({reads / full['kv_reads_per_episode']:.2f}x)",
            f"{r['reprefilled_tokens_per_episode']:.0f}",
            *(f"{nc[c]:.2f}" for c in ("turn_limit", "unparsable", "position_limit")),
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print(f"\n{full['episodes']} held-out questions per row; rows in {args.results}")


if __name__ == "__main__":
    main()
