"""`compactrl bench modes`: the same episodes in ``full``, ``reprefill`` and ``stream`` mode.

Part 1, per strategy: one env (the long-horizon ``rooms`` task), one model, the same seeds and
fixed-length actions, so every mode runs the same schedule of compactions. Reported per mode:
prefilled tokens, re-prefilled tokens measured against the cost model's prediction for the
realised schedule, wall-clock (``wallclock_ratio`` = reprefill / stream), peak live KV, KV reads.
Every run is repeated ``repeats`` times; the runs take turns in every round, in reverse order
every other round (so neither mode always goes first), and the median wall-clock is reported with
its min and max, and the ratio of each round with the ratio of the medians.

Part 2, a concurrency sweep under one fixed KV pool (``pool_episodes`` = 2.5 times the peak KV of
one ``full`` episode of a longer task): episodes/s and generated tokens/s for ``full`` and
``stream`` sliding window as concurrency grows, and the concurrency at which each starts to
preempt (``concurrency_ratio`` = stream onset / full onset), as in the KV-streams paper's figure 9.
Each onset is bisected between the sweep's levels, checked against the KV demand of the runs at
and below it, and set beside the earliest onset the episodes' peak KV footprint allows
(:func:`predicted_onset`).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from compactrl.agent.batch import run_episodes
from compactrl.agent.chat import ChatFormat
from compactrl.agent.rollout import EpisodeResult, RolloutSettings
from compactrl.bench.harness import interleaved, machine_info, markdown_table
from compactrl.compaction import Markovian, PickTurns, SlidingWindow, Summary, build_strategy
from compactrl.engine import Engine, EngineConfig
from compactrl.engine.kv_book import KVBook
from compactrl.envs.rooms import RoomsEnv
from compactrl.models.config import load_config
from compactrl.models.loading import config_summary
from compactrl.models.tiny import write_tiny_model

STRATEGY_NAMES = ("sliding_window", "markovian", "summary", "pick")
SWEEP = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # concurrency levels of part 2


def check_params(
    strategies: tuple[str, ...], episodes: int, n_rooms: int, window: int, threads: int, repeats: int,
    sweep: tuple[int, ...], vllm_python: str | None, tiny_model: bool,
) -> None:  # fmt: skip
    """Raise ValueError (naming the CLI's flags) on arguments :func:`run_modes_bench` cannot run;
    ``tiny_model``: the model will be generated at size tiny (too small a head for vLLM)."""
    bad = sorted(set(strategies) - set(STRATEGY_NAMES))
    if bad:
        raise ValueError(f"--strategy {bad} unknown; choose from {list(STRATEGY_NAMES)}")
    if min(episodes, n_rooms, window, threads, repeats, *sweep) < 1:
        raise ValueError("--episodes, --rooms, --window, --threads, --repeats and --sweep must be >= 1")
    if vllm_python is not None:
        if not Path(vllm_python).exists():
            raise ValueError(f"--vllm-python {vllm_python} does not exist")
        if tiny_model:
            raise ValueError("vLLM needs head_dim >= 32, which the tiny model lacks: add --size small")


def _strategy(name: str, window: int, budget: int):
    return {
        "sliding_window": SlidingWindow(max_turns=window, stride=1),
        "markovian": Markovian(max_turns=window),
        "summary": Summary(budget=budget, tail=2, max_tokens=64),
        "pick": PickTurns(budget=budget, keep_budget=budget // 2),
    }[name]


class _DemandBook(KVBook):
    """KV bookkeeping that notes the demand the scheduler's preemption decisions are made on.

    Before it feeds ``n`` tokens of a session, the scheduler checks that the pool holds every
    resident row plus this row's ``used + n`` entries (live entries and the holes its evictions
    left, until the row is compacted; in ``block_size`` blocks), and preempts if not. A session's
    footprint (``peak_kv``) is the largest ``used + n`` it needed: for a stream row, its live KV
    plus up to ``compact_holes`` of the row (at least 32 entries) in holes. ``peak_pool`` is the
    largest total the scheduler checked; a run preempts iff it would exceed the pool."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.peak_kv: dict[str, int] = {}
        self.peak_pool = 0

    def claim(self, s, n: int) -> int:
        before, need = self.blocks(self.kv.used[s.row]), self.blocks(self.kv.used[s.row] + n)
        self.peak_kv[s.id] = max(self.peak_kv.get(s.id, 0), need)
        self.peak_pool = max(self.peak_pool, self.used() - before + need)
        return super().claim(s, n)


