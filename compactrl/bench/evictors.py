"""`compactrl bench evictors`: every token evictor at several budgets against full context and the
step-wise strategies, on the rooms task and on the recall task, the same episodes for every row.

Budgets are fractions of the full-context run's peak live KV, so they mean the same for any model
and tokenizer (default per task: rooms 0.25 and 0.5, recall 0.6 and 0.8). Per row: reward (mean,
standard error and 95% interval ``reward_ci``), ``accuracy`` and ``accuracy_ci`` (the env's
``correct``), the reward's paired difference to the task's full-context row on the same episode
seeds (``compared_to``, ``paired_diff`` with its interval ``paired_diff_ci``, and McNemar's exact
``mcnemar_p`` when rewards are 0/1; see ``compactrl.stats``), peak live KV, KV reads, evicted
tokens and eviction calls per episode, non-completion by cause (unparsable answer, turn limit,
position limit, error), decode tokens/s, ``overhead`` (the evictor's own time, scoring and keeping
queries, as a fraction of the engine's forward time: its cost per decode step) and
``max_abs_logprob_diff`` (the engine's sampled log-probs against the trainer's one-pass forward
over every episode's trace, the evictions replayed by the mask). Rollouts are sampled at
temperature 1, so the logged log-probs are the model's.

On recall the evictor may take any token but the head and its window of 40 (``protect_turn`` off,
the window covers the question as it is read): the counting turn is where the assignment must
survive or be carried. On rooms the current turn is protected, as an agent rollout would run it.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import numpy as np
import torch

from compactrl.agent.batch import run_episodes
from compactrl.agent.chat import ChatFormat
from compactrl.agent.rollout import NON_COMPLETION, RolloutSettings
from compactrl.bench.harness import machine_info, markdown_table
from compactrl.compaction import EvictSteps, Markovian, SlidingWindow, build_strategy
from compactrl.compaction.evictors import EVICTORS, H2O, RKV, TOVA, KNorm, Random, SnapKV, StreamingLLM
from compactrl.engine import Engine, EngineConfig
from compactrl.envs import RecallConfig, RoomsConfig, make_env
from compactrl.models.loading import config_summary
from compactrl.models.tiny import write_tiny_model
from compactrl.rl.forward import stream_logprobs
from compactrl.stats import compare, fmt_ci, fmt_paired, mean_ci

METHODS = {
    "h2o": H2O,
    "snapkv": SnapKV,
    "rkv": RKV,
    "streamingllm": StreamingLLM,
    "tova": TOVA,
    "knorm": KNorm,
    "random": Random,
}
assert tuple(METHODS) == EVICTORS
TASKS = {
    "rooms": dict(
        env=RoomsConfig(n_rooms=8, filler=4),  # configs/evictors/rooms_sft.toml trains its policy
        settings=RolloutSettings(max_tokens=8, max_turns=16, temperature=1.0),
        strategies={"sliding_window": SlidingWindow(max_turns=4), "markovian": Markovian(max_turns=4)},
        evictor=dict(protect_turn=True),
        fractions=(0.25, 0.5),
    ),
    "recall": dict(
        env=RecallConfig(k=64),
        settings=RolloutSettings(max_tokens=64, max_turns=4, temperature=1.0),
        strategies={"evict_steps": EvictSteps(at_step=1, steps=[0])},
        evictor=dict(protect_turn=False, window=40),  # the window covers the question as it is read
        fractions=(0.6, 0.8),  # the task head and the window take ~half of the full-context peak
    ),
}


def _run(engine: Engine, task: dict, strategy_cfg, evictor, mode: str, seeds: list[int]) -> dict:
    """One row: the episodes, batched, and what they cost."""
    engine.totals["forward_s"] = engine.totals["evictor_s"] = 0.0
    settings = task["settings"]
    fmt = ChatFormat.from_tokenizer(engine.tokenizer, settings.chat_rewrites, settings.chat_template_kwargs)
    strategy = build_strategy(strategy_cfg) if strategy_cfg is not None else None
    make = lambda: make_env(task["env"])  # noqa: E731
    t0 = time.perf_counter()
    results = asyncio.run(
        run_episodes(engine, fmt, make, strategy, mode, settings, seeds, len(seeds), evictor=evictor)
    )
    wall = time.perf_counter() - t0
    evictor_s = engine.metrics()["evictor_s"]
    rewards = np.array([r.reward for r in results])
    causes = {c: sum(r.non_completion == c for r in results) for c in NON_COMPLETION}
    traces = [t for r in results for t in r.traces]
    with torch.no_grad():
        replayed = stream_logprobs(engine.model, traces)
    diff = max(
        float((lp.double()[m] - torch.tensor(t.logprobs, dtype=torch.float64)[m]).abs().max())
        for t, lp in zip(traces, replayed, strict=True)
        if (m := torch.as_tensor(t.trainable)).any()
    )
    n = len(results)
    correct = [float(bool(r.info.get("correct"))) for r in results]
    scored = {"accuracy": float(np.mean(correct)), "accuracy_ci": mean_ci(correct)}
    return {
        "reward": float(rewards.mean()),
        "stderr": float(rewards.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
        "reward_ci": mean_ci(rewards),
        **(scored if any("correct" in r.info for r in results) else {}),  # the task says what is correct
        "per_seed": {r.seed: r.reward for r in results},  # for the paired comparison, then dropped
        "peak_live_kv": max(r.peak_live_kv for r in results),
        "kv_reads": sum(r.kv_reads for r in results) / n,
        "evicted_tokens": sum(r.evicted_tokens for r in results) / n,
        "evictions": sum(r.evictions for r in results) / n,
        "non_completion": sum(causes.values()),
        "non_completion_causes": causes,
        "decode_tokens_per_s": sum(r.generated_tokens for r in results) / wall,
        "overhead": evictor_s / engine.totals["forward_s"] if engine.totals["forward_s"] else 0.0,
        "max_abs_logprob_diff": diff,
        "wall_s": wall,
    }


def check_params(
    tasks: tuple[str, ...], methods: tuple[str, ...], fractions: tuple[float, ...] | None, episodes: int,
    threads: int,
) -> None:  # fmt: skip
    """Raise ValueError (naming the CLI's flags) on an unknown task or evictor, or a budget that is
    not a fraction of the full-context peak."""
    for flag, given, known in (("--task", tasks, TASKS), ("--evictor", methods, EVICTORS)):
        if set(given) - set(known):
            raise ValueError(f"{flag} {sorted(set(given) - set(known))} unknown; choose from {list(known)}")
    if fractions and not all(0 < f < 1 for f in fractions):
        raise ValueError(
            f"--budget {list(fractions)}: give fractions of the full-context peak, between 0 and 1"
        )
    if min(episodes, threads) < 1:
        raise ValueError("--episodes and --threads must be >= 1")


def run_evictors_bench(
    model_dir: Path | None,
    tasks: tuple[str, ...] = tuple(TASKS),
    methods: tuple[str, ...] = EVICTORS,
    fractions: tuple[float, ...] | None = None,
    episodes: int = 8,
    threads: int = 1,
    seed: int = 0,
    work_dir: Path = Path("runs/bench_evictors"),
    progress=None,
) -> dict:
    torch.set_num_threads(threads)
    if model_dir is None:
        model_dir = work_dir / "model"
        if not (model_dir / "config.json").exists():
            write_tiny_model(model_dir, family="qwen3", size="tiny", seed=0)
    engine = Engine.from_pretrained(
        model_dir, config=EngineConfig(kv_pool_tokens=1 << 20, max_step_tokens=2048)
    )
    seeds = list(range(seed, seed + episodes))
    out = {
        "machine": machine_info(threads),
        "model": {"source": str(model_dir), **config_summary(engine.model.config)},
        "episodes": episodes,
        "tasks": {},
    }

    def fracs(t):
        return fractions or TASKS[t]["fractions"]

    total = sum(1 + len(TASKS[t]["strategies"]) + len(methods) * len(fracs(t)) for t in tasks)
    advance = progress(total) if progress else (lambda info=None: None)
    for name in tasks:
        task = TASKS[name]
        rows = [{"name": "full", "budget": None, **_run(engine, task, None, None, "full", seeds)}]
        advance()
        peak = rows[0]["peak_live_kv"]
        for sname, scfg in task["strategies"].items():
            rows.append({"name": sname, "budget": None, **_run(engine, task, scfg, None, "stream", seeds)})
            advance()
        for method in methods:
            for frac in fracs(name):
                budget = round(frac * peak)
                ev = METHODS[method](budget=budget, **task["evictor"])
                rows.append(
                    {"name": method, "budget": budget, **_run(engine, task, None, ev, "stream", seeds)}
                )
                advance(f"{name} {method} {budget}")
        full = rows[0]["decode_tokens_per_s"]
        for r in rows:
            r["decode_speed_vs_full"] = r["decode_tokens_per_s"] / full if full else 0.0
        _pair(rows)
        out["tasks"][name] = {"env": task["env"].model_dump(), "full_peak_live_kv": peak, "rows": rows}
    return out


def _pair(rows: list[dict]) -> None:
    """Each row's reward against full context's (the first row) on the same episode seeds, and each
    scored evictor's against random eviction at the same budget (the baseline a score must beat):
    the paired difference, its interval and McNemar's p, in place (``vs_random``: the same fields);
    the per-episode rewards are not kept."""
    per_seed = [r.pop("per_seed") for r in rows]
    rows[0] |= dict.fromkeys(("compared_to", "paired_diff", "paired_diff_ci", "mcnemar_p"))
    random = {r["budget"]: x for r, x in zip(rows, per_seed, strict=True) if r["name"] == "random"}
    for r, x in zip(rows[1:], per_seed[1:], strict=True):
        label = r["name"] if r["budget"] is None else f"{r['name']} at {r['budget']}"
        r |= compare(x, per_seed[0], label, rows[0]["name"])
        if r["name"] in METHODS and r["name"] != "random" and r["budget"] in random:
            r["vs_random"] = compare(x, random[r["budget"]], label, f"random at {r['budget']}")


COLUMNS = ["row", "budget", "reward [95% CI]", "vs full, paired [95% CI]", "vs random, paired",
           "peak KV", "KV reads/ep", "evictions/ep", "not done", "overhead", "decode vs full",
           "logprob diff"]  # fmt: skip


def table(task: dict) -> list[list[str]]:
    """One task's rows under ``COLUMNS`` (what the CLI prints and the documentation renders)."""
    rows = []
    for r in task["rows"]:
        name = r["name"]
        rows.append([
            name, str(r["budget"] or "-"), fmt_ci(r["reward"], r["reward_ci"]), fmt_paired(r, name),
            fmt_paired(r.get("vs_random"), name), str(r["peak_live_kv"]), f"{r['kv_reads']:.0f}",
            f"{r['evictions']:.1f}", str(r["non_completion"]), f"{r['overhead']:.2f}",
            f"{r['decode_speed_vs_full']:.2f}", f"{r['max_abs_logprob_diff']:.1e}",
        ])  # fmt: skip
    return rows


def markdown(result: dict) -> str:
    return "\n\n".join(
        f"{name}: full-context peak {t['full_peak_live_kv']}\n\n" + markdown_table(COLUMNS, table(t))
        for name, t in result["tasks"].items()
    )


def plot_evictors(result: dict, path: Path) -> Path:
    """Reward (95% interval as error bars) against peak live KV per task: one marker per method,
    full context and the step-wise strategies as reference points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = result["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    markers = dict(zip(EVICTORS, "os^vDPX", strict=True))
    names = list(dict.fromkeys(r["name"] for t in tasks.values() for r in t["rows"]))
    colors = {n: f"C{i % 10}" for i, n in enumerate(names)}  # one colour per row name, every budget
    for ax, (name, t) in zip(axes[0], tasks.items(), strict=True):
        for r in t["rows"]:
            style = dict(
                marker=markers.get(r["name"], "*"), s=60 if r["budget"] else 140, color=colors[r["name"]]
            )
            lo, hi = r.get("reward_ci") or (r["reward"] - r["stderr"], r["reward"] + r["stderr"])
            ax.errorbar(r["peak_live_kv"], r["reward"], yerr=[[r["reward"] - lo], [hi - r["reward"]]],
                        fmt="none", ecolor="0.7", capsize=2)  # fmt: skip
            ax.scatter(r["peak_live_kv"], r["reward"], label=r["name"], **style)
        handles, labels = ax.get_legend_handles_labels()
        seen = dict(zip(labels, handles, strict=True))
        ax.legend(seen.values(), seen.keys(), fontsize=7)
        ax.set(title=f"{name} ({result['episodes']} episodes per point)", xlabel="peak live KV (tokens)",
               ylabel="reward (95% interval)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
