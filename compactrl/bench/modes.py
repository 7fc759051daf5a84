"""`compactrl bench modes`: the same episodes in ``full``, ``reprefill`` and ``stream`` mode.

Part 1, per strategy: one env (the long-horizon ``rooms`` task), one model, the same seeds and
fixed-length actions, so every mode runs the same schedule of compactions. Reported per mode:
prefilled tokens, re-prefilled tokens measured against the cost model's prediction for the
realised schedule, wall-clock (``wallclock_ratio`` = reprefill / stream), peak live KV, KV reads.

Part 2, a concurrency sweep under one fixed KV pool (2.5x the peak of one ``full`` episode of a
longer task):
episodes/s and generated tokens/s for ``full`` and ``stream`` sliding window as concurrency
grows, and the concurrency at which each starts to preempt (``concurrency_ratio`` = stream
onset / full onset), as in the KV-streams paper's figure 9.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from compactrl.agent.batch import run_episodes
from compactrl.agent.chat import ChatFormat
from compactrl.agent.rollout import EpisodeResult, RolloutSettings
from compactrl.bench.trainer import machine_info
from compactrl.compaction import Markovian, PickTurns, SlidingWindow, Summary, build_strategy
from compactrl.engine import Engine, EngineConfig
from compactrl.envs.rooms import RoomsEnv
from compactrl.models.config import load_config
from compactrl.models.loading import config_summary
from compactrl.models.tiny import write_tiny_model

STRATEGY_NAMES = ("sliding_window", "markovian", "summary", "pick")


def _strategy(name: str, window: int, budget: int):
    return {
        "sliding_window": SlidingWindow(max_turns=window, stride=1),
        "markovian": Markovian(max_turns=window),
        "summary": Summary(budget=budget, tail=2, max_tokens=64),
        "pick": PickTurns(budget=budget, keep_budget=budget // 2),
    }[name]


def _run(folder, make_env, strategy_cfg, mode, settings, seeds, concurrency, pool) -> tuple[float, list]:
    engine = Engine.from_pretrained(folder, config=EngineConfig(kv_pool_tokens=pool, max_step_tokens=2048))
    fmt = ChatFormat.from_tokenizer(engine.tokenizer, settings.chat_rewrites, settings.chat_template_kwargs)
    strategy = build_strategy(strategy_cfg)
    t0 = time.perf_counter()
    results = asyncio.run(run_episodes(engine, fmt, make_env, strategy, mode, settings, seeds, concurrency))
    wall = time.perf_counter() - t0
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{mode} episodes failed: {errors[0]}")
    return wall, results


def _totals(wall: float, results: list[EpisodeResult]) -> dict:
    def total(key):
        return sum(getattr(r, key) for r in results)

    return {
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


def _onset(points: list[dict]) -> int | None:
    return next((p["concurrency"] for p in points if p["preemptions"] > 0), None)


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
    repeats: int = 1,
    sweep: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
    sweep_rooms: int = 64,
    sweep_filler: int = 8,
    sweep_window: int = 8,
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
    steps = (2 + 2 * repeats * len(strategies)) + 2 * len(sweep)
    advance = progress(steps) if progress else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(model_dir) if model_dir else write_tiny_model(Path(tmp) / "model", size=size)
        full = _totals(*_run(folder, make_env, SlidingWindow(), "full", settings, seeds, episodes, big))
        advance()
        rows = []
        for name in strategies:
            cfg = _strategy(name, window, budget)
            runs = {"reprefill": [], "stream": []}
            for _ in range(repeats):  # the two modes take turns, so machine drift hits both alike
                for mode in runs:
                    runs[mode].append(
                        _totals(*_run(folder, make_env, cfg, mode, settings, seeds, episodes, big))
                    )
                    advance()
            med = {m: min(rs, key=lambda r: abs(r["wall_s"] - statistics.median(x["wall_s"] for x in rs)))
                   for m, rs in runs.items()}  # fmt: skip
            rows.append({
                "strategy": name,
                "params": cfg.model_dump(),
                "full": full,
                **med,
                "wallclock_ratio": med["reprefill"]["wall_s"] / med["stream"]["wall_s"],
                "wallclock_ratio_vs_full": full["wall_s"] / med["stream"]["wall_s"],
                "reprefill_matches_cost_model": med["reprefill"]["reprefilled_tokens"]
                == med["reprefill"]["predicted_reprefilled_tokens"],
            })  # fmt: skip

        # long episodes with short observations: many turns per KV token, as in long-horizon agents
        make_long = lambda: RoomsEnv(n_rooms=sweep_rooms, filler=sweep_filler, action_tokens=8)  # noqa: E731
        long = RolloutSettings(max_tokens=8, max_turns=sweep_rooms + 1, ignore_eos=True)
        one = _totals(*_run(folder, make_long, SlidingWindow(), "full", long, [0], 1, big))
        pool = int(2.5 * one["peak_live_kv"])
        sweep_rows = {"full": [], "stream": []}
        window_cfg = SlidingWindow(max_turns=sweep_window, stride=1)
        for c in sweep:
            for mode, points in sweep_rows.items():
                # two levels past the onset show the drop; beyond, recompute thrash only costs time
                if sum(p["preemptions"] > 0 for p in points) < 2:
                    wall, results = _run(folder, make_long, window_cfg, mode, long, list(range(c)), c, pool)
                    points.append({"concurrency": c, **_totals(wall, results)})
                advance()
        onsets = {m: _onset(p) for m, p in sweep_rows.items()}
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
        "strategies": rows,
        "concurrency": {
            "pool_tokens": pool,
            "env": {"name": "rooms", "n_rooms": sweep_rooms, "filler": sweep_filler, "action_tokens": 8},
            "full_episode_peak_kv": one["peak_live_kv"],
            "strategy": window_cfg.model_dump(),
            "full": sweep_rows["full"],
            "stream": sweep_rows["stream"],
            "preemption_onset": onsets,
            "concurrency_ratio": ratio,
            "concurrency_ratio_is_lower_bound": onsets["full"] is not None and onsets["stream"] is None,
        },
    }
    if vllm_error:
        result["vllm_error"] = vllm_error
    if plots is not None:
        result["plots"] = [str(p) for p in plot_modes(result, plots)]
    return result


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