class _Engine(Engine):
    """An engine whose bookkeeping notes its KV demand (:class:`_DemandBook`)."""

    Book = _DemandBook


def _run(
    folder, make_env, strategy_cfg, mode, settings, seeds, concurrency, pool, demand=False
) -> tuple[float, list, Engine]:
    """Wall-clock, episode results and the engine of one run; ``demand`` notes its KV demand
    (``_Engine``: the sweep's runs; the timed runs of part 1 go without its bookkeeping)."""
    config = EngineConfig(kv_pool_tokens=pool, max_step_tokens=2048)
    engine = (_Engine if demand else Engine).from_pretrained(folder, config=config)
    fmt = ChatFormat.from_tokenizer(engine.tokenizer, settings.chat_rewrites, settings.chat_template_kwargs)
    strategy = build_strategy(strategy_cfg)
    t0 = time.perf_counter()
    results = asyncio.run(run_episodes(engine, fmt, make_env, strategy, mode, settings, seeds, concurrency))
    wall = time.perf_counter() - t0
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{mode} episodes failed: {errors[0]}")
    return wall, results, engine


def _totals(wall: float, results: list[EpisodeResult], engine: Engine | None = None) -> dict:
    """Totals of one run; with its engine, each session's footprint and the largest pool demand."""

    def total(key):
        return sum(getattr(r, key) for r in results)

    out = {
        "wall_s": wall,
        "episodes": len(results),
        "turns": total("turns"),
        "compactions": total("compactions"),
        "generated_tokens": total("generated_tokens"),
        "prefilled_tokens": total("prefilled_tokens"),
        "reprefilled_tokens": total("reprefilled_tokens"),
        "predicted_reprefilled_tokens": total("predicted_reprefilled_tokens"),
        "peak_live_kv": max(r.peak_live_kv for r in results),
        "kv_reads": total("kv_reads"),
        "preemptions": total("preemptions"),
        "episodes_per_s": len(results) / wall,
        "generated_tokens_per_s": total("generated_tokens") / wall,
    }
    if hasattr(book := getattr(engine, "book", None), "peak_pool"):  # an _Engine's _DemandBook
        out |= {"peak_kv_per_episode": sorted(book.peak_kv.values()), "peak_pool_demand": book.peak_pool}
    return out


def _summary(runs: list[dict]) -> dict:
    """The run of median wall-clock (token counts are the same in every run), with the spread."""
    walls = [r["wall_s"] for r in runs]
    med = statistics.median(walls)
    return min(runs, key=lambda r: abs(r["wall_s"] - med)) | {
        "wall_s": med, "wall_s_min": min(walls), "wall_s_max": max(walls), "wall_s_runs": walls,
    }  # fmt: skip


def _vllm_rollouts(vllm_python: str, job: dict, tmp: Path) -> list[dict]:
    """Run the same episodes in ``reprefill`` mode on vLLM (its own virtualenv, a subprocess)."""
    path = tmp / "vllm_job.json"
    path.write_text(json.dumps(job))
    script = Path(__file__).with_name("vllm_rollout.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([vllm_python, str(script), str(path)], capture_output=True, text=True, env=env,
                          timeout=3600)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the vLLM rollouts failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for run in out["runs"]:
        if run["errors"]:
            raise RuntimeError(f"vLLM {run['strategy']} episodes failed: {run['errors'][0]}")
        run |= {"vllm": out["version"], "prefix_caching": out["prefix_caching"]}
    return out["runs"]


def predicted_onset(pool: int, peak_kv: int) -> int:
    """The earliest preemption onset that ``c`` episodes of at most ``peak_kv`` tokens allow.

    A run preempts iff its KV demand (``_Engine``: every resident row, holes included, at one
    scheduling decision) would exceed the pool. If no episode ever needs more than ``peak_kv``,
    ``c <= pool // peak_kv`` episodes cannot preempt, so the onset is at least ``pool // peak_kv +
    1``, and equal to it when the episodes reach their peaks in the same step. Full episodes do (at
    their last turn; no holes, so the footprint is the live KV). A stream row peaks just before a
    compaction, with the holes that its evictions left plus a turn being fed, and the sweep's rows
    do not all do that in the same step: their onset can come later (one later in docs/benchmarks.md's
    sweep). The peak live KV leaves the holes out, and predicts a later onset than the engine's."""
    return pool // peak_kv + 1


