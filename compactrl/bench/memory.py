"""`compactrl bench memory CONFIG`: accuracy against memory, one row per way of forgetting.

A bench config names a base rollout config and its rows; each row is that config with the row's
``--set`` overrides (a cursor rule, a mode, SideQuest, a token evictor), played on the same
held-out episodes as one `compactrl rollout` run in ``out/<row>``. A row with ``budget_from``
runs its evictor at another row's realised mean peak live KV (an evictor at SideQuest's memory);
with ``overshoot_from`` its budget is lowered by what an earlier evictor row realised above its own
budget, so it realises that peak (a budget-matched comparison). A row with ``rate_from`` deletes
cursors at random as often as a SideQuest row did (``random_cursors``).
A row whose folder already holds a summary of the same config is read back, so a killed bench
resumes. Rows go to ``results`` (JSON) and accuracy against peak live KV to ``plot`` (PNG).

Each row's accuracy carries its 95% Wilson interval (``accuracy_ci``), and each row is compared,
paired on the same questions (episode seeds), to a baseline row: the bench's ``compare_to``, by
default the first row (full context in the shipped benches), or the row's own ``compare_to``. The
row gets the mean difference in accuracy (``paired_diff``, row minus baseline), its paired
bootstrap interval (``paired_diff_ci``), McNemar's exact p-value (``mcnemar_p``) and the
baseline's name (``compared_to``). Rows keep their per-question results, so rows read back from
``results`` compare without their run folders; a row from a file written before that gets None there.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from compactrl.agent.batch import RolloutConfig, rollout
from compactrl.bench.harness import markdown_table
from compactrl.config import load_config, read_toml
from compactrl.stats import align, compare, fmt_ci, mean_ci, paired_diff, verdict, wilson


class Row(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="the row's folder under `out`")
    set: list[str] = Field([], description="--set overrides of the base config")
    budget_from: str | None = Field(
        None,
        description="evictor.budget = this earlier row's mean peak live KV (rounded; the row sets no budget)",
    )
    overshoot_from: str | None = Field(
        None, description="with budget_from: subtract this earlier evictor row's overshoot (its mean peak "
        "live KV minus its budget) from the budget, so the row realises budget_from's peak, not exceeds it"
    )  # fmt: skip
    rate_from: str | None = Field(
        None, description="strategy.rate = this earlier SideQuest row's realised deletion rate (deleted / "
        "offered cursors; for a random_cursors row: deletions at random, as often)"
    )  # fmt: skip
    compare_to: str | None = Field(
        None, description="compare accuracy, paired on the same questions, to this earlier row "
        "(default: the bench's compare_to)"
    )  # fmt: skip


class MemoryBench(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    base: str = Field(description="the rollout config every row starts from")
    out: str = Field(description="the rows' run folders go under this folder")
    set: list[str] = Field(
        [], description="--set overrides every row shares (then the CLI's, then the row's own)"
    )
    results: str = Field(description="JSON file of the rows")
    plot: str | None = Field(None, description="PNG of accuracy against mean peak live KV")
    compare_to: str | None = Field(
        None, description="the row every other row is compared to, paired on the same questions "
        "(default: the first row, full context)"
    )  # fmt: skip
    row: list[Row] = Field(min_length=1, description="the rows, in order ([[row]] tables)")
    pool_sets: bool = Field(
        False, description="rows are named '<set>-<variant>', each set on its own questions and compared "
        "to its set's baseline: also report each variant's paired difference pooled over every set"
    )  # fmt: skip
    contrasts: list[tuple[str, str]] = Field(
        [], description="pairs [A, B] also compared paired (A minus B), beside each row against its "
        "baseline: row names, or with pool_sets variant names, pooled over the sets that hold both"
    )  # fmt: skip

    @model_validator(mode="after")
    def _rows(self):
        seen: set[str] = set()
        for r in self.row:
            if r.name in seen:
                raise ValueError(f"row {r.name!r} appears twice; give each row its own name")
            if r.overshoot_from is not None and r.budget_from is None:
                raise ValueError(f"row {r.name!r}: overshoot_from corrects budget_from's budget; set both")
            for field in ("budget_from", "overshoot_from", "rate_from", "compare_to"):
                if getattr(r, field) is not None and getattr(r, field) not in seen:
                    raise ValueError(f"row {r.name!r}: {field} {getattr(r, field)!r} is not an earlier row")
            seen.add(r.name)
        if self.compare_to is not None and self.compare_to not in seen:
            raise ValueError(f"compare_to {self.compare_to!r} is not a row; rows: {sorted(seen)}")
        names = {n.split("-", 1)[-1] for n in seen} if self.pool_sets else seen
        for pair in self.contrasts:
            if unknown := [n for n in pair if n not in names]:
                raise ValueError(
                    f"contrasts {list(pair)}: {unknown} is not a "
                    f"{'variant' if self.pool_sets else 'row'}; they are {sorted(names)}"
                )
        return self

    def baseline(self, row: Row) -> str | None:
        """The row ``row`` is compared to (None: the baseline itself): its own ``compare_to``, the
        bench's, else the first row (with ``pool_sets``, the first row of its own set)."""
        first = self.row[0].name
        if self.pool_sets:
            first = next(r.name for r in self.row if r.name.split("-", 1)[0] == row.name.split("-", 1)[0])
        name = row.compare_to or self.compare_to or first
        return None if name == row.name else name


