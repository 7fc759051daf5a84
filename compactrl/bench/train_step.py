"""`compactrl bench train-step CONFIG`: one training step on the same rollouts, stream vs re-prefill.

One batch of real rollouts is sampled with the config's strategy in stream mode. The same
rollouts are then trained on two ways, each by its own :class:`Trainer` (same settings, same
advantages, its own copy of the model), interleaved in one run so machine drift hits both alike:

* stream: one sample per rollout, one forward under the eviction mask;
* re-prefill: one sample per segment — the tokens live when the segment began (re-fed at fresh
  positions, not trained again) followed by the segment's new tokens — which is what a framework
  that compacts by re-prefilling trains on.

With SideQuest (and ``train_aux``) the auxiliary threads' traces train too: spliced into their
main trace's stream in the stream arm, each its own forward over its whole prefix in the
re-prefill arm and in a third, forks apart (the stream arm without the splice). Every arm trains
exactly the same policy tokens (checked).
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from compactrl.agent.batch import load_engine
from compactrl.agent.chat import ChatFormat
from compactrl.bench.harness import interleaved, machine_info, medians
from compactrl.compaction import build_strategy
from compactrl.masks import streams
from compactrl.models.loading import config_summary
from compactrl.rl.config import TrainConfig
from compactrl.rl.forward import reprefill_segments
from compactrl.rl.objectives.rollouts import thread_samples
from compactrl.rl.sampler import sample_batch
from compactrl.rl.trainer import Sample, Trainer
from compactrl.trace import Trace


def segment_traces(trace: Trace) -> list[Trace]:
    """The re-prefill training samples of a stream trace: one ordinary trace per segment, whose
    kept prefix is context only and whose new tokens keep their trainability and log-probs."""
    out = []
    for k, seg in enumerate(reprefill_segments(trace)):
        idx = seg.stream_index
        new = np.arange(len(idx)) >= seg.num_kept
        trainable = trace.trainable[idx] & new
        out.append(
            Trace.from_tokens(
                seg.tokens,
                trainable=trainable,
                logprobs=np.where(trainable, trace.logprobs[idx], np.nan),
                turn=trace.turn[idx],
                role=[trace.role[i] for i in idx],
                segment=np.full(len(idx), k),
                rollout_id=trace.rollout_id,
            )
        )
    return out


def run_train_step_bench(
    cfg: TrainConfig, repeats: int = 3, progress: Callable[[int], Callable[[], None]] | None = None
) -> dict:
    if not cfg.objective.rollouts:
        raise ValueError(
            f"bench train-step trains a batch of the run's own rollouts (objective.name rl, rft or "
            f"distill); this config's objective is {cfg.objective.name!r}"
        )
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    with tempfile.TemporaryDirectory() as tmp:
        engine = load_engine(cfg.model, cfg.engine, Path(tmp))
    fmt = ChatFormat.from_tokenizer(
        engine.tokenizer, cfg.rollout.chat_rewrites, cfg.rollout.chat_template_kwargs
    )
    in_stream_mode = cfg.model_copy(update={"mode": "stream"})
    results = sample_batch(in_stream_mode, engine, fmt, build_strategy(cfg.strategy), 1)
    failed = [r.error for r in results if r.error is not None]
    if failed:
        raise ValueError(f"{len(failed)} rollouts failed, e.g. {failed[0]}")
    adv = cfg.objective.advantages(cfg, results)
    stream = [Sample(r.traces[0], np.full(len(r.traces[0]), a, np.float32), i)
              for i, (r, a) in enumerate(zip(results, adv, strict=True))]  # fmt: skip
    forks = [x for r, s in zip(results, stream, strict=True) if cfg.objective.train_aux
             for x in thread_samples(r, s.advantages[0], s.sequence, 1.0)]  # fmt: skip
    reprefill = [Sample(t, np.full(len(t), s.advantages[0], np.float32), s.sequence)
                 for s in stream for t in segment_traces(s.trace)]  # fmt: skip
    apart = cfg.train.model_copy(update={"splice_forks": False})
    arms = {
        "stream": (Trainer(copy.deepcopy(engine.model), cfg.train), stream + forks),
        "reprefill": (Trainer(copy.deepcopy(engine.model), apart), reprefill + forks),
    }
    if forks:
        arms["forks_apart"] = (Trainer(copy.deepcopy(engine.model), apart), stream + forks)
    trained = {
        name: sum(int(s.trace.trainable.sum()) for s in samples) for name, (_, samples) in arms.items()
    }
    if len(set(trained.values())) > 1:
        raise AssertionError(f"the views train different tokens: {trained}")
    advance = progress(len(arms) * (repeats + 1)) if progress else (lambda: None)

    def step(trainer: Trainer, samples: list[Sample]) -> float:
        t0 = time.perf_counter()
        trainer.step(samples)
        return time.perf_counter() - t0

    times = interleaved({k: lambda a=a: step(*a) for k, a in arms.items()}, repeats, advance=advance)
    med = medians(times)
    source = cfg.model.path or f"tiny qwen3 {cfg.model.size}"
    fed = {name: sum(len(s.trace) for s in samples) for name, (_, samples) in arms.items()}
    fed["stream"] = sum(map(len, streams([s.trace for s in stream + forks])))  # the forks spliced in
    out = {
        "benchmark": "train_step",
        "machine": machine_info(cfg.threads),
        "model": config_summary(engine.model.config) | {"source": source},
        "env": cfg.env.name,
        "strategy": cfg.strategy.model_dump(),
        "rollouts": len(results),
        "compactions": float(np.mean([r.compactions for r in results])),
        "aux_threads": len(forks),
        "trained_tokens": trained["stream"],
        "repeats": repeats,
    }
    for name, (_, samples) in arms.items():
        out |= {f"{name}_tokens": fed[name], f"{name}_samples": len(samples), f"{name}_s": med[name]}
    out |= {"token_ratio": fed["reprefill"] / fed["stream"], "time_ratio": med["reprefill"] / med["stream"]}
    if forks:
        out |= {"forks_token_ratio": fed["forks_apart"] / fed["stream"],
                "forks_time_ratio": med["forks_apart"] / med["stream"]}  # fmt: skip
    return out
