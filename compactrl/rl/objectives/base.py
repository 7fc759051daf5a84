"""What every training objective is given, and what it gives back to the loop.

An objective is its own ``[objective]`` config class (kvpress's shape: one small class per method)
with three parts the loop calls: ``check(cfg)`` (the rules between its fields and the rest of the
run's config), ``step(run, step)`` (play what it trains on, update, return the step's metrics row),
and two class flags, ``anchored`` (it needs the frozen reference: distillation's teacher,
SideQuest's KL) and ``rollouts`` (it trains on sampled batches, which a background sampler or
rollout workers may serve).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from compactrl.agent.chat import ChatFormat
from compactrl.engine import Engine
from compactrl.envs import make_env
from compactrl.rl.trainer import Trainer


@dataclass
class Run:
    """What a training step works with, built once by ``rl/loop.py``."""

    cfg: Any  # the run's TrainConfig
    engine: Engine
    fmt: ChatFormat
    strategy: Any  # the built compaction strategy (None: full context)
    trainer: Trainer
    sampler: Any = None  # a LagBounded sampler when batches are sampled ahead or on rollout workers


class Objective(Protocol):
    name: str
    anchored: ClassVar[bool]
    rollouts: ClassVar[bool]

    def check(self, cfg) -> None: ...

    def step(self, run: Run, step: int) -> dict: ...


def env_seeds(cfg, step: int) -> list[int]:
    """The env seeds of a step that plays them in the loop (its data depends only on seed and step)."""
    return [cfg.seed + (step - 1) * cfg.prompts + j for j in range(cfg.prompts)]


def no_update() -> dict:
    """A step with nothing to train on (no rollout over RFT's bar, no SideQuest label)."""
    zero = ("loss", "trained_tokens", "mismatch_kl", "mismatch_max_abs", "clip_fraction", "masked_fraction",
            "value_loss", "ref_kl", "entropy", "grad_norm", "train_s")  # fmt: skip
    return dict.fromkeys(zero, 0.0) | {"updates": 0}


def has_demos(cfg) -> bool:
    """Whether the run's env writes demonstrations (``demo_action``); the env made to ask is closed
    (one may hold a process: a browser, a game)."""
    env = make_env(cfg.env)
    try:
        return hasattr(env, "demo_action")
    finally:
        env.close()


def in_loop_only(cfg, name: str) -> None:
    """Objectives that play on the driver's engine inside the step: no rollout workers, no sampling ahead."""
    if cfg.cluster.rollout_workers or cfg.max_lag:
        raise ValueError(
            f"cluster.rollout_workers and max_lag sample the RL steps' rollouts; objective {name!r} plays "
            "demonstrations on the driver's engine: set cluster.rollout_workers = 0 and max_lag = 0"
        )
