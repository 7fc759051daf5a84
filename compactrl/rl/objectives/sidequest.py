"""``sidequest``: SideQuest's fine-tune. Each step plays ``prompts`` episodes with full context,
labels the correct ones' auxiliary-thread samples in hindsight (:mod:`compactrl.rl.sidequest`) and
trains CE on them plus ``kl`` x KL(reference || policy) on the main traces (the reference: the
frozen policy as the phase began), each part normalised over its own tokens. The thread's spacing
and trigger are the run's ``[strategy]`` (name = "sidequest")."""

from __future__ import annotations

import asyncio
import random
from typing import ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from compactrl.agent.batch import run_episodes
from compactrl.compaction import SideQuestConfig
from compactrl.envs import make_env
from compactrl.rl.objectives.base import Run, env_seeds, has_demos, in_loop_only, no_update
from compactrl.rl.sidequest import hindsight_samples
from compactrl.rl.trainer import Sample


class SideQuest(BaseModel):
    """Where the correct traces come from and how they are labelled."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    anchored: ClassVar[bool] = True
    rollouts: ClassVar[bool] = False

    name: Literal["sidequest"] = "sidequest"
    traces: Literal["solver", "policy"] = Field(
        "solver", description="solver: the env's demonstrations (played by the runner, full context); "
        "policy: the policy's own full-context rollouts that score 1"
    )  # fmt: skip
    split: Literal["random", "history"] = Field(
        "random", description="D/S split of the expired cursors — random: the paper's; history: D = "
        "what expired at earlier calls (what a perfect thread would already have deleted)"
    )  # fmt: skip
    kl: float = Field(500.0, ge=0, description="lambda of the KL term (the paper's 500): top-k "
                      "coarse-grained KL (train.distill_top_k), a lower bound on the exact one")  # fmt: skip
    adapter: Literal["all", "thread"] = Field(
        "all", description="all: the paper's, one adapter for both threads (the KL keeps the main "
        "thread near the base); thread: the adapters act on the auxiliary thread's tokens only, so the "
        "main thread is the base exactly (kl = 0) and the thread reads the KV the base wrote; roll it "
        "out with strategy.thread_adapter = <checkpoint>"
    )  # fmt: skip

    def check(self, cfg) -> None:
        if not isinstance(cfg.strategy, SideQuestConfig):
            raise ValueError(
                "objective.name = 'sidequest' trains the auxiliary thread the [strategy] calls: set "
                "strategy.name = 'sidequest' (its every and trigger are used for the labels)"
            )
        if self.adapter == "thread":
            if not cfg.train.lora:
                raise ValueError("objective.adapter = 'thread' gates LoRA adapters: set train.lora")
            if self.kl:
                raise ValueError(
                    "objective.adapter = 'thread' leaves the main thread the base model exactly: there "
                    "is nothing for the KL to anchor; set objective.kl = 0"
                )
        in_loop_only(cfg, self.name)

    def step(self, run: Run, step: int) -> dict:
        cfg, fmt = run.cfg, run.fmt
        strategy = cfg.strategy  # its config: the thread's spacing, trigger and fork layout
        demo = self.traces == "solver"
        if demo and not has_demos(cfg):
            raise ValueError(f"objective.traces = 'solver' needs the {cfg.env.name} env's demo_action()")
        make = lambda: make_env(cfg.env)  # noqa: E731
        seeds = env_seeds(cfg, step)
        played = run_episodes(run.engine, fmt, make, None, "full", cfg.rollout, seeds, len(seeds), demo=demo)
        results = asyncio.run(played)
        main = [r.traces[0] for r in results if r.reward >= 1.0 and r.error is None]
        labels = random.Random(f"sidequest/{cfg.seed}/{step}")  # the same split when resumed
        fork = {"at": strategy.at, "keep_calls": strategy.keep_calls, "keep_titles": strategy.keep_titles}
        every, trigger = strategy.every, strategy.trigger
        aux = [x for t in main for x in hindsight_samples(t, fmt, every, labels, self.split, trigger, **fork)]
        out = {"step": step, "phase": "sidequest", "correct": len(main) / len(results)}
        out["aux_samples"] = len(aux)
        if not aux:
            return out | no_update()
        zero = lambda t: np.zeros(len(t), np.float32)  # noqa: E731
        parts = [([Sample(t, zero(t), i) for i, t in enumerate(aux)], "sft", 1.0)]
        if self.kl:
            parts.append(([Sample(t, zero(t), i) for i, t in enumerate(main)], "distill", self.kl))
        stats, extra = run.trainer.step_parts(parts)
        kl = stats[1]["loss"] if self.kl else 0.0
        return out | {"loss": stats[0]["loss"] + self.kl * kl, "aux_ce": stats[0]["loss"], "main_kl": kl,
                      "trained_tokens": stats[0]["trained_tokens"], **extra}  # fmt: skip