def _onset(points: list[dict]) -> int | None:
    return next((p["concurrency"] for p in points if p["preemptions"] > 0), None)


def sweep_onsets(
    probe: Callable[[str, int, int], dict],
    modes: tuple[str, ...],
    levels: tuple[int, ...],
    pool: int,
    advance: Callable[[], None] = lambda: None,
) -> dict:
    """Find each mode's preemption onset: the smallest concurrency that preempts in ``pool``.

    ``probe(mode, c, pool)`` runs ``c`` concurrent episodes (a ``_totals`` dict with the engine).
    After the sweep's ``levels``, the onset is bisected between the last level that did not
    preempt and the first that did (assuming more episodes never need less KV). It is checked
    twice: against :func:`predicted_onset` from the largest footprint of an episode that ran
    without preemption, and exactly: the episodes at the onset, run in an unbounded pool, demand
    more than ``pool`` (``demand_at_onset``), those one below it did not (``demand_below_onset``)."""
    points: dict[str, list[dict]] = {m: [] for m in modes}
    for c in levels:
        for mode, pts in points.items():
            # two levels past the onset show the drop; beyond, recompute thrash only costs time
            if sum(p["preemptions"] > 0 for p in pts) < 2:
                pts.append({"concurrency": c, **probe(mode, c, pool)})
            advance()
    onsets = {}
    for mode, pts in points.items():
        coarse = _onset(pts)
        probed, demand_at = [], None
        if coarse is not None:
            lo = max((p["concurrency"] for p in pts if p["concurrency"] < coarse), default=0)
            hi = coarse
            while hi - lo > 1:
                mid = (lo + hi) // 2
                pts.append({"concurrency": mid, "bisect": True, **probe(mode, mid, pool)})
                probed.append(mid)
                lo, hi = (lo, mid) if pts[-1]["preemptions"] else (mid, hi)
            pts.sort(key=lambda p: p["concurrency"])
            demand_at = probe(mode, hi, 1 << 30)["peak_pool_demand"]
        measured = _onset(pts)
        fit = [p for p in pts if not p["preemptions"]]
        below = [p["peak_pool_demand"] for p in fit if measured and p["concurrency"] == measured - 1]
        peak = max((k for p in fit for k in p["peak_kv_per_episode"]), default=None)
        live = max((p["peak_live_kv"] for p in fit), default=None)
        onsets[mode] = {
            "measured": measured,
            "coarse": coarse,
            "bisected_at": probed,
            "peak_kv_per_episode": peak,
            "peak_live_kv_per_episode": live,
            "predicted": predicted_onset(pool, peak) if peak else None,
            "predicted_from_live_kv": predicted_onset(pool, live) if live else None,
            "demand_below_onset": below[0] if below else None,
            "demand_at_onset": demand_at,
        }
    return {"points": points, "onsets": onsets}