def load_bench(path: str | Path) -> MemoryBench:
    return MemoryBench.model_validate(read_toml(Path(path)))


def _same_config(path: Path, cfg: RolloutConfig) -> bool:
    """The folder's config, read as today's model (a field added since takes its default), is ``cfg``."""
    try:
        return path.exists() and RolloutConfig.model_validate_json(path.read_text()) == cfg
    except ValidationError:  # written by a version whose fields differ: not the same run
        return False


def _run(cfg: RolloutConfig, progress=None) -> tuple[dict, list[dict]]:
    out = Path(cfg.out)
    done = out / "summary.json"
    if not (done.exists() and _same_config(out / "config.json", cfg)):
        rollout(cfg, progress, overwrite=True)  # a row measured under another config is replaced
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    return json.loads(done.read_text()), episodes


def _per_question(row: dict) -> dict[int, float] | None:
    """Episode seed -> 1.0 if answered correctly (what a paired comparison matches on); None for a
    row written before rows kept them."""
    seeds = row.get("episode_seeds")
    return None if seeds is None else dict(zip(seeds, map(float, row["episode_correct"]), strict=True))


def _seeds(cfg: RolloutConfig) -> dict[int, float]:
    return dict.fromkeys(range(cfg.seed, cfg.seed + cfg.episodes), 0.0)


def _kept_seeds(bench: MemoryBench, name: str | None) -> dict[int, float] | None:
    """A finished row's episode seeds, from ``results`` (None if it is not there)."""
    path = Path(bench.results)
    if name is None or not path.exists():
        return None
    row = next((r for r in json.loads(path.read_text()) if r["row"] == name), None)
    return None if row is None else _per_question(row)


def _row(name: str, cfg: RolloutConfig, s: dict, episodes: list[dict]) -> dict:
    n = s["episodes"]
    # the main thread and its auxiliary threads together (None: a row with threads run before they
    # were counted); without threads an episode holds and reads its main thread only
    peak_all, aux_reads = s.get("mean_peak_kv_with_threads"), s.get("aux_kv_reads")
    if not s.get("aux_calls"):
        peak_all, aux_reads = s["mean_peak_live_kv"], 0
    by_hops = defaultdict(list)
    for e in episodes:
        by_hops[str(e["info"].get("hops"))].append(bool(e["info"].get("correct")))
    row = {
        "row": name, "strategy": cfg.strategy.name, "mode": cfg.mode,
        "evictor": cfg.evictor.name if cfg.evictor else None,
        "budget": cfg.evictor.budget if cfg.evictor else None, "episodes": n, "accuracy": s["accuracy"],
        "accuracy_ci": mean_ci([int(bool(e["info"].get("correct"))) for e in episodes]),
        # per question (episode seed), what a paired comparison matches on, kept with the row
        "episode_seeds": [e["seed"] for e in episodes],
        "episode_correct": [int(bool(e["info"].get("correct"))) for e in episodes],
        "accuracy_by_hops": {h: sum(v) / len(v) for h, v in sorted(by_hops.items())},
        "mean_peak_live_kv": s["mean_peak_live_kv"], "peak_live_kv": s["peak_live_kv"],
        "kv_reads_per_episode": s["kv_reads"] / n,
        "mean_peak_kv_with_threads": peak_all,
        "kv_reads_with_threads_per_episode": None if aux_reads is None else (s["kv_reads"] + aux_reads) / n,
        "reprefilled_tokens_per_episode": s["reprefilled_tokens"] / n,
        "mean_turns": s["mean_turns"], "non_completion": s["non_completion"],
        "malformed_calls_per_episode": sum(e["info"].get("malformed_calls", 0) for e in episodes) / n,
        "wall_s": s["wall_s"], "episodes_per_s": s["episodes_per_s"], "concurrency": cfg.concurrency,
        "peak_pool_kv_tokens": s["peak_pool_kv_tokens"], "preemptions": s["preemptions"],
        "threads": cfg.threads, "model": cfg.model.path, "demo": cfg.demo,
        "provenance": s.get("provenance"),  # None: a row run before it was recorded
    }  # fmt: skip
    if s.get("aux_calls"):
        keys = ("aux_calls", "deleted_cursors", "aux_offered_cursors", "aux_parse_failures",
                "aux_no_room", "aux_unknown_cursors", "aux_unseen_cursors", "aux_unfinished", "aux_tokens",
                "aux_kept_unread", "deletion_precision", "deletion_recall")  # fmt: skip
        row |= {k: s.get(k) for k in keys}  # None: a row run before the counter existed
    return row


