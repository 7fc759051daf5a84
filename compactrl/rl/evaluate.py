"""Held-out evaluation: greedy (or sampled) episodes on env seeds no training step plays, during a
run (``eval_episodes``, ``eval_every``, ``eval_controls``) and after it (`compactrl eval`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import torch

from compactrl.agent.batch import load_engine, run_episodes
from compactrl.agent.chat import ChatFormat
from compactrl.compaction import build_strategy
from compactrl.envs import make_env
from compactrl.envs.base import HELD_OUT_SEED
from compactrl.models.lora import load_thread_adapter
from compactrl.rl.checkpoint import resolve_checkpoint
from compactrl.rl.config import TrainConfig
from compactrl.rl.monitor import note
from compactrl.stats import mean_ci
from compactrl.trace import save_traces


def record_eval(cfg: TrainConfig, engine, summary: dict, when: str) -> dict:
    """Greedy held-out evaluation as RL starts (``before``), every ``eval_every`` steps (``during``:
    the metrics row keeps it) and when training ends (``after``); for the recall task its success
    rate is the post-eviction recall accuracy."""
    stats, _ = held_out(cfg, engine, cfg.eval_episodes, greedy=True)
    if when == "during":
        return stats
    summary[f"eval_{when}"] = stats
    if cfg.env.name == "recall":
        summary[f"recall_accuracy_{when}"] = stats["success_rate"]
    for mode in cfg.eval_controls if when == "after" else ():  # the same policy and episodes, another mode
        stats, _ = held_out(cfg.model_copy(update={"mode": mode}), engine, cfg.eval_episodes, greedy=True)
        summary[f"eval_after_{mode}"] = stats
    (Path(cfg.out) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary[f"eval_{when}"]


def held_out(cfg: TrainConfig, engine, episodes: int, greedy: bool) -> tuple[dict, list]:
    """``episodes`` episodes on env seeds no training step uses, in the run's mode and strategy."""
    settings = cfg.rollout.model_copy(update={"temperature": 0.0}) if greedy else cfg.rollout
    seeds = [HELD_OUT_SEED + cfg.seed + i for i in range(episodes)]
    fmt = ChatFormat.from_tokenizer(
        engine.tokenizer, cfg.rollout.chat_rewrites, cfg.rollout.chat_template_kwargs
    )
    make = lambda: make_env(cfg.env)  # noqa: E731
    strategy = build_strategy(cfg.strategy)
    played = run_episodes(
        engine, fmt, make, strategy, cfg.mode, settings, seeds, episodes, evictor=cfg.evictor
    )
    results = asyncio.run(played)
    rewards = np.array([r.reward for r in results])
    stats = {
        "episodes": episodes,
        "mode": cfg.mode,
        "greedy": greedy,
        "mean_reward": float(rewards.mean()),
        "mean_reward_ci": mean_ci(rewards),
        "success_rate": float((rewards >= 1.0).mean()),
        "success_rate_ci": mean_ci((rewards >= 1.0).astype(float)),
        "errors": sum(r.error is not None for r in results),
    }
    return stats, results


def evaluate(
    cfg: TrainConfig,
    checkpoint: str | Path | None = None,
    episodes: int = 32,
    greedy: bool = False,
    name: str | None = None,
    traces: bool = False,
) -> dict:
    """Run ``episodes`` held-out episodes (env seeds disjoint from training's) with the run's initial
    model, a checkpoint's, or a run folder's newest checkpoint, without training. Each checkpoint
    (and decoding, and ``name`` when given: another env variant or mode) keeps its own result:
    ``run_dir/eval/<checkpoint>[-greedy][-<name>].json``; ``traces`` also keeps the episodes'
    traces beside it (``.traces.jsonl``, for ``compactrl trace show``: what the policy wrote, its
    auxiliary threads' too). A SideQuest thread-adapter run's checkpoint is evaluated as trained:
    the base model on the main thread, the checkpoint's adapter on the auxiliary thread's tokens."""
    torch.set_num_threads(cfg.threads)
    run_dir = Path(cfg.out)
    ckpt = None
    if checkpoint is not None:
        skipped: list[str] = []
        ckpt = resolve_checkpoint(checkpoint, skipped)
        for reason in skipped:
            note(f"skipping a checkpoint: {reason}")
        if ckpt != Path(checkpoint):
            note(f"evaluating {ckpt}, the newest complete checkpoint of {checkpoint}")
    # a thread-adapter run trained a gated adapter, on the auxiliary thread's tokens only: the main
    # thread is the base, the checkpoint's adapter is the thread's; else the checkpoint's merged
    # policy, under the frozen thread adapter the run sampled with, if any
    trained_thread = cfg.objective.name == "sidequest" and cfg.objective.adapter == "thread"
    weights = ckpt / "model" if ckpt and not trained_thread else None
    engine = load_engine(cfg.model, cfg.engine, run_dir, weights)
    thread = ckpt if ckpt and trained_thread else getattr(cfg.strategy, "thread_adapter", None)
    if thread:
        load_thread_adapter(engine.model, thread)
    stats, results = held_out(cfg, engine, episodes, greedy)
    result = {"checkpoint": str(ckpt) if ckpt else None, **stats}
    label = f"{ckpt.name if ckpt else 'initial'}{'-greedy' if greedy else ''}{f'-{name}' if name else ''}"
    path = run_dir / "eval" / f"{label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result | {"episode_metrics": [r.metrics() for r in results]}, indent=1) + "\n")
    if traces:
        save_traces(path.with_suffix(".traces.jsonl"), [t for r in results for t in r.traces + r.aux_traces])
    return result | {"path": str(path)}
