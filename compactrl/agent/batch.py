"""Many episodes at once through one engine (``compactrl rollout CONFIG``).

Episodes are asyncio tasks that share one engine, whose ``serve`` loop batches their prefill and
decode steps; environment calls run in worker threads. Up to ``concurrency`` episodes are in
flight; the KV pool bounds memory, and the engine preempts and resumes sessions rather than
dropping them. A run directory gets the resolved config, one JSON line of metrics per episode,
the traces (JSONL) and a summary.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from compactrl.agent.chat import ChatFormat
from compactrl.agent.hindsight import deletion_scores
from compactrl.agent.rollout import NON_COMPLETION, Episode, EpisodeResult, RolloutSettings
from compactrl.agent.served import run_agent_episodes
from compactrl.compaction import SlidingWindow, StrategyConfig, build_strategy
from compactrl.compaction.evictors import EvictorConfig, check_mode
from compactrl.config import made_by
from compactrl.engine import Engine, EngineConfig
from compactrl.envs import ENV_FIELD, EnvConfig, RoomsConfig, make_env
from compactrl.envs.agent import AgentEnv
from compactrl.models.loading import DTYPES
from compactrl.models.lora import load_thread_adapter
from compactrl.models.tokenizer import Tokenizer
from compactrl.provenance import provenance
from compactrl.run_dir import open_run_dir
from compactrl.stats import mean_ci
from compactrl.trace import save_traces


class ModelSource(BaseModel):
    """A Hugging Face folder, or (``path`` unset) a tiny random model generated into the run dir."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str | None = Field(
        None,
        description="Hugging Face model folder (config.json, safetensors, tokenizer); unset (or '', as "
        "`--set model.path=` unsets it): a random model of `size` generated into the run directory",
    )
    family: Literal["llama", "qwen2", "qwen3"] = Field("qwen3", description="generated model's architecture")
    size: Literal["tiny", "small", "base"] = Field(
        "tiny", description="generated model, hidden size x layers: tiny 64 x 2, small 256 x 4, base 512 x 8"
    )
    seed: int = Field(0, description="weight initialisation seed of the generated model")
    dtype: Literal[tuple(DTYPES)] = Field(  # type: ignore[valid-type]
        "float32", description="dtype the weights are loaded in (the engine and the trainer share them)"
    )

    def folder(self, run_dir: str | Path) -> Path:
        """Where the model and its tokenizer live: ``path``, or the run's generated model."""
        return Path(self.path) if self.path else Path(run_dir) / "model"

    @field_validator("path")
    @classmethod
    def _exists(cls, v: str | None) -> str | None:
        if not v:
            return None
        v = str(Path(v).expanduser())  # validated and loaded as the same folder
        if not (Path(v) / "config.json").is_file():
            if maker := made_by(v):
                raise ValueError(f"{v} does not exist yet: it is made by `{maker}`; run that first")
            raise ValueError(
                f"{v} has no config.json; point at a Hugging Face model folder (import a GGUF one with "
                "`compactrl import-gguf FILE DIR`; SmolLM2: `compactrl import-gguf --smollm2 DIR`), "
                "or unset it"
            )
        return v


EVICTOR_FIELD = (
    "a token evictor the engine runs in stream mode (h2o, snapkv, rkv, streamingllm, tova, knorm, random; "
    "see compactrl.compaction.evictors), alone or with the strategy"
)
MODE_FIELD = (
    "full: no compaction; stream: compaction evicts KV in place, one trace per episode; reprefill: the "
    "kept context is prefilled again, one trace per segment"
)


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelSource = ModelSource()
    engine: EngineConfig = EngineConfig()
    env: EnvConfig = Field(RoomsConfig(), description=ENV_FIELD)
    strategy: StrategyConfig = SlidingWindow()
    evictor: EvictorConfig | None = Field(None, description=EVICTOR_FIELD)
    mode: Literal["full", "reprefill", "stream"] = Field("stream", description=MODE_FIELD)
    rollout: RolloutSettings = RolloutSettings()
    episodes: int = Field(8, ge=1, description="episodes to run (episode i on env seed seed + i)")
    concurrency: int = Field(8, ge=1, description="episodes in flight at once")
    seed: int = Field(0, description="episode i uses seed + i")
    threads: int = Field(1, ge=1, description="torch intra-op threads")
    out: str = Field("runs/rollout", description="run directory")
    demo: bool = Field(
        False,
        description="the env's scripted solver plays every turn and, under sidequest, the env's hindsight "
        "oracle answers the auxiliary thread: the reference (e.g. the least memory a strategy allows) "
        "a policy is measured against",
    )

    @model_validator(mode="after")
    def _recall_needs_its_eviction(self):
        check_mode(self.evictor, self.mode)
        if (
            self.env.name == "recall"
            and self.mode != "full"
            and self.strategy.name != "evict_steps"
            and self.evictor is None
        ):
            raise ValueError("the recall env evicts its assignment with strategy.name = 'evict_steps' "
                             "(or an [evictor])")  # fmt: skip
        return self