def run_memory_bench(bench: MemoryBench, sets: list[str] = (), only: list[str] | None = None,
                     progress=None) -> list[dict]:  # fmt: skip
    """Run (or read back) every row; ``only`` runs just those rows (and the rows they take a
    budget from), keeping the other rows in ``results`` as they are when this run ends."""
    wanted = set(only or [r.name for r in bench.row])
    for r in reversed(bench.row):
        if r.name in wanted:
            wanted |= {r.budget_from, r.overshoot_from, r.rate_from} - {None}
    unknown = set(only or []) - {r.name for r in bench.row}
    if unknown:
        raise ValueError(f"--only {sorted(unknown)}: no such row; rows: {[r.name for r in bench.row]}")
    rows: dict[str, dict] = {}
    cfgs: dict[str, RolloutConfig] = {}
    for r in (r for r in bench.row if r.name in wanted):
        extra = [*bench.set, *sets, *r.set, f"out={Path(bench.out) / r.name}"]
        if r.budget_from:
            budget = rows[r.budget_from]["mean_peak_live_kv"]
            if r.overshoot_from:
                over = rows[r.overshoot_from]
                budget -= over["mean_peak_live_kv"] - over["budget"]
            extra.append(f"evictor.budget={max(1, round(budget))}")
        if r.rate_from:
            extra.append(f"strategy.rate={deletion_rate(rows[r.rate_from])}")
        cfg = cfgs[r.name] = load_config(RolloutConfig, Path(bench.base), extra)
        base = bench.baseline(r)  # other questions than its baseline's: refused before running
        if base in cfgs:
            align(_seeds(cfg), _seeds(cfgs[base]), r.name, base)
        elif (seeds := _kept_seeds(bench, base)) is not None:
            align(_seeds(cfg), seeds, r.name, base)
        rows[r.name] = _row(r.name, cfg, *_run(cfg, progress))
    results = Path(bench.results)  # read now, not at the start: a parallel --only run may have written
    kept = {r["row"]: r for r in json.loads(results.read_text())} if results.exists() and only else {}
    table = [rows.get(r.name) or kept[r.name] for r in bench.row if r.name in rows or r.name in kept]
    _compare(bench, table)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(table, indent=1) + "\n")
    if bench.plot:
        plot_memory(table, Path(bench.plot))
    return table


def _compare(bench: MemoryBench, table: list[dict]) -> None:
    """Each row's interval and paired comparison to its baseline, in place, from the per-question
    results the rows keep (no comparison for a row from before they were kept)."""
    by_name = {r["row"]: r for r in table}
    for spec in bench.row:
        row, base = by_name.get(spec.name), bench.baseline(spec)
        if row is None:
            continue
        if row.get("accuracy_ci") is None:  # a row from before intervals: Wilson needs only k and n
            row["accuracy_ci"] = wilson(round(row["accuracy"] * row["episodes"]), row["episodes"])
        row |= dict.fromkeys(("compared_to", "paired_diff", "paired_diff_ci", "mcnemar_p"))
        if base in by_name and (a := _per_question(row)) and (b := _per_question(by_name[base])):
            row |= compare(a, b, spec.name, base)


