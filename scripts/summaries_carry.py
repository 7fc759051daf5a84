"""What the policy's summaries carry, counted from an evaluation's kept traces (`study` evals with
``traces = true``, or `compactrl eval --traces`), for the rooms task under summary compaction.

  python scripts/summaries_carry.py runs/summary/RUN/eval/CHECKPOINT-greedy-study-final.json [--show 4]

Per compaction (1st, 2nd, ...): the share of episodes whose summary holds the asked-for room's code
word (the eval's ``info.answer``), next to the success rate; ``--show N`` prints N episodes'
summaries and answers. A re-prefill episode's segments are one trace each: its summaries are read
from every segment, in order.
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

from tokenizers import Tokenizer


def summaries(trace: dict, tok: Tokenizer) -> list[str]:
    """The summaries this trace's policy wrote (sampled summary tokens; a re-prefill segment also
    holds, unsampled, the summaries kept from segments before it), in stream order."""
    by_turn = defaultdict(list)
    for t, role, turn, sampled in zip(
        trace["tokens"], trace["role"], trace["turn"], trace["trainable"], strict=True
    ):
        if role == "summary" and sampled:
            by_turn[turn].append(t)
    return [tok.decode(ids).strip() for _, ids in sorted(by_turn.items())]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("eval_json", type=Path)
    p.add_argument("--show", type=int, default=0)
    a = p.parse_args()
    ev = json.loads(a.eval_json.read_text())
    model = Path(ev["checkpoint"]) / "model"
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    per_seed: dict[int, list[str]] = defaultdict(list)
    for line in a.eval_json.with_suffix(".traces.jsonl").read_text().splitlines():
        trace = json.loads(line)
        per_seed[trace["meta"]["seed"]] += summaries(trace, tok)  # segments come in order
    episodes = ev["episode_metrics"]
    n = max(len(per_seed[e["seed"]]) for e in episodes)

    def holds(e, i):
        return i < len(per_seed[e["seed"]]) and e["info"]["answer"] in per_seed[e["seed"]][i]

    carry = [sum(holds(e, i) for e in episodes) / len(episodes) for i in range(n)]
    print(json.dumps({"eval": str(a.eval_json), "episodes": len(episodes), "success": ev["success_rate"],
                      "summary_holds_answer": carry}))  # fmt: skip
    for e in episodes[: a.show]:
        print(f"  {e['info']['answer']!r}: summaries {per_seed[e['seed']]} -> said {e['info']['said']!r}")


if __name__ == "__main__":
    main()
