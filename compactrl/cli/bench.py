"""`compactrl bench`: the group, its commands in the order `--help` lists them."""

from __future__ import annotations

import typer

from compactrl.cli import bench_inference, bench_rollout, bench_training
from compactrl.cli.common import PLAIN

app = typer.Typer(help="Benchmarks (ratios measured side by side in one run).", **PLAIN)
for name, command in (
    ("trainer", bench_training.bench_trainer),
    ("train-step", bench_training.bench_train_step),
    ("trainer-hf", bench_training.bench_trainer_hf),
    ("engine", bench_inference.bench_engine),
    ("evictors", bench_rollout.bench_evictors),
    ("memory", bench_rollout.bench_memory),
    ("serve", bench_inference.bench_serve),
    ("serve-episodes", bench_inference.bench_serve_episodes),
    ("scale", bench_training.bench_scale),
    ("modes", bench_rollout.bench_modes),
):
    app.command(name)(command)