def _pool(variant: str, baseline: str, pairs: list[tuple[dict, dict]], sets: list[str]) -> dict:
    """Rows against rows, a pair per set on its own questions: the paired difference over every
    set's questions (paired within each set), with each set's difference beside."""
    mine: dict[int, float] = {}
    base: dict[int, float] = {}
    per_set = []
    for r, b in pairs:
        pr, pb = _per_question(r), _per_question(b)
        x, y = align(pr, pb, r["row"], b["row"])
        per_set.append(float((x - y).mean()))
        mine |= pr
        base |= pb
    a, b = align(mine, base, variant, baseline)
    d = paired_diff(a, b)
    return {
        "variant": variant, "baseline": baseline, "sets": sets,
        "questions": d.n, "accuracy": float(a.mean()), "accuracy_ci": mean_ci(a),
        "baseline_accuracy": float(b.mean()), "baseline_accuracy_ci": mean_ci(b), **d.row_fields(),
        "per_set_diff": per_set,
        "mean_peak_live_kv_ratio": float(np.mean(
            [r["mean_peak_live_kv"] / b["mean_peak_live_kv"] for r, b in pairs])),
    }  # fmt: skip


def pooled(table: list[dict], contrasts: list[tuple[str, str]] = ()) -> list[dict]:
    """Rows named ``<set>-<variant>``, each compared to its own set's baseline, pooled per variant
    over every set (the sets are replicates: other questions, thread seeds, weight builds); then each
    contrast [A, B] between two variants, over the sets that hold both."""
    by_name, groups = {r["row"]: r for r in table}, defaultdict(list)
    for r in table:
        if r.get("paired_diff") is not None:
            groups[r["row"].split("-", 1)[1]].append((r, by_name[r["compared_to"]]))

    def set_of(r: dict) -> str:
        return r["row"].split("-", 1)[0]

    out = [_pool(v, pairs[0][1]["row"].split("-", 1)[1], pairs, [set_of(r) for r, _ in pairs])
           for v, pairs in groups.items()]  # fmt: skip
    for a, b in contrasts:
        sets = [s for s in dict.fromkeys(map(set_of, table))
                if f"{s}-{a}" in by_name and f"{s}-{b}" in by_name]  # fmt: skip
        if sets:
            out.append(_pool(a, b, [(by_name[f"{s}-{a}"], by_name[f"{s}-{b}"]) for s in sets], sets))
    return out


def contrasted(table: list[dict], contrasts: list[tuple[str, str]]) -> list[dict]:
    """Each contrast [A, B] of rows both in ``table``: A's paired difference to B."""
    by_name = {r["row"]: r for r in table}
    pairs = [(a, b) for a, b in contrasts if a in by_name and b in by_name]
    return [_pool(a, b, [(by_name[a], by_name[b])], []) for a, b in pairs]


def pooled_markdown(rows: list[dict]) -> str:
    """One line per variant (or contrast): pooled accuracy against its baseline's, the paired
    difference and what may be said of it, each set's difference, and the peak against the baseline's."""
    lines = ["| variant | sets | questions | accuracy [95% CI] | baseline | paired difference [95% CI] "
             "| verdict | per set | peak vs baseline |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append("| " + " | ".join([
            r["variant"], " ".join(r["sets"]), str(r["questions"]), fmt_ci(r["accuracy"], r["accuracy_ci"]),
            f"{r['baseline']} " + fmt_ci(r["baseline_accuracy"], r["baseline_accuracy_ci"]),
            fmt_ci(r["paired_diff"], r["paired_diff_ci"], True) + ("" if r["mcnemar_p"] is None
                                                                   else f" (p {r['mcnemar_p']:.2g})"),
            verdict(r["paired_diff_ci"], r["variant"], r["baseline"], r["mcnemar_p"]),
            " ".join(f"{x:+.2f}" for x in r["per_set_diff"]), f"{r['mean_peak_live_kv_ratio']:.2f}x",
        ]) + " |")  # fmt: skip
    return "\n".join(lines)


def deletion_rate(row: dict) -> float:
    """A SideQuest row's realised deletion rate: the cursors its landed answers deleted over those
    they were offered (what ``rate_from`` gives a random_cursors row)."""
    if not row.get("aux_offered_cursors"):
        raise ValueError(f"rate_from row {row['row']!r} has no auxiliary thread offered any cursor: "
                         "take the rate from a SideQuest row that deleted")  # fmt: skip
    return round(row["deleted_cursors"] / row["aux_offered_cursors"], 4)


def accuracy(r: dict) -> str:
    """A row's accuracy with its 95% interval (a row written before rows kept theirs: Wilson's from
    the count)."""
    ci, n = r.get("accuracy_ci"), r.get("episodes")
    if ci is None and n:
        ci = wilson(round(r["accuracy"] * n), n)
    return fmt_ci(r["accuracy"], ci)