def run_modes_bench(
    model_dir: str | Path | None = None,
    *,
    size: str = "tiny",
    threads: int = 1,
    strategies: tuple[str, ...] = STRATEGY_NAMES,
    episodes: int = 8,
    n_rooms: int = 40,
    filler: int = 24,
    action_tokens: int = 16,
    window: int = 10,
    budget: int = 2400,
    repeats: int = 3,
    sweep: tuple[int, ...] = SWEEP,
    sweep_rooms: int = 64,
    sweep_filler: int = 8,
    sweep_window: int = 8,
    pool_episodes: float = 2.5,
    vllm_python: str | None = None,
    plots: Path | None = None,
    progress=None,
) -> dict:
    unknown = set(strategies) - set(STRATEGY_NAMES)
    if unknown:
        raise ValueError(f"unknown strategies {sorted(unknown)}; choose from {list(STRATEGY_NAMES)}")
    torch.set_num_threads(threads)
    settings = RolloutSettings(max_tokens=action_tokens, max_turns=n_rooms + 1, ignore_eos=True)
    make_env = lambda: RoomsEnv(n_rooms=n_rooms, filler=filler, action_tokens=action_tokens)  # noqa: E731
    seeds = list(range(episodes))
    big = 1 << 22
    arms = [("full", "full")] + [(name, mode) for name in strategies for mode in ("reprefill", "stream")]
    steps = 1 + repeats * len(arms) + 2 * len(sweep)
    advance = progress(steps) if progress else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(model_dir) if model_dir else write_tiny_model(Path(tmp) / "model", size=size)
        # long episodes with short observations: many turns per KV token, as in long-horizon agents.
        # One full episode sizes the sweep's pool (and is the process's warm-up run).
        make_long = lambda: RoomsEnv(n_rooms=sweep_rooms, filler=sweep_filler, action_tokens=8)  # noqa: E731
        long = RolloutSettings(max_tokens=8, max_turns=sweep_rooms + 1, ignore_eos=True)
        one = _totals(*_run(folder, make_long, SlidingWindow(), "full", long, [0], 1, big))
        pool = int(pool_episodes * one["peak_live_kv"])
        advance()

        cfgs = {name: _strategy(name, window, budget) for name in strategies} | {"full": SlidingWindow()}

        def timed_run(name: str, mode: str) -> dict:
            wall, results, _ = _run(folder, make_env, cfgs[name], mode, settings, seeds, episodes, big)
            return _totals(wall, results)

        # the long episode above warmed the process up; the runs take turns, reversed every other round
        turns = {a: lambda a=a: timed_run(*a) for a in arms}
        runs = interleaved(turns, repeats, warmup=False, alternate=True, advance=advance)
        full = _summary(runs["full", "full"])
        rows = []
        for name in strategies:
            rp, st = runs[name, "reprefill"], runs[name, "stream"]
            med = {"reprefill": _summary(rp), "stream": _summary(st)}
            per_round = [a["wall_s"] / b["wall_s"] for a, b in zip(rp, st, strict=True)]
            rows.append({
                "strategy": name,
                "params": cfgs[name].model_dump(),
                "full": full,
                **med,
                "wallclock_ratio": med["reprefill"]["wall_s"] / med["stream"]["wall_s"],
                "wallclock_ratio_rounds": per_round,
                "wallclock_ratio_min": min(per_round),
                "wallclock_ratio_max": max(per_round),
                "wallclock_ratio_vs_full": full["wall_s"] / med["stream"]["wall_s"],
                "reprefill_matches_cost_model": all(
                    r["reprefilled_tokens"] == r["predicted_reprefilled_tokens"] for r in rp
                ),
            })  # fmt: skip

        window_cfg = SlidingWindow(max_turns=sweep_window, stride=1)

        def probe(mode: str, c: int, pool: int) -> dict:
            return _totals(*_run(folder, make_long, window_cfg, mode, long, list(range(c)), c, pool, True))

        found = sweep_onsets(probe, ("full", "stream"), sweep, pool, advance)
        onsets = {m: o["measured"] for m, o in found["onsets"].items()}
        predicted = {m: o["predicted"] for m, o in found["onsets"].items()}
        vllm_error = None
        if vllm_python:
            job = {
                "model": str(folder), "threads": threads, "max_model_len": 32768, "seeds": seeds,
                "concurrency": episodes, "settings": settings.model_dump(),
                "env": {"n_rooms": n_rooms, "filler": filler, "action_tokens": action_tokens},
                "runs": [{"strategy": r["params"], "mode": "reprefill"} for r in rows],
            }  # fmt: skip
            try:
                for row, v in zip(rows, _vllm_rollouts(vllm_python, job, Path(tmp)), strict=True):
                    row["vllm_reprefill"] = v
                    row["wallclock_ratio_vs_vllm"] = v["wall_s"] / row["stream"]["wall_s"]
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # an optional baseline: keep the rest
                vllm_error = str(e)[-2000:]
        model_summary = config_summary(load_config(folder))
    ratio = None
    if onsets["full"] and onsets["stream"]:
        ratio = onsets["stream"] / onsets["full"]
    elif onsets["full"]:
        ratio = max(sweep) / onsets["full"]  # stream never preempted: a lower bound
    result = {
        "benchmark": "modes",
        "machine": machine_info(threads),
        "model": model_summary | {"source": str(model_dir) if model_dir else f"tiny qwen3 {size}"},
        "env": {"name": "rooms", "n_rooms": n_rooms, "filler": filler, "action_tokens": action_tokens},
        "episodes": episodes,
        "repeats": repeats,
        "strategies": rows,
        "concurrency": {
            "pool_tokens": pool,
            "pool_sizing": f"{pool_episodes} x one full episode's peak KV ({one['peak_live_kv']} tokens)",
            "pool_full_episodes": pool_episodes,
            "env": {"name": "rooms", "n_rooms": sweep_rooms, "filler": sweep_filler, "action_tokens": 8},
            "full_episode_peak_kv": one["peak_live_kv"],
            "strategy": window_cfg.model_dump(),
            "full": found["points"]["full"],
            "stream": found["points"]["stream"],
            "onsets": found["onsets"],
            "preemption_onset": onsets,
            "predicted_onset": predicted,
            "onsets_match_prediction": onsets == predicted,
            "concurrency_ratio": ratio,
            "predicted_concurrency_ratio": predicted["stream"] / predicted["full"]
            if all(predicted.values())
            else None,
            "concurrency_ratio_is_lower_bound": onsets["full"] is not None and onsets["stream"] is None,
        },
    }
    if vllm_error:
        result["vllm_error"] = vllm_error
    if plots is not None:
        result["plots"] = [str(p) for p in plot_modes(result, plots)]
    return result