def load_engine(src: ModelSource, engine: EngineConfig, run_dir: Path, weights: Path | None = None) -> Engine:
    """The engine for a run; a generated model is written once into ``run_dir/model`` and reused.
    ``weights`` (a checkpoint's model folder) replaces the weights, the run's tokenizer stays."""
    from compactrl.models.loading import load_model
    from compactrl.models.tiny import write_tiny_model

    folder = src.folder(run_dir)
    if src.path is None and not (folder / "config.json").exists():
        write_tiny_model(folder, family=src.family, size=src.size, seed=src.seed)
    for f in (folder, weights):
        if f is not None and not (f / "config.json").exists():
            raise FileNotFoundError(f"{f} has no config.json; point at a Hugging Face model folder")
    model = load_model(weights or folder, dtype=src.dtype)
    return Engine(model, Tokenizer.from_dir(folder), engine)


def _probe(make: Callable[[], object]) -> object | None:
    """An env made and closed, to tell an agent env from a reset/step one (None if it fails: each
    episode then records the failure)."""
    try:
        env = make()
    except Exception:  # noqa: BLE001
        return None
    try:
        env.close()
    except Exception:  # noqa: BLE001
        pass
    return env


async def run_episodes(
    engine: Engine,
    fmt: ChatFormat,
    make: Callable[[], object],
    strategy,
    mode: str,
    settings: RolloutSettings,
    seeds: list[int],
    concurrency: int,
    advance: Callable[[], None] = lambda: None,
    sample_seeds: list[int] | None = None,
    demo: bool = False,
    evictor=None,
) -> list[EpisodeResult]:
    """Run one episode per seed, ``concurrency`` at a time; results in seed order. ``sample_seeds``
    (default: the env seeds) seed the sampling, so a group of rollouts can share an env seed;
    ``demo``: the env writes every answer (SFT demonstrations, rendered as rollouts are)."""
    sample_seeds = seeds if sample_seeds is None else sample_seeds
    probe = _probe(make)
    if isinstance(probe, AgentEnv):  # the agent drives its episodes, through an in-process server
        if demo:
            raise ValueError("an agent env has no demonstrations; train it with rl (sft_steps = 0)")
        return await run_agent_episodes(
            engine, fmt, probe, strategy, mode, settings, seeds, concurrency, advance, sample_seeds, evictor
        )
    gate = asyncio.Semaphore(concurrency)
    # one worker per episode in flight, each of which waits on one env call at a time: no call queues
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="env")

    async def one(i: int, seed: int) -> EpisodeResult:
        async with gate:
            env = None
            try:
                env = make()
                episode = Episode(engine, fmt, env, strategy, mode, settings, seed, i, sample_seeds[i], demo,
                                  evictor, pool)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - an env that cannot be made fails its episode only
                name = getattr(env, "name", "env")
                failed = EpisodeResult(i, seed, name, mode, getattr(strategy, "name", "none"))
                failed.error = f"{type(e).__name__}: {e}"
                advance()
                return failed
            try:
                return await episode.run()
            finally:
                try:
                    env.close()
                except Exception:  # noqa: BLE001 - a failing close must not lose the episode
                    pass
                advance()

    serve = asyncio.create_task(engine.serve())
    work = asyncio.gather(*(one(i, s) for i, s in enumerate(seeds)))
    try:
        await asyncio.wait({serve, work}, return_when=asyncio.FIRST_COMPLETED)
        if serve.done():  # the engine failed: stop the episodes and raise its error
            work.cancel()
            serve.result()
        return work.result()
    finally:
        serve.cancel()
        pool.shutdown(wait=False)  # a hung env call's thread cannot be joined


