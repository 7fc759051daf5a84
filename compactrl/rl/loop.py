"""`compactrl train CONFIG`: sample with the engine, train, repeat — on one shared model.

Each step runs ``prompts`` env seeds x ``group_size`` rollouts (one group per seed, different
sampling seeds) through the engine with the config's strategy and mode, turns episode rewards
into advantages (``group``: GRPO; ``loo``: leave-one-out with an optional chance-level
fallback), broadcasts each rollout's advantage to all its trainable tokens (every segment of a
re-prefill rollout; discounted by ``gamma`` per later action token), and takes ``epochs`` x
``minibatches`` optimizer steps (one by default). The engine and the trainer share the model
object, so the update reaches the engine in place with nothing to copy (the engine's fused
projection reads views of the same parameters); by default sampling is synchronous, so rollouts
are never stale (``max_lag`` samples ahead: ``rl/sampler.py``). Metrics go to ``metrics.jsonl``
(and TensorBoard when installed); checkpoints go to ``checkpoints/`` and ``--resume`` continues
from the newest exactly: the data of step N depends only on N and the seed. A ``[cluster]`` section
(``backend = "ray"``) samples the RL steps on rollout worker actors and trains on data-parallel
ranks with the driver as rank 0 (:mod:`compactrl.cluster`); the loop is the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from compactrl.agent.batch import ModelSource, load_engine, run_episodes
from compactrl.agent.chat import ChatFormat
from compactrl.agent.rollout import EpisodeResult, RolloutSettings
from compactrl.cluster import ClusterConfig, connect
from compactrl.compaction import SideQuestConfig, SlidingWindow, StrategyConfig, build_strategy
from compactrl.compaction.evictors import EvictorConfig, check_mode
from compactrl.engine import EngineConfig
from compactrl.envs import ENV_FIELD, CountConfig, EnvConfig, make_env
from compactrl.envs.base import HELD_OUT_SEED
from compactrl.models.loading import load_model, save_model
from compactrl.models.lora import Adapters, gate_adapters, load_thread_adapter
from compactrl.provenance import provenance
from compactrl.rl.advantages import (
    cross_segment_gae,
    discounts,
    fork_discounts,
    group_advantages,
    loo_advantages,
)
from compactrl.rl.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    remove_partial_writes,
    resolve_checkpoint,
    save_checkpoint,
)
from compactrl.rl.critic import ValueHead
from compactrl.rl.demos import demo_trace
from compactrl.rl.forward import stream_logprobs
from compactrl.rl.monitor import LogSettings, Monitor, check_log_settings, note
from compactrl.rl.run_dir import RunDirError, open_run_dir
from compactrl.rl.sampler import BackgroundSampler, sample_batch
from compactrl.rl.sidequest import hindsight_samples
from compactrl.rl.trainer import Sample, Trainer, TrainSettings
from compactrl.stats import mean_ci
from compactrl.trace import save_traces


class SideQuestTrain(BaseModel):
    """objective = "sidequest": where the correct traces come from and how they are labelled; the
    auxiliary thread's spacing and trigger are the run's ``[strategy]`` (name = "sidequest")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelSource = ModelSource()
    engine: EngineConfig = EngineConfig()
    env: EnvConfig = Field(CountConfig(), description=ENV_FIELD)
    strategy: StrategyConfig = SlidingWindow(max_turns=3)
    evictor: EvictorConfig | None = Field(
        None,
        description="a token evictor the engine runs in stream mode (h2o, snapkv, rkv, streamingllm, tova, "
        "knorm, random; see compactrl.compaction.evictors), alone or with the strategy",
    )
    mode: Literal["full", "reprefill", "stream"] = Field(
        "stream",
        description="full: no compaction; stream: compaction evicts KV in place, one trace per "
        "episode; reprefill: the kept context is prefilled again, one trace per segment",
    )
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
    objective: Literal["rl", "rft", "distill", "sft", "sidequest"] = Field(
        "rl",
        description="after the sft_steps warm-up — rl: policy gradient with `advantage`; rft: SFT on "
        "rollouts scoring >= rft_min_reward; distill: KL from the frozen full-context reference (the "
        "policy as the phase begins) to the policy under the evictions, on its own rollouts; sft: "
        "demonstrations under the evict_steps strategy's evictions; sidequest: CE on hindsight-labelled "
        "auxiliary-thread samples + sidequest.kl x KL(reference || policy) on the main traces",
    )
    sidequest: SideQuestTrain = SideQuestTrain()
    rft_min_reward: float = Field(1.0, description="rft: rollouts scoring below this are not trained on")
    memory_cost: float = Field(
        0.0, ge=0, description="rl: an episode's advantage is computed from its reward minus this x its peak "
        "KV with its auxiliary threads, in thousands of tokens (a price on memory; 0: the reward alone)"
    )  # fmt: skip
    train_aux: bool = Field(
        True, description="strategy.name = 'sidequest' (objective rl, rft, distill): train the auxiliary "
        "threads' tokens too, with their episode's advantage (spliced into the main trace's forward); "
        "false: the main thread's only, the threads' deletions taken as the environment's (a partial "
        "gradient: the threads still run the policy's adapters, untrained)"
    )  # fmt: skip
    advantage: Literal["group", "loo", "gae"] = Field(
        "group",
        description="rl's baseline — group: reward minus the mean of its env seed's group (GRPO); loo: "
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
    max_lag: int = Field(
        0,
        ge=0,
        description="0: sample each batch with the current weights; N: sample ahead in a thread, "
        "weights pushed in flight after each step, batches older than N updates dropped",
    )
    epochs: int = Field(1, ge=1, description="rl/rft/distill: passes over each sampled batch (PPO epochs)")
    minibatches: int = Field(
        1,
        ge=1,
        description="optimizer steps per pass: the batch's rollouts split into this many minibatches, "
        "each clipped against the sampling log-probs",
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

    @model_validator(mode="after")
    def _sft(self):
        check_mode(self.evictor, self.mode)
        if self.eval_every and not self.eval_episodes:
            raise ValueError(f"eval_every = {self.eval_every} needs eval_episodes > 0 (how many to play)")
        if self.sft_steps > self.steps:
            raise ValueError(f"sft_steps {self.sft_steps} > steps {self.steps}: steps counts SFT steps too")
        if self.objective == "sft" and self.strategy.name != "evict_steps" and self.sft_demos == "full":
            raise ValueError(
                "objective = 'sft' replays the evict_steps strategy on full-context demonstrations; "
                "set strategy.name = 'evict_steps', or sft_demos = 'strategy' (demonstrations played "
                "under the run's strategy)"
            )
        return self

    @model_validator(mode="after")
    def _objective(self):
        if self.objective == "distill" and self.mode != "stream":
            raise ValueError(
                "objective = 'distill' needs mode = 'stream': "
                "the teacher is the same rollout without its evictions"
            )
        if self.objective == "distill" and self.train.kl_ref and self.train.kl_ref_estimator == "topk":
            raise ValueError(
                "train.kl_ref_estimator = 'topk' anchors policy-gradient steps; objective 'distill' "
                "already learns from the reference's top-k: use the k3 estimator or kl_ref = 0"
            )
        if self.minibatches > self.prompts * self.group_size:
            raise ValueError(
                f"minibatches = {self.minibatches} > the {self.prompts * self.group_size} rollouts of a "
                "step (prompts x group_size); lower minibatches or raise prompts"
            )
        if self.objective == "sidequest" and not isinstance(self.strategy, SideQuestConfig):
            raise ValueError(
                "objective = 'sidequest' trains the auxiliary thread the [strategy] calls: set "
                "strategy.name = 'sidequest' (its every and trigger are used for the labels)"
            )
        if self.objective == "sidequest" and self.sidequest.adapter == "thread":
            if not self.train.lora:
                raise ValueError("sidequest.adapter = 'thread' gates LoRA adapters: set train.lora")
            if self.sidequest.kl:
                raise ValueError(
                    "sidequest.adapter = 'thread' leaves the main thread the base model exactly: there "
                    "is nothing for the KL to anchor; set sidequest.kl = 0"
                )
        if isinstance(self.strategy, SideQuestConfig) and self.strategy.thread_adapter:
            if self.objective != "rl":
                raise ValueError(
                    f"strategy.thread_adapter (a trained thread adapter, frozen) is for objective = 'rl', "
                    f"not {self.objective!r}: objective 'sidequest' trains its own thread adapter"
                )
            if not self.train.lora or self.cluster.rollout_workers:
                raise ValueError(
                    "RL under a frozen thread adapter trains the policy's own LoRA on the driver's "
                    "engine: set train.lora and cluster.rollout_workers = 0"
                )
        if not self.train_aux and (
            self.objective in ("sft", "sidequest") or not isinstance(self.strategy, SideQuestConfig)
        ):
            raise ValueError(
                "train_aux = false leaves SideQuest's auxiliary threads out of the updates on the run's "
                "own rollouts (objective rl, rft or distill with strategy.name = 'sidequest'); this run "
                "trains none: remove it"
            )
        if self.memory_cost and (self.objective != "rl" or self.advantage == "gae"):
            raise ValueError(
                "memory_cost prices the episode's peak KV into its reward for objective = 'rl' with "
                "advantage = 'group' or 'loo' (gae's rewards are per step); set memory_cost = 0"
            )
        if self.advantage == "gae" and isinstance(self.strategy, SideQuestConfig):
            raise ValueError(
                "advantage = 'gae' values the main thread only; SideQuest's auxiliary threads train "
                "with the episode's advantage: use advantage = 'group' or 'loo'"
            )
        if self.cluster.rollout_workers and self.objective in ("sft", "sidequest"):
            raise ValueError(
                f"cluster.rollout_workers sample the RL steps' rollouts; objective {self.objective!r} plays "
                "demonstrations on the driver's engine: set cluster.rollout_workers = 0"
            )
        if self.objective != "rl" and self.advantage == "gae":
            raise ValueError(f"advantage = 'gae' trains a critic for objective 'rl', not {self.objective!r}")
        return self

    @model_validator(mode="after")
    def _sampled(self):
        r = self.rollout
        if r.temperature <= 0 or r.top_p < 1.0 or r.top_k > 0:
            raise ValueError(
                "training needs rollouts sampled from the whole (optionally tempered) distribution: "
                "rollout.temperature > 0, top_p = 1, top_k = 0 (the trainer's log-probs are untruncated)"
            )
        return self


def priced_rewards(cfg: TrainConfig, results) -> np.ndarray:
    """What rl's advantages are computed from: each episode's reward, less ``memory_cost`` per
    thousand tokens of its peak KV (the main thread's and its auxiliary threads' together)."""
    return np.array([r.reward - cfg.memory_cost * r.peak_kv_with_threads / 1000 for r in results])


def step_advantages(cfg: TrainConfig, rewards: np.ndarray) -> np.ndarray:
    r = torch.as_tensor(rewards, dtype=torch.float32)
    if cfg.advantage == "loo":
        return loo_advantages(r, cfg.chance).numpy()
    groups = torch.arange(len(r)) // cfg.group_size
    return group_advantages(r, groups, cfg.normalize_std).numpy()


def _gae_samples(cfg: TrainConfig, model, head: ValueHead, results) -> list[Sample]:
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
        gaes = cross_segment_gae(segs, cfg.gamma, cfg.lam, cfg.gae_form)
        for t, (adv, ret), v in zip(r.traces, gaes, values, strict=True):
            samples.append(Sample(t, adv.numpy(), i, ret.numpy(), v.numpy()))
    if cfg.normalize_std:  # the usual PPO advantage whitening, over the batch's action tokens
        flat = np.concatenate([s.advantages[s.trace.trainable] for s in samples])
        mean, std = flat.mean(), flat.std() + 1e-6
        for s in samples:
            s.advantages = np.where(s.trace.trainable, (s.advantages - mean) / std, 0.0).astype(np.float32)
    return samples


def _reference(cfg: TrainConfig, model, run_dir: Path, fresh: bool):
    """The frozen reference of ``train.kl_ref`` and the distillation teacher: the policy as RL begins,
    kept in ``run_dir/reference`` so that a resumed run penalises the distance to the same model."""
    folder = run_dir / "reference"
    if fresh:
        tmp = Path(tempfile.mkdtemp(dir=run_dir, prefix=".reference-"))
        save_model(model, tmp)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    elif not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--resume past the start of RL needs the reference model in {folder}")
    return load_model(folder, dtype=cfg.model.dtype).eval().requires_grad_(False)


def _sft_step(cfg: TrainConfig, engine, fmt: ChatFormat, strategy, trainer: Trainer, step: int,
              env_seeds: list[int]) -> dict:  # fmt: skip
    """SFT on demonstrations: full-context ones (``evict_steps``' evictions replayed after the
    warm-up, objective ``sft``), or with ``sft_demos = "strategy"`` played by the rollout runner."""
    if not _has_demos(cfg):
        raise ValueError(f"sft_steps needs demonstrations; the {cfg.env.name} env has no demo_action()")
    evicted = step > cfg.sft_steps
    seeds = [s * cfg.group_size + g for s in env_seeds for g in range(cfg.group_size)]
    if cfg.sft_demos == "strategy":
        make = lambda: make_env(cfg.env)  # noqa: E731
        played = run_episodes(
            engine, fmt, make, strategy, cfg.mode, cfg.rollout, seeds, len(seeds),
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
            traces = [(demo_trace(fmt, env, s, evict, cfg.rollout.system), i) for i, s in enumerate(seeds)]
        finally:
            env.close()
    stats = trainer.step([Sample(t, np.zeros(len(t), np.float32), i) for t, i in traces], loss="sft")
    keep = ("loss", "grad_norm", "trained_tokens", "train_s")
    return {"step": step, "phase": "sft_evicted" if evicted else "sft", **{k: stats[k] for k in keep}}


def _has_demos(cfg: TrainConfig) -> bool:
    """Whether the run's env writes demonstrations (``demo_action``); the env made to ask is closed
    (one may hold a process: a browser, a game)."""
    env = make_env(cfg.env)
    try:
        return hasattr(env, "demo_action")
    finally:
        env.close()


def _sidequest_step(cfg: TrainConfig, engine, fmt: ChatFormat, trainer: Trainer, step: int,
                    env_seeds: list[int]) -> dict:  # fmt: skip
    """SideQuest's objective: CE on the hindsight-labelled auxiliary samples of this step's correct
    full-context traces, plus ``sidequest.kl`` x KL(reference || policy) on those traces (the
    reference: the frozen policy as the phase began), each part normalised over its own tokens."""
    sq, strategy = cfg.sidequest, cfg.strategy
    demo = sq.traces == "solver"
    if demo and not _has_demos(cfg):
        raise ValueError(f"sidequest.traces = 'solver' needs the {cfg.env.name} env's demo_action()")
    make = lambda: make_env(cfg.env)  # noqa: E731
    played = run_episodes(engine, fmt, make, None, "full", cfg.rollout, env_seeds, len(env_seeds), demo=demo)
    results = asyncio.run(played)
    main = [r.traces[0] for r in results if r.reward >= 1.0 and r.error is None]
    labels = random.Random(f"sidequest/{cfg.seed}/{step}")  # the same split when resumed
    every, trigger = strategy.every, strategy.trigger
    fork = {"at": strategy.at, "keep_calls": strategy.keep_calls, "keep_titles": strategy.keep_titles}
    aux = [x for t in main for x in hindsight_samples(t, fmt, every, labels, sq.split, trigger, **fork)]
    out = {"step": step, "phase": "sidequest", "correct": len(main) / len(results), "aux_samples": len(aux)}
    if not aux:
        return out | _no_update()
    zero = lambda t: np.zeros(len(t), np.float32)  # noqa: E731
    parts = [([Sample(t, zero(t), i) for i, t in enumerate(aux)], "sft", 1.0)]
    if sq.kl:
        parts.append(([Sample(t, zero(t), i) for i, t in enumerate(main)], "distill", sq.kl))
    stats, extra = trainer.step_parts(parts)
    kl = stats[1]["loss"] if sq.kl else 0.0
    return out | {"loss": stats[0]["loss"] + sq.kl * kl, "aux_ce": stats[0]["loss"], "main_kl": kl,
                  "trained_tokens": stats[0]["trained_tokens"], **extra}  # fmt: skip


class Interrupted(Exception):
    """Ctrl-C stopped training after a whole step; a checkpoint of that step was saved."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(f"interrupted after step {step}: saved {checkpoint}; continue with --resume")
        self.step, self.checkpoint = step, checkpoint


@contextmanager
def _finish_step_on_interrupt():
    """The first Ctrl-C sets a flag the loop checks after each step (which then checkpoints and
    stops); a second one stops at once, without a checkpoint. Main thread only (signals)."""
    flag = threading.Event()
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    ):
        yield flag  # a thread cannot take signals; an ignored SIGINT (nohup, a background job) stays so
        return

    def first(signum, frame):
        note("Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C again stops now, unsaved)")
        flag.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def _resume_point(run_dir: Path, model, trainer: Trainer, modules: dict) -> dict:
    """Load the newest complete checkpoint (saying which, and what it fell back from); none: step 0."""
    remove = remove_partial_writes(run_dir)
    if remove:
        note(f"removed {len(remove)} unfinished checkpoint write(s) in {run_dir / 'checkpoints'}")
    skipped: list[str] = []
    ckpt = latest_checkpoint(run_dir, skipped)
    for reason in skipped:
        note(f"skipping a checkpoint: {reason}")
    if ckpt is None:
        note(f"no complete checkpoint in {run_dir / 'checkpoints'}: the run starts again from step 0")
        return {"step": 0, "state": {}}
    loaded = load_checkpoint(ckpt, model, trainer.optimizer, modules, checked=True)  # latest_checkpoint did
    if skipped:
        note(f"resuming from {ckpt} (step {loaded['step']})")
    return loaded


def train(
    cfg: TrainConfig, resume: bool = False, progress=None, on_step=None, overwrite: bool = False
) -> dict:
    """Run (or resume) training; returns the last step's metrics. A folder that already holds a
    run needs ``resume`` (continue it) or ``overwrite`` (delete it first): two runs never mix."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)  # initialises what the run creates (critic, LoRA adapters) reproducibly
    run_dir = Path(cfg.out)
    check_log_settings(cfg.log)
    keep = [Path(cfg.model.path)] if cfg.model.path else []
    open_run_dir(run_dir, cfg, resume, overwrite, keep)
    ray_owned = connect(cfg.cluster) if cfg.cluster.backend == "ray" else False
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2) + "\n")
    engine = load_engine(cfg.model, cfg.engine, run_dir)
    source = cfg.model.folder(run_dir)  # the tokenizer files checkpoints carry
    model = engine.model
    if getattr(cfg.strategy, "thread_adapter", None):  # frozen, on the threads' tokens; before the run's LoRA
        load_thread_adapter(model, cfg.strategy.thread_adapter)
    fmt = ChatFormat.from_tokenizer(
        engine.tokenizer, cfg.rollout.chat_rewrites, cfg.rollout.chat_template_kwargs
    )
    strategy = build_strategy(cfg.strategy)
    head = ValueHead(model.config.hidden_size) if cfg.advantage == "gae" else None
    trainer = _trainer_class(cfg)(model, cfg.train, head, temperature=cfg.rollout.temperature)  # LoRA too
    modules = {"value_head": head} if head is not None else {}
    if cfg.train.lora:  # the base stays the initial model; checkpoints carry the adapters
        modules["lora"] = Adapters(model, cfg.train.lora)
        if cfg.objective == "sidequest" and cfg.sidequest.adapter == "thread":
            gate_adapters(model)  # on the auxiliary threads' tokens only, in the engine and the trainer
    loaded = _resume_point(run_dir, model, trainer, modules) if resume else {"step": 0, "state": {}}
    if cfg.cluster.trainer_workers > 1:  # the other ranks copy the (resumed) weights and optimizer
        trainer.start(cfg)
    start = loaded["step"]
    weights = {"model": source, "thread_adapter": getattr(cfg.strategy, "thread_adapter", None)}
    with open(run_dir / "provenance.jsonl", "a") as f:  # one line each time the run starts or resumes
        f.write(json.dumps({"from_step": start} | provenance(weights)) + "\n")
    data_position = loaded["state"].get("data_position", start)  # the last batch of env seeds trained on
    earlier = loaded["state"]  # the run's time up to that checkpoint (wall_s leaves evaluations out)
    if start > cfg.steps:
        raise RunDirError(
            f"steps = {cfg.steps} but the run's checkpoint is at step {start}: resume with steps >= {start}"
        )
    if resume and start == cfg.steps:
        note(f"the run is already at step {start} = steps; --set steps=N (N > {start}) extends it")
    monitor = Monitor(run_dir, cfg.log, start, json.loads(cfg.model_dump_json()))
    advance = progress(cfg.steps - start) if progress else (lambda info=None: None)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if resume and summary_path.exists() else {}
    last: dict = summary.get("last_step", {}) if start == cfg.steps else {}
    clock = (time.perf_counter(), time.process_time())
    evaluating = [0.0]  # seconds of this part spent in evaluations
    sampler = None

    def times() -> dict:
        eval_s = earlier.get("eval_s", 0.0) + evaluating[0]
        wall = earlier.get("wall_s", 0.0) + time.perf_counter() - clock[0] - evaluating[0]
        return {
            "wall_s": wall,
            "eval_s": eval_s,
            "cpu_s": earlier.get("cpu_s", 0.0) + time.process_time() - clock[1],
        }

    def record_eval(when: str) -> dict:
        t = time.perf_counter()
        stats = _record_eval(cfg, engine, summary, when)
        evaluating[0] += time.perf_counter() - t
        return stats

    def checkpoint(step: int) -> Path:
        state = {"data_position": data_position, **times()}
        return save_checkpoint(run_dir, step, model, trainer.optimizer, state, modules,
                               keep=cfg.checkpoint_keep, tokenizer_dir=source)  # fmt: skip

    try:
        with _finish_step_on_interrupt() as interrupted:
            for step in range(start + 1, cfg.steps + 1):
                if step == cfg.sft_steps + 1 and cfg.eval_episodes:
                    record_eval("before")
                t0 = time.perf_counter()
                for group in trainer.optimizer.param_groups:  # the warm-up may have its own learning rate
                    group["lr"] = cfg.sft_lr if step <= cfg.sft_steps and cfg.sft_lr else cfg.train.lr
                if step <= cfg.sft_steps or cfg.objective == "sft":  # demonstrations, the same optimizer
                    env_seeds = [cfg.seed + (step - 1) * cfg.prompts + j for j in range(cfg.prompts)]
                    last = _sft_step(cfg, engine, fmt, strategy, trainer, step, env_seeds)
                    data_position = step
                else:
                    anchored = cfg.train.kl_ref or cfg.objective in ("distill", "sidequest")
                    if anchored and trainer.reference is None:
                        trainer.reference = _reference(cfg, model, run_dir, fresh=step == cfg.sft_steps + 1)
                    if (cfg.max_lag or cfg.cluster.rollout_workers) and sampler is None:
                        sampler = _sampler(cfg, model, engine.tokenizer, fmt, strategy, data_position + 1)
                    if cfg.objective == "sidequest":
                        env_seeds = [cfg.seed + (step - 1) * cfg.prompts + j for j in range(cfg.prompts)]
                        last = _sidequest_step(cfg, engine, fmt, trainer, step, env_seeds)
                    else:
                        last = _rl_step(cfg, engine, fmt, strategy, trainer, head, step, sampler, t0)
                    data_position = sampler.next_index - 1 if sampler is not None else step
                last["wall_s"] = times()["wall_s"]
                rl_step, stats = step - cfg.sft_steps, None
                if cfg.eval_episodes and step == cfg.steps:
                    stats = record_eval("after")
                elif cfg.eval_every and rl_step > 0 and rl_step % cfg.eval_every == 0:
                    stats = record_eval("during")
                if stats is not None and cfg.eval_every:
                    last |= {"eval_success": stats["success_rate"], "eval_reward": stats["mean_reward"]}
                monitor.log(last)
                saved = checkpoint(step) if step % cfg.checkpoint_every == 0 or step == cfg.steps else None
                if on_step is not None:
                    on_step(last)
                advance(f"reward {last['reward']:.3f}" if "reward" in last else f"loss {last['loss']:.2e}")
                if interrupted.is_set():
                    raise Interrupted(step, saved or checkpoint(step))
    finally:
        if sampler is not None:
            sampler.close()
        if cfg.cluster.trainer_workers > 1:
            trainer.close()
        if ray_owned:
            import ray

            ray.shutdown()
        monitor.close()
    summary |= times()  # the whole run, all resumed parts (to the last checkpoint), evaluations apart
    summary["wall_s_this_part"] = time.perf_counter() - clock[0]
    summary["last_step"] = last
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    return last


def _trainer_class(cfg: TrainConfig) -> type[Trainer]:
    if cfg.cluster.trainer_workers == 1:
        return Trainer
    from compactrl.cluster.data_parallel import DataParallelTrainer

    return DataParallelTrainer


def _sampler(cfg: TrainConfig, model, tokenizer, fmt, strategy, first: int):
    """Where RL batches come from when not sampled in the loop: rollout workers (Ray actors, each
    on its own copy of the weights), or a background thread on one copy (max_lag > 0)."""
    if cfg.cluster.rollout_workers:
        from compactrl.cluster.rollout import RolloutPool

        return RolloutPool(cfg, model, tokenizer, first)
    return BackgroundSampler(cfg, model, tokenizer, fmt, strategy, first)


def _record_eval(cfg: TrainConfig, engine, summary: dict, when: str) -> dict:
    """Greedy held-out evaluation as RL starts (``before``), every ``eval_every`` steps (``during``:
    the metrics row keeps it) and when training ends (``after``); for the recall task its success
    rate is the post-eviction recall accuracy."""
    stats, _ = _held_out(cfg, engine, cfg.eval_episodes, greedy=True)
    if when == "during":
        return stats
    summary[f"eval_{when}"] = stats
    if cfg.env.name == "recall":
        summary[f"recall_accuracy_{when}"] = stats["success_rate"]
    for mode in cfg.eval_controls if when == "after" else ():  # the same policy and episodes, another mode
        stats, _ = _held_out(cfg.model_copy(update={"mode": mode}), engine, cfg.eval_episodes, greedy=True)
        summary[f"eval_after_{mode}"] = stats
    (Path(cfg.out) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary[f"eval_{when}"]


def _rl_step(cfg: TrainConfig, engine, fmt, strategy, trainer: Trainer, head, step: int, sampler, t0) -> dict:
    """Take a batch (sampled now, or ahead by the background sampler), compute advantages, take
    one optimizer step, and hand the new weights to the background sampler's engine."""
    lag = dropped = 0
    faults = {}
    if sampler is None:
        results = sample_batch(cfg, engine, fmt, strategy, step)
    else:
        batch, dropped = sampler.get()
        results, lag = batch.results, sampler.pushed - batch.version
        if cfg.cluster.rollout_workers:
            faults = {"worker_restarts": batch.restarts, "rerun_episodes": batch.rerun}
    t1 = time.perf_counter()
    rewards = np.array([r.reward for r in results])
    loss = {"rl": "pg", "rft": "sft", "distill": "distill"}[cfg.objective]
    if head is not None:
        samples = _gae_samples(cfg, engine.model, head, results)
    else:
        adv = (
            step_advantages(cfg, priced_rewards(cfg, results))
            if cfg.objective == "rl"
            else np.zeros(len(results))
        )
        samples = []
        for i, (r, a) in enumerate(zip(results, adv, strict=True)):
            if cfg.objective == "rft" and r.reward < cfg.rft_min_reward:
                continue
            credit = discounts([t.trainable for t in r.traces], cfg.gamma)
            samples += [Sample(t, a * w, i) for t, w in zip(r.traces, credit, strict=True)]
            if cfg.train_aux:
                samples += thread_samples(r, a, i, cfg.gamma)
    stats = _updates(cfg, trainer, samples, loss, step) if samples else _no_update()
    t2 = time.perf_counter()
    if sampler is not None:
        sampler.push(trainer.model)
    last = {
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
    return last


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


def _updates(cfg: TrainConfig, trainer: Trainer, samples: list[Sample], loss: str, step: int) -> dict:
    """``epochs`` passes over the batch, each split into ``minibatches`` optimizer steps (rollouts
    shuffled per pass, seeded by the step). Reports the first update's statistics (its mismatch is
    the sampler's against the weights that sampled), with loss and clip fraction averaged."""
    rollouts = sorted({s.sequence for s in samples})
    rng = np.random.default_rng([cfg.seed, step])
    parts = min(cfg.minibatches, len(rollouts))
    runs = []
    for _ in range(cfg.epochs):
        order = rng.permutation(rollouts) if parts > 1 else rollouts
        for part in np.array_split(np.asarray(order), parts):
            chosen = set(part.tolist())
            runs.append(trainer.step([s for s in samples if s.sequence in chosen], loss))
    stats = dict(runs[0])
    for k in ("loss", "clip_fraction", "grad_norm"):
        stats[k] = float(np.mean([r[k] for r in runs]))
    stats["trained_tokens"] = sum(r["trained_tokens"] for r in runs[:parts])  # one pass over the batch
    stats["train_s"] = sum(r["train_s"] for r in runs)
    stats["updates"] = len(runs)
    return stats


def _no_update() -> dict:
    """RFT with no rollout over the bar: nothing to train on this step."""
    zero = ("loss", "trained_tokens", "mismatch_kl", "mismatch_max_abs", "clip_fraction", "masked_fraction",
            "value_loss", "ref_kl", "entropy", "grad_norm", "train_s")  # fmt: skip
    return dict.fromkeys(zero, 0.0) | {"updates": 0}


def _held_out(cfg: TrainConfig, engine, episodes: int, greedy: bool) -> tuple[dict, list]:
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
    trained_thread = cfg.objective == "sidequest" and cfg.sidequest.adapter == "thread"
    weights = ckpt / "model" if ckpt and not trained_thread else None
    engine = load_engine(cfg.model, cfg.engine, run_dir, weights)
    thread = ckpt if ckpt and trained_thread else getattr(cfg.strategy, "thread_adapter", None)
    if thread:
        load_thread_adapter(engine.model, thread)
    stats, results = _held_out(cfg, engine, episodes, greedy)
    result = {"checkpoint": str(ckpt) if ckpt else None, **stats}
    label = f"{ckpt.name if ckpt else 'initial'}{'-greedy' if greedy else ''}{f'-{name}' if name else ''}"
    path = run_dir / "eval" / f"{label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result | {"episode_metrics": [r.metrics() for r in results]}, indent=1) + "\n")
    if traces:
        save_traces(path.with_suffix(".traces.jsonl"), [t for r in results for t in r.traces + r.aux_traces])
    return result | {"path": str(path)}
