"""`compactrl bench scale [CONFIG]`: RL steps per second, one process against the Ray layouts.

Each layout trains the same config (default ``configs/train/scale.toml``) for ``steps`` steps into
its own folder, one after the other in one run on one Ray cluster. The first step is left out of
the rate: it carries the actors' start (reported apart as ``first_step_s``). Per layout the
report gives steps/s, its ratio to one process, and the mean step's generation, training and
weight-sync seconds (``generate_s`` is the wait for the batch: with ``max_lag`` it overlaps the
previous step's training). With ``max_lag = 0`` every layout samples the same rollouts (rollout
workers equal one process token for token), so the layouts differ in time only.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from compactrl.bench.harness import machine_info
from compactrl.cluster import launch
from compactrl.rl.config import TrainConfig

LAYOUTS: dict[str, dict] = {
    "one-process": {},
    "2-rollout-workers": {"cluster": {"backend": "ray", "rollout_workers": 2}},
    "2-rollout-workers-lag-1": {"cluster": {"backend": "ray", "rollout_workers": 2}, "max_lag": 1},
    "2-trainer-ranks": {"cluster": {"backend": "ray", "trainer_workers": 2}, "threads": 1},
}


def run_scale_bench(cfg: TrainConfig, out: Path, layouts: list[str], progress=None) -> dict:
    import ray

    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layout(s) {unknown}; choose from {list(LAYOUTS)}")
    if cfg.steps < 3:
        raise ValueError(f"steps = {cfg.steps}: the rate needs at least 3 steps (the first is left out)")
    if cfg.cluster.backend != "local":
        raise ValueError("the bench sets [cluster] itself per layout: leave it out of the config")
    owned = not ray.is_initialized()
    if owned:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
    base = json.loads(cfg.model_dump_json())
    advance = progress(len(layouts) * cfg.steps) if progress else (lambda info=None: None)
    rows = []
    try:
        for name in layouts:
            run = TrainConfig(**(base | LAYOUTS[name] | {"out": str(out / name)}))
            ends: list[float] = []
            metrics: list[dict] = []
            t0 = time.perf_counter()

            def step(m, ends=ends, metrics=metrics, name=name):
                ends.append(time.perf_counter())
                metrics.append(m)
                advance(f"{name} step {m['step']}")

            launch(run, overwrite=True, on_step=step)
            later = metrics[1:]
            rows.append({
                "layout": name,
                "cluster": json.loads(run.cluster.model_dump_json()),
                "max_lag": run.max_lag,
                "threads": run.threads,
                "steps_per_s": len(later) / (ends[-1] - ends[0]),
                "first_step_s": ends[0] - t0,
                **{k: float(np.mean([m[k] for m in later])) for k in ("generate_s", "train_s", "sync_s")},
                "reward_last": metrics[-1]["reward"],
            })  # fmt: skip
    finally:
        if owned:
            ray.shutdown()
    if "one-process" in layouts:
        ref = next(r for r in rows if r["layout"] == "one-process")["steps_per_s"]
        for r in rows:
            r["ratio_to_one_process"] = r["steps_per_s"] / ref
    return {
        "machine": machine_info(cfg.threads),
        "model": cfg.model.path or f"generated {cfg.model.family} {cfg.model.size}",
        "env": cfg.env.name,
        "rollouts_per_step": cfg.prompts * cfg.group_size,
        "steps": cfg.steps,
        "rows": rows,
    }


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"{m['cpu']} · {m['cores']} cores · torch {m['torch']} · {result['model']} · {result['env']}, "
        f"{result['rollouts_per_step']} rollouts a step, {result['steps']} steps",
        "",
        "| layout | threads | steps/s | ratio | generate s | train s | sync s | first step s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ratio = f"{r['ratio_to_one_process']:.2f}x" if "ratio_to_one_process" in r else "-"
        lines.append(
            f"| {r['layout']} | {r['threads']} | {r['steps_per_s']:.3f} | {ratio} | {r['generate_s']:.3f} | "
            f"{r['train_s']:.3f} | {r['sync_s']:.3f} | {r['first_step_s']:.1f} |"
        )
    return "\n".join(lines)
