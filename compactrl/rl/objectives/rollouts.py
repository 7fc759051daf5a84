"""Objectives that train on the run's own sampled rollouts: ``rl`` (policy gradient with a group,
leave-one-out or GAE baseline), ``rft`` (SFT on the rollouts over a bar) and ``distill`` (KL from
the frozen full-context reference to the policy under its evictions).

Each step takes a batch (sampled now, or ahead by the background sampler or rollout workers),
turns episode rewards into per-token advantages (every segment of a re-prefill rollout; SideQuest's
threads with their episode's), and takes ``epochs`` x ``minibatches`` optimizer steps.
"""

from __future__ import annotations

import time
from typing import ClassVar, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from compactrl.agent.rollout import EpisodeResult
from compactrl.compaction import SideQuestConfig
from compactrl.rl.advantages import (
    cross_segment_gae,
    discounts,
    fork_discounts,
    group_advantages,
    loo_advantages,
)
from compactrl.rl.forward import stream_logprobs
from compactrl.rl.objectives.base import Run, no_update
from compactrl.rl.sampler import sample_batch
from compactrl.rl.trainer import Sample, Trainer


class OnRollouts(BaseModel):
    """The fields and the step the three rollout objectives share."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    anchored: ClassVar[bool] = False
    rollouts: ClassVar[bool] = True
    loss: ClassVar[str]

    train_aux: bool = Field(
        True, description="strategy.name = 'sidequest': train the auxiliary threads' tokens too, with their "
        "episode's advantage (spliced into the main trace's forward); false: the main thread's only, the "
        "threads' deletions taken as the environment's (a partial gradient: the threads still run the "
        "policy's adapters, untrained)"
    )  # fmt: skip
    epochs: int = Field(1, ge=1, description="passes over each sampled batch (PPO epochs)")
    minibatches: int = Field(
        1,
        ge=1,
        description="optimizer steps per pass: the batch's rollouts split into this many minibatches, "
        "each clipped against the sampling log-probs",
    )

    def check(self, cfg) -> None:
        if self.minibatches > cfg.prompts * cfg.group_size:
            raise ValueError(
                f"objective.minibatches = {self.minibatches} > the {cfg.prompts * cfg.group_size} rollouts "
                "of a step (prompts x group_size); lower minibatches or raise prompts"
            )
        if not self.train_aux and not isinstance(cfg.strategy, SideQuestConfig):
            raise ValueError(
                "objective.train_aux = false leaves SideQuest's auxiliary threads out of the updates (with "
                "strategy.name = 'sidequest'); this run trains none: remove it"
            )

    def advantages(self, cfg, results: list[EpisodeResult]) -> np.ndarray:
        """One advantage per rollout; rft and distill weigh every kept rollout alike."""
        return np.zeros(len(results))

    def keep(self, r: EpisodeResult) -> bool:
        return True

    def discount(self) -> float:
        """Per action token (rl's ``gamma``); rft and distill weigh every token alike."""
        return 1.0

    def samples(self, run: Run, results: list[EpisodeResult]) -> list[Sample]:
        """Each rollout's advantage on all its trainable tokens (every segment of a re-prefill
        rollout), discounted by ``gamma`` per later action token; its acted threads likewise."""
        samples = []
        for i, (r, a) in enumerate(zip(results, self.advantages(run.cfg, results), strict=True)):
            if not self.keep(r):
                continue
            credit = discounts([t.trainable for t in r.traces], self.discount())
            samples += [Sample(t, a * w, i) for t, w in zip(r.traces, credit, strict=True)]
            if self.train_aux:
                samples += thread_samples(r, a, i, self.discount())
        return samples

    def step(self, run: Run, step: int) -> dict:
        """Take a batch (sampled now, or ahead by the sampler), compute advantages, update, and hand
        the new weights to the sampler's engine."""
        cfg, sampler, t0 = run.cfg, run.sampler, time.perf_counter()
        lag = dropped = 0
        faults = {}
        if sampler is None:
            results = sample_batch(cfg, run.engine, run.fmt, run.strategy, step)
        else:
            batch, dropped = sampler.get()
            results, lag = batch.results, sampler.pushed - batch.version
            if cfg.cluster.rollout_workers:
                faults = {"worker_restarts": batch.restarts, "rerun_episodes": batch.rerun}
        t1 = time.perf_counter()
        rewards = np.array([r.reward for r in results])
        samples = self.samples(run, results)
        stats = self.updates(cfg.seed, run.trainer, samples, step) if samples else no_update()
        t2 = time.perf_counter()
        if sampler is not None:
            sampler.push(run.trainer.model)
        return {
            "step": step,
            "phase": "rl",
            "reward": float(rewards.mean()),
            "reward_max": float(rewards.max()),
            "errors": sum(r.error is not None for r in results),
            "turns": float(np.mean([r.turns for r in results])),
            "tokens": float(np.mean([r.tokens for r in results])),
            "compactions": float(np.mean([r.compactions for r in results])),
            "reprefilled_tokens": float(np.mean([r.reprefilled_tokens for r in results])),
            "peak_kv": float(np.mean([r.peak_kv_with_threads for r in results])),  # with auxiliary threads
            **rewards_by_hops(results, rewards),
            **{k: v for k, v in stats.items() if k != "train_s"},
            "generate_s": t1 - t0,  # with a background sampler: the wait for its batch
            "train_s": stats["train_s"],
            "sync_s": time.perf_counter() - t2,  # 0 when the engine shares the trainer's model
            "lag": lag,
            "dropped_batches": dropped,
            **faults,
        }

    def updates(self, seed: int, trainer: Trainer, samples: list[Sample], step: int) -> dict:
        """``epochs`` passes over the batch, each split into ``minibatches`` optimizer steps (rollouts
        shuffled per pass, seeded by the step). Reports the first update's statistics (its mismatch
        is the sampler's against the weights that sampled), with loss and clip fraction averaged."""
        rollouts = sorted({s.sequence for s in samples})
        rng = np.random.default_rng([seed, step])
        parts = min(self.minibatches, len(rollouts))
        runs = []
        for _ in range(self.epochs):
            order = rng.permutation(rollouts) if parts > 1 else rollouts
            for part in np.array_split(np.asarray(order), parts):
                chosen = set(part.tolist())
                runs.append(trainer.step([s for s in samples if s.sequence in chosen], self.loss))
        stats = dict(runs[0])
        for k in ("loss", "clip_fraction", "grad_norm"):
            stats[k] = float(np.mean([r[k] for r in runs]))
        stats["trained_tokens"] = sum(r["trained_tokens"] for r in runs[:parts])  # one pass over the batch
        stats["train_s"] = sum(r["train_s"] for r in runs)
        stats["updates"] = len(runs)
        return stats


class RL(OnRollouts):
    """Policy gradient on the run's rollouts (PPO-clipped against the sampling log-probs)."""

    name: Literal["rl"] = "rl"
    loss: ClassVar[str] = "pg"
    advantage: Literal["group", "loo", "gae"] = Field(
        "group",
        description="the baseline — group: reward minus the mean of its env seed's group (GRPO); loo: "
        "minus the mean of every other rollout of the batch; gae: a critic and GAE over the rollout (PPO)",
    )
    gamma: float = Field(
        1.0,
        ge=0,
        le=1,
        description="discount per action token (group/loo: a token's advantage times gamma ** the "
        "rollout's action tokens after it)",
    )
    lam: float = Field(0.95, ge=0, le=1, description="gae: lambda")
    gae_form: Literal["exact", "parallel"] = Field("exact", description="gae across re-prefill segments")
    normalize_std: bool = Field(
        True, description="group: divide advantages by their group's reward std; gae: whiten over the batch"
    )
    chance: float | None = Field(None, ge=0, le=1, description="loo: score all-equal batches against this")
    memory_cost: float = Field(
        0.0, ge=0, description="an episode's advantage is computed from its reward minus this x its peak KV "
        "with its auxiliary threads, in thousands of tokens (a price on memory; 0: the reward alone)"
    )  # fmt: skip

    @model_validator(mode="after")
    def _priced(self):
        if self.memory_cost and self.advantage == "gae":
            raise ValueError(
                "objective.memory_cost prices the episode's peak KV into its reward for advantage = "
                "'group' or 'loo' (gae's rewards are per step); set memory_cost = 0"
            )
        return self

    def discount(self) -> float:
        return self.gamma

    def check(self, cfg) -> None:
        super().check(cfg)
        if getattr(cfg.strategy, "thread_adapter", None) and (
            not cfg.train.lora or cfg.cluster.rollout_workers
        ):
            raise ValueError(
                "RL under a frozen thread adapter trains the policy's own LoRA on the driver's "
                "engine: set train.lora and cluster.rollout_workers = 0"
            )
        if self.advantage == "gae" and isinstance(cfg.strategy, SideQuestConfig):
            raise ValueError(
                "objective.advantage = 'gae' values the main thread only; SideQuest's auxiliary threads "
                "train with the episode's advantage: use advantage = 'group' or 'loo'"
            )

    def advantages(self, cfg, results: list[EpisodeResult]) -> np.ndarray:
        return step_advantages(self, priced_rewards(self, results), cfg.group_size)

    def samples(self, run: Run, results: list[EpisodeResult]) -> list[Sample]:
        if self.advantage == "gae":
            return gae_samples(self, run.trainer.model, run.trainer.value_head, results)
        return super().samples(run, results)


class RFT(OnRollouts):
    """Rejection-sampling fine-tuning: SFT on the run's rollouts that score at least ``min_reward``."""

    name: Literal["rft"] = "rft"
    loss: ClassVar[str] = "sft"
    min_reward: float = Field(1.0, description="rollouts scoring below this are not trained on")

    def keep(self, r: EpisodeResult) -> bool:
        return r.reward >= self.min_reward


class Distill(OnRollouts):
    """KL from the frozen full-context reference (the policy as the phase begins) to the policy under
    the evictions, on its own rollouts: the teacher is the same rollout without its evictions."""

    name: Literal["distill"] = "distill"
    loss: ClassVar[str] = "distill"
    anchored: ClassVar[bool] = True

    def check(self, cfg) -> None:
        super().check(cfg)
        if cfg.mode != "stream":
            raise ValueError(
                "objective.name = 'distill' needs mode = 'stream': "
                "the teacher is the same rollout without its evictions"
            )
        if cfg.train.kl_ref and cfg.train.kl_ref_estimator == "topk":
            raise ValueError(
                "train.kl_ref_estimator = 'topk' anchors policy-gradient steps; objective 'distill' "
                "already learns from the reference's top-k: use the k3 estimator or kl_ref = 0"
            )


def priced_rewards(objective: RL, results) -> np.ndarray:
    """What rl's advantages are computed from: each episode's reward, less ``memory_cost`` per
    thousand tokens of its peak KV (the main thread's and its auxiliary threads' together)."""
    return np.array([r.reward - objective.memory_cost * r.peak_kv_with_threads / 1000 for r in results])


def step_advantages(objective: RL, rewards: np.ndarray, group_size: int) -> np.ndarray:
    r = torch.as_tensor(rewards, dtype=torch.float32)
    if objective.advantage == "loo":
        return loo_advantages(r, objective.chance).numpy()
    groups = torch.arange(len(r)) // group_size
    return group_advantages(r, groups, objective.normalize_std).numpy()


def gae_samples(objective: RL, model, head, results) -> list[Sample]:
    """PPO samples: per-step rewards on action tokens, the critic's values from the one-pass
    forward, and GAE across the whole rollout (cross-segment for re-prefill segments)."""
    samples = []
    for i, r in enumerate(results):
        with torch.no_grad():
            _, values = stream_logprobs(model, r.traces, value_head=head)
        segs = [
            (torch.from_numpy(rw), v.float(), torch.as_tensor(t.trainable))
            for rw, v, t in zip(r.token_rewards(), values, r.traces, strict=True)
        ]
        gaes = cross_segment_gae(segs, objective.gamma, objective.lam, objective.gae_form)
        for t, (adv, ret), v in zip(r.traces, gaes, values, strict=True):
            samples.append(Sample(t, adv.numpy(), i, ret.numpy(), v.numpy()))
    if objective.normalize_std:  # the usual PPO advantage whitening, over the batch's action tokens
        flat = np.concatenate([s.advantages[s.trace.trainable] for s in samples])
        mean, std = flat.mean(), flat.std() + 1e-6
        for s in samples:
            s.advantages = np.where(s.trace.trainable, (s.advantages - mean) / std, 0.0).astype(np.float32)
    return samples


def thread_samples(r: EpisodeResult, advantage: float, sequence: int, gamma: float) -> list[Sample]:
    """SideQuest's auxiliary threads share their episode's outcome: each is trained with the
    advantage of the episode it shaped (its own tokens only are trainable), discounted as the main
    thread's tokens are from its fork on. A thread still running when the episode ended
    (``unfinished``) deleted nothing: it is left out."""
    acted = [t for t in r.aux_traces if not t.meta.get("unfinished")]
    forks = [(t.meta.get("segment", 0), t.meta["fork_at"]) for t in acted]
    weights = fork_discounts([t.trainable for t in r.traces], forks, gamma)
    return [Sample(t, np.full(len(t), advantage * w, np.float32), sequence) for t, w in zip(acted, weights)]


def rewards_by_hops(results, rewards: np.ndarray) -> dict:
    """``reward_hops{n}``: the step's mean reward over its episodes of n hops, for envs that say
    (browse): a batch of mixed difficulty can gain on the easy questions while losing the hard."""
    hops = np.array([r.info.get("hops", -1) for r in results])
    return {f"reward_hops{h}": float(rewards[hops == h].mean()) for h in sorted(set(hops) - {-1})}