COLUMNS = ["strategy", "compactions", "full (s)", "reprefill (s)", "stream (s)", "reprefill / stream",
           "re-prefilled = predicted"]  # fmt: skip


def table(result: dict) -> list[list[str]]:
    """Per strategy: each mode's wall-clock, median (min-max) over the rounds; the ratio of the
    medians (min-max of the rounds' ratios); the re-prefilled tokens against the cost model's."""

    def wall(x: dict) -> str:
        return f"{x['wall_s']:.1f} ({x['wall_s_min']:.1f}-{x['wall_s_max']:.1f})"

    rows = []
    for r in result["strategies"]:
        ratio = f"{r['wallclock_ratio']:.2f} ({r['wallclock_ratio_min']:.2f}-{r['wallclock_ratio_max']:.2f})"
        tokens = r["reprefill"]["reprefilled_tokens"], r["reprefill"]["predicted_reprefilled_tokens"]
        rows.append([r["strategy"], str(r["reprefill"]["compactions"]), wall(r["full"]), wall(r["reprefill"]),
                     wall(r["stream"]), ratio, "{:,} = {:,}".format(*tokens)])  # fmt: skip
    return rows


def markdown(result: dict) -> str:
    return markdown_table(COLUMNS, table(result))


def plot_modes(result: dict, stem: Path) -> list[Path]:
    """``<stem>_modes.png`` (wall-clock and prefill per strategy and mode) and
    ``<stem>_concurrency.png`` (throughput vs concurrency, preemption onsets marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem.parent.mkdir(parents=True, exist_ok=True)
    rows = result["strategies"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["strategy"] for r in rows]
    x = range(len(rows))
    for k, (mode, color) in enumerate((("full", "grey"), ("reprefill", "tab:red"), ("stream", "tab:blue"))):
        xs = [i + (k - 1) * 0.27 for i in x]
        axes[0].bar(xs, [r[mode]["wall_s"] for r in rows], 0.27, label=mode, color=color)
        axes[1].bar(xs, [r[mode]["prefilled_tokens"] for r in rows], 0.27, label=mode, color=color)
    for ax, title in zip(axes, ("rollout wall-clock (s)", "prefilled tokens"), strict=True):
        ax.set_xticks(list(x), names)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    modes_png = stem.parent / f"{stem.name}_modes.png"
    fig.savefig(modes_png, dpi=120)
    plt.close(fig)

    conc = result["concurrency"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode, color in (("full", "grey"), ("stream", "tab:blue")):
        cs = [p["concurrency"] for p in conc[mode]]
        axes[0].plot(cs, [p["episodes_per_s"] for p in conc[mode]], "o-", color=color, label=mode)
        axes[1].plot(cs, [p["generated_tokens_per_s"] for p in conc[mode]], "o-", color=color, label=mode)
        onset = conc["preemption_onset"][mode]
        for ax in axes:
            if onset:
                ax.axvline(onset, color=color, ls="--", alpha=0.6)
    for ax, title in zip(axes, ("episodes / s", "generated tokens / s"), strict=True):
        ax.set_xlabel("concurrent episodes (dashed: preemption starts)")
        ax.set_title(f"{title}, KV pool {conc['pool_tokens']} tokens")
        ax.legend()
    fig.tight_layout()
    conc_png = stem.parent / f"{stem.name}_concurrency.png"
    fig.savefig(conc_png, dpi=120)
    plt.close(fig)
    return [modes_png, conc_png]
