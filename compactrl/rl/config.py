"""The config of `compactrl train`: the run's parts (model, engine, env, strategy, rollout, trainer),
its objective (``[objective]``, one variant per objective: :mod:`compactrl.rl.objectives`), its
schedule and where it runs (``[cluster]``). The rules between an objective's fields and the rest
live with the objective (its ``check``); the ones here concern the run as a whole."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from compactrl.agent.batch import EVICTOR_FIELD, MODE_FIELD, ModelSource
from compactrl.agent.rollout import RolloutSettings
from compactrl.compaction import SlidingWindow, StrategyConfig
from compactrl.compaction.evictors import EvictorConfig, check_mode
from compactrl.engine import EngineConfig
from compactrl.envs import ENV_FIELD, CountConfig, EnvConfig
from compactrl.rl.monitor import LogSettings
from compactrl.rl.objectives import RL, ObjectiveConfig
from compactrl.rl.trainer import TrainSettings

# top-level fields of an earlier layout -> where they are now, in [objective]
MOVED = {k: k for k in ("advantage", "gamma", "lam", "gae_form", "normalize_std", "chance", "memory_cost",
                        "train_aux", "epochs", "minibatches")}  # fmt: skip
MOVED |= {"rft_min_reward": "min_reward", "sidequest": "traces, split, kl, adapter"}


class ClusterConfig(BaseModel):
    """``[cluster]``: where rollouts and training run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["local", "ray"] = Field(
        "local", description="local: one process (engine and trainer share the model); ray: actors"
    )
    address: str | None = Field(
        None, description="ray: the cluster to join, from one of its nodes ('auto', or 'HOST:6379'; "
        "trainer ranks reach the driver directly); unset: start a local one with this machine's CPUs"
    )  # fmt: skip
    rollout_workers: int = Field(
        0, ge=0, description="ray: engine actors that sample the RL steps' rollouts (0: the driver's engine)"
    )
    trainer_workers: int = Field(
        1, ge=1, description="data-parallel trainer ranks, the driver being rank 0 (gloo on CPU, NCCL on GPU)"
    )
    rollout_cpus: float = Field(1.0, gt=0, description="Ray CPUs per rollout worker (its torch threads)")
    rollout_gpus: float = Field(0.0, ge=0, description="Ray GPUs per rollout worker (the engine runs on it)")
    trainer_cpus: float = Field(1.0, gt=0, description="Ray CPUs per trainer rank beyond the driver")
    trainer_gpus: float = Field(0.0, ge=0, description="Ray GPUs per trainer rank beyond the driver")
    collective_timeout_s: float = Field(
        1800.0, gt=0, description="trainer ranks: the longest one waits for the others to join or reach "
        "a collective (the slowest rank's share of a step); past it the step fails instead of hanging "
        "on a rank that died or hangs"
    )  # fmt: skip
    max_restarts: int = Field(
        3, ge=0, description="rollout worker restarts allowed per step before the step fails"
    )

    @model_validator(mode="after")
    def _consistent(self):
        if self.backend == "local" and (self.rollout_workers or self.trainer_workers > 1):
            raise ValueError(
                f"cluster.rollout_workers = {self.rollout_workers} and cluster.trainer_workers = "
                f"{self.trainer_workers} need cluster.backend = 'ray' (the local backend is one process: "
                "rollout_workers = 0, trainer_workers = 1)"
            )
        if self.backend == "local" and self.address is not None:
            raise ValueError("cluster.address names a Ray cluster: set cluster.backend = 'ray' or drop it")
        if self.backend == "ray" and not self.rollout_workers and self.trainer_workers == 1:
            raise ValueError(
                "cluster.backend = 'ray' with no rollout workers and one trainer rank is one process: "
                "set cluster.rollout_workers >= 1 and/or cluster.trainer_workers >= 2, or backend = 'local'"
            )
        return self

    def requested(self) -> dict[str, float]:
        """The Ray resources the actors ask for (the driver, trainer rank 0, asks for none)."""
        ranks = self.trainer_workers - 1
        return {
            "CPU": self.rollout_workers * self.rollout_cpus + ranks * self.trainer_cpus,
            "GPU": self.rollout_workers * self.rollout_gpus + ranks * self.trainer_gpus,
        }


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelSource = ModelSource()
    engine: EngineConfig = EngineConfig()
    env: EnvConfig = Field(CountConfig(), description=ENV_FIELD)
    strategy: StrategyConfig = SlidingWindow(max_turns=3)
    evictor: EvictorConfig | None = Field(None, description=EVICTOR_FIELD)
    mode: Literal["full", "reprefill", "stream"] = Field("stream", description=MODE_FIELD)
    rollout: RolloutSettings = RolloutSettings(max_tokens=4)
    train: TrainSettings = TrainSettings(lr=3e-3)
    steps: int = Field(
        40,
        ge=1,
        description="training steps in all, the sft_steps warm-up included; each samples prompts "
        "x group_size rollouts and updates",
    )
    prompts: int = Field(4, ge=1, description="env seeds per step")
    group_size: int = Field(4, ge=1, description="rollouts per env seed")
    objective: ObjectiveConfig = Field(
        RL(), description="what the steps after the sft_steps warm-up train on (compactrl.rl.objectives)"
    )
    max_lag: int = Field(
        0,
        ge=0,
        description="0: sample each batch with the current weights; N: sample ahead in a thread, "
        "weights pushed in flight after each step, batches older than N updates dropped",
    )
    checkpoint_every: int = Field(10, ge=1, description="checkpoint every this many steps, and at the last")
    checkpoint_keep: int = Field(
        2, ge=1, description="complete checkpoints kept, the newest (older ones are deleted as new ones land)"
    )
    eval_episodes: int = Field(0, ge=0, description="greedy held-out episodes as RL starts and at the end")
    eval_every: int = Field(
        0,
        ge=0,
        description="also evaluate every this many RL steps (0: off), on the same eval_episodes; the "
        "step's metrics row gets eval_success and eval_reward, and every row has wall_s, the run's "
        "wall-clock so far with evaluations left out (a learning curve against time)",
    )
    eval_controls: list[Literal["full", "reprefill", "stream"]] = Field(
        [],
        description="also evaluate the final policy on the same held-out episodes in these modes, as "
        "controls (summary.json: eval_after_<mode>); e.g. reprefill re-reads the kept context "
        "without the evicted tokens' KV",
    )
    seed: int = Field(
        0,
        description="offset of every step's env seeds (a step's data depends only on it and the step); "
        "also seeds what the run initialises (critic, LoRA adapters)",
    )
    threads: int = Field(1, ge=1, description="torch intra-op threads")
    out: str = Field("runs/train", description="run directory (config, metrics, checkpoints)")
    log: LogSettings = LogSettings()
    cluster: ClusterConfig = Field(
        ClusterConfig(), description="where rollouts and training run: one process (local) or Ray actors"
    )
    sft_steps: int = Field(0, ge=0, description="the first steps are SFT on full-context demonstrations")
    sft_lr: float | None = Field(None, gt=0, description="learning rate of the SFT warm-up (None: train.lr)")
    sft_demos: Literal["full", "strategy"] = Field(
        "full",
        description="the warm-up's demonstrations — full: with full context; strategy: played by the "
        "rollout runner under the run's strategy and mode, the env writing every answer (its "
        "demo_action, and demo_summary for summaries), so SFT sees the compacted layout RL samples",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data):
        """An earlier layout's top-level objective fields: say where they went."""
        if not isinstance(data, dict):
            return data
        old = [k for k in MOVED if k in data] + (
            ["objective"] if isinstance(data.get("objective"), str) else []
        )
        if old:
            where = "; ".join(f"{k} -> objective.{MOVED.get(k, 'name')}" for k in old)
            raise ValueError(
                f"{', '.join(old)}: these are fields of the [objective] section now ({where}); e.g. "
                '[objective] name = "rl", advantage = "loo" in the file, or --set objective.advantage=loo'
            )
        return data

    @model_validator(mode="after")
    def _consistent(self):
        check_mode(self.evictor, self.mode)
        if self.eval_every and not self.eval_episodes:
            raise ValueError(f"eval_every = {self.eval_every} needs eval_episodes > 0 (how many to play)")
        if self.sft_steps > self.steps:
            raise ValueError(f"sft_steps {self.sft_steps} > steps {self.steps}: steps counts SFT steps too")
        if getattr(self.strategy, "thread_adapter", None) and self.objective.name != "rl":
            raise ValueError(
                f"strategy.thread_adapter (a trained thread adapter, frozen) is for objective.name = 'rl', "
                f"not {self.objective.name!r}: objective 'sidequest' trains its own thread adapter"
            )
        self.objective.check(self)
        r = self.rollout
        if r.temperature <= 0 or r.top_p < 1.0 or r.top_k > 0:
            raise ValueError(
                "training needs rollouts sampled from the whole (optionally tempered) distribution: "
                "rollout.temperature > 0, top_p = 1, top_k = 0 (the trainer's log-probs are untruncated)"
            )
        return self