def summarize(results: list[EpisodeResult]) -> dict:
    def mean(key):
        return float(np.mean([getattr(r, key) for r in results])) if results else 0.0

    total = {k: int(sum(getattr(r, k) for r in results)) for k in (
        "tokens", "generated_tokens", "compactions", "prefilled_tokens", "reprefilled_tokens",
        "predicted_reprefilled_tokens", "kv_reads", "evicted_tokens", "evictions", "pick_fallbacks",
        "preemptions", "aux_calls", "deleted_cursors", "aux_offered_cursors", "aux_parse_failures",
        "aux_no_room", "aux_unknown_cursors", "aux_unseen_cursors", "aux_unfinished", "aux_tokens",
        "aux_kv_reads", "aux_kept_unread")}  # fmt: skip
    n = max(1, len(results))
    return {
        "episodes": len(results),
        "errors": sum(r.error is not None for r in results),
        "truncated": sum(r.truncated for r in results),
        "at_position_limit": sum(r.at_position_limit for r in results),
        "longest_stream": max((len(t) for r in results for t in r.traces), default=0),
        "mean_reward": mean("reward"),
        "mean_reward_ci": mean_ci([r.reward for r in results]),  # 95%; None without episodes
        "mean_turns": mean("turns"),
        "peak_live_kv": max((r.peak_live_kv for r in results), default=0),
        "mean_peak_live_kv": mean("peak_live_kv"),
        "mean_peak_kv_with_threads": mean("peak_kv_with_threads"),
        **total,
        "non_completion": {c: sum(r.non_completion == c for r in results) / n for c in NON_COMPLETION},
        # answered correctly, as the env says (info["correct"]; 0 for an env that never says)
        "accuracy": sum(bool(r.info.get("correct")) for r in results) / n,
        "accuracy_ci": mean_ci([float(bool(r.info.get("correct"))) for r in results]),  # Wilson, 95%
        **_deletion_quality(results),
    }


def _deletion_quality(results: list[EpisodeResult]) -> dict:
    """SideQuest: the auxiliary threads' deletions against the hindsight labels of the episodes they
    ran in (one stream per episode: stream or full mode; a re-prefill episode has none)."""
    scored = [
        deletion_scores(r.traces[0], r.aux_traces) for r in results if r.aux_traces and len(r.traces) == 1
    ]
    if not scored:
        return {}
    tot = {k: sum(s[k] for s in scored) for k in scored[0]}
    return {
        "deletion_precision": tot["correct"] / tot["named"] if tot["named"] else None,
        "deletion_recall": tot["correct"] / tot["expired"] if tot["expired"] else None,
    }


def rollout(cfg: RolloutConfig, progress=None, overwrite: bool = False) -> dict:
    """Run the config's episodes and write the run directory; returns the summary. A folder that
    already holds a run is refused unless ``overwrite`` (its contents are replaced)."""
    torch.set_num_threads(cfg.threads)
    run_dir = Path(cfg.out)
    open_run_dir(run_dir, cfg, False, overwrite, [cfg.model.path] if cfg.model.path else [], "rollout")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2) + "\n")
    engine = load_engine(cfg.model, cfg.engine, run_dir)
    thread_adapter = getattr(cfg.strategy, "thread_adapter", None)
    if thread_adapter:
        load_thread_adapter(engine.model, thread_adapter)
    fmt = ChatFormat.from_tokenizer(
        engine.tokenizer, cfg.rollout.chat_rewrites, cfg.rollout.chat_template_kwargs
    )
    strategy = build_strategy(cfg.strategy)
    seeds = [cfg.seed + i for i in range(cfg.episodes)]
    advance = progress(len(seeds)) if progress else (lambda: None)
    t0 = time.perf_counter()
    results = asyncio.run(
        run_episodes(
            engine,
            fmt,
            lambda: make_env(cfg.env),
            strategy,
            cfg.mode,
            cfg.rollout,
            seeds,
            cfg.concurrency,
            advance,
            demo=cfg.demo,
            evictor=cfg.evictor,
        )
    )
    wall = time.perf_counter() - t0
    with open(run_dir / "episodes.jsonl", "w") as f:
        for r in results:
            f.write(json.dumps(r.metrics()) + "\n")
    save_traces(run_dir / "traces.jsonl", [t for r in results for t in r.traces + r.aux_traces])
    summary = summarize(results) | {
        "mode": cfg.mode,
        "strategy": cfg.strategy.name,
        "env": cfg.env.name,
        "wall_s": wall,
        "position_limit": engine.position_limit,
        "episodes_per_s": len(results) / wall,
        "peak_pool_kv_tokens": engine.metrics()["peak_kv_tokens"],  # the KV pool's peak occupancy
        "generated_tokens_per_s": sum(r.generated_tokens for r in results) / wall,
        "run_dir": str(run_dir),
        "provenance": provenance({"model": cfg.model.folder(run_dir), "thread_adapter": thread_adapter}),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
