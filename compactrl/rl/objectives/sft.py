"""``sft``: supervised fine-tuning on demonstrations, the objective and the run's warm-up
(``sft_steps``). Full-context demonstrations from the env's solver, with the ``evict_steps``
strategy's evictions replayed after the warm-up; or, with ``sft_demos = "strategy"``, played by
the rollout runner under the run's strategy and mode, so SFT sees the compacted layout RL samples."""

from __future__ import annotations

import asyncio
from typing import ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from compactrl.agent.batch import run_episodes
from compactrl.envs import make_env
from compactrl.rl.demos import demo_trace
from compactrl.rl.objectives.base import Run, env_seeds, has_demos, in_loop_only
from compactrl.rl.trainer import Sample


class SFT(BaseModel):
    """SFT on demonstrations (``sft_demos`` says which) for every step."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    anchored: ClassVar[bool] = False
    rollouts: ClassVar[bool] = False

    name: Literal["sft"] = "sft"

    def check(self, cfg) -> None:
        if cfg.strategy.name != "evict_steps" and cfg.sft_demos == "full":
            raise ValueError(
                "objective.name = 'sft' replays the evict_steps strategy on full-context demonstrations; "
                "set strategy.name = 'evict_steps', or sft_demos = 'strategy' (demonstrations played "
                "under the run's strategy)"
            )
        in_loop_only(cfg, self.name)

    def step(self, run: Run, step: int) -> dict:
        cfg, fmt = run.cfg, run.fmt
        if not has_demos(cfg):
            raise ValueError(f"sft_steps needs demonstrations; the {cfg.env.name} env has no demo_action()")
        evicted = step > cfg.sft_steps
        seeds = [s * cfg.group_size + g for s in env_seeds(cfg, step) for g in range(cfg.group_size)]
        if cfg.sft_demos == "strategy":
            make = lambda: make_env(cfg.env)  # noqa: E731
            played = run_episodes(
                run.engine, fmt, make, run.strategy, cfg.mode, cfg.rollout, seeds, len(seeds),
                demo=True, evictor=cfg.evictor,
            )  # fmt: skip
            results = asyncio.run(played)
            failed = [r for r in results if r.error or r.truncated]
            if failed:
                raise ValueError(f"a demonstration (env seed {failed[0].seed}) did not finish: "
                                 f"{failed[0].error or 'truncated at rollout.max_turns'}")  # fmt: skip
            traces = [(t, i) for i, r in enumerate(results) for t in r.traces]  # reprefill: a trace a segment
        else:
            evict = {cfg.strategy.at_step: list(cfg.strategy.steps)} if evicted else None
            env = make_env(cfg.env)
            try:
                system = cfg.rollout.system
                traces = [(demo_trace(fmt, env, s, evict, system), i) for i, s in enumerate(seeds)]
            finally:
                env.close()
        samples = [Sample(t, np.zeros(len(t), np.float32), i) for t, i in traces]
        stats = run.trainer.step(samples, loss="sft")
        keep = ("loss", "grad_norm", "trained_tokens", "train_s")
        return {"step": step, "phase": "sft_evicted" if evicted else "sft", **{k: stats[k] for k in keep}}