def throughput_markdown(table: list[dict]) -> str:
    """Rows served under one KV pool: episodes per second against the first row of the same
    concurrency, with the pool's preemptions and the threads' own tokens."""
    base, rows = {}, []
    for r in table:
        first = base.setdefault(r["concurrency"], r)
        ratio = r["episodes_per_s"] / first["episodes_per_s"]
        rows.append([r["row"], accuracy(r), r["concurrency"], f"{r['episodes_per_s']:.3f}", f"{ratio:.2f}x",
                     f"{r['wall_s']:.0f}", r["preemptions"], r.get("aux_tokens", 0),
                     f"{r['mean_peak_live_kv']:.0f}"])  # fmt: skip
    columns = ["row", "accuracy [95% CI]", "concurrency", "episodes/s", "vs full context", "wall s",
               "preemptions", "auxiliary tokens", "mean peak live KV"]  # fmt: skip
    return markdown_table(columns, rows)


def markdown(table: list[dict]) -> str:
    """The studies' table: each row's accuracy with its 95% interval, its paired difference to its
    baseline row with the difference's interval and what may be said of it, and its memory against
    that baseline's (full context in the shipped benches; a baseline row: 1.00x)."""
    by_name = {r["row"]: r for r in table}
    baselines = {r.get("compared_to") for r in table}

    def reference(r: dict) -> dict:  # its baseline; a baseline itself; else (no per-question data) the first
        return by_name.get(r.get("compared_to")) or (r if r["row"] in baselines else table[0])

    deletes = any("deletion_precision" in r for r in table)  # SideQuest rows: what their threads deleted
    head = ("| row | accuracy [95% CI] | vs baseline: paired difference [95% CI] | peak live KV "
            "| KV reads / episode | with threads: peak | KV reads | turn limit | unparsable "
            "| position limit |" + " deleted | precision | recall |" * deletes)  # fmt: skip
    lines = [head, "|---" * (10 + 3 * deletes) + "|"]

    def vs_base(r: dict) -> str:
        ci, base = r.get("paired_diff_ci"), r.get("compared_to")
        if ci is None:
            return "-"
        p = r.get("mcnemar_p")
        said = f"{fmt_ci(r['paired_diff'], ci, True)} vs {base}" + ("" if p is None else f" (p {p:.2g})")
        return f"{said}: {verdict(ci, r['row'], base, p)}"

    def vs_full(r: dict, key: str) -> str:
        v, base = r.get(key), reference(r).get(key)
        if v is None:
            return "-"
        return f"{v:.0f} ({v / base:.2f}x)" if base else f"{v:.0f}"

    for r in table:
        nc = r["non_completion"]
        cells = [
            r["row"], accuracy(r), vs_base(r), *(vs_full(r, k) for k in (
                "mean_peak_live_kv", "kv_reads_per_episode", "mean_peak_kv_with_threads",
                "kv_reads_with_threads_per_episode")),
            *(f"{nc[c]:.2f}" for c in ("turn_limit", "unparsable", "position_limit")),
        ]  # fmt: skip
        if deletes:  # precision is None where nothing was deleted, recall where nothing was to delete
            cells += [
                str(r.get("deleted_cursors", "-")),
                *(
                    "-" if r.get(k) is None else f"{r[k]:.2f}"
                    for k in ("deletion_precision", "deletion_recall")
                ),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_memory(table: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from compactrl.plot import MODE_MARKERS

    fig, ax = plt.subplots(figsize=(11, 4.8))
    colors = [c for i, c in enumerate(plt.cm.tab10.colors) if i != 7]  # grey is the solver's (demo rows)
    for i, r in enumerate(table, 1):  # numbered, the names in the legend: close points stay legible
        color = "grey" if r.get("demo") else colors[i % len(colors)]
        if r.get("accuracy_ci"):  # the 95% interval
            (lo, hi), acc = r["accuracy_ci"], r["accuracy"]
            ax.errorbar(r["mean_peak_live_kv"], acc, yerr=[[acc - lo], [hi - acc]], fmt="none", ecolor=color,
                        alpha=0.5, capsize=2, lw=1)  # fmt: skip
        ax.scatter(r["mean_peak_live_kv"], r["accuracy"], marker=MODE_MARKERS.get(r["mode"], "o"), s=40,
                   color=color, label=f"{i} {r['row']}")  # fmt: skip
        ax.annotate(str(i), (r["mean_peak_live_kv"], r["accuracy"]), fontsize=7, xytext=(4, 2),
                    textcoords="offset points")  # fmt: skip
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    ax.set_xlabel("mean peak live KV per episode (tokens)")
    ax.set_ylabel(f"accuracy, 95% interval ({table[0]['episodes']} held-out questions)")
    ax.set_title("accuracy against memory (circles stream, squares reprefill, diamond full)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
