"""Rollout workers: Ray actors that each hold an engine on their own copy of the weights and run
the episodes the driver gives them.

:class:`RolloutPool` is the driver's side, a :class:`~compactrl.rl.sampler.LagBounded` sampler as the
one-process :class:`~compactrl.rl.sampler.BackgroundSampler` is (``get`` / ``push`` / ``close``), so
the train loop does not know which it has. Each batch's episodes
(:func:`~compactrl.rl.sampler.batch_seeds`: the same env and sampling seeds as one process) are
split in contiguous shares, one per worker, and
gathered back in order. After each optimizer step the trainable weights go once into Ray's object
store and every worker stages them (:meth:`Engine.stage_weights`): with ``max_lag = 0`` the next
batch waits for that, so rollouts are on-policy and equal one process's token for token; with
``max_lag = N`` up to ``N`` batches run ahead and load the new weights in flight, keeping their KV.

A worker that dies (its node lost, OOM-killed, ``ray.kill``) is replaced by a fresh actor carrying
the newest weights, and its share of the batch runs again there: the step keeps all its rollouts,
and the batch says how many workers were restarted and episodes rerun.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError

from compactrl.agent.chat import ChatFormat
from compactrl.compaction import build_strategy
from compactrl.engine import Engine
from compactrl.rl.monitor import note
from compactrl.rl.sampler import Batch, LagBounded, batch_seeds, run_seeds, trainable_state


class RolloutWorker:
    """An engine and the run's rollout settings. The model comes through the object store, so the
    workers need no shared filesystem; its torch threads are its Ray CPUs."""

    def __init__(self, cfg, model: torch.nn.Module, tokenizer) -> None:
        torch.set_num_threads(max(1, int(cfg.cluster.rollout_cpus)))
        if cfg.cluster.rollout_gpus:
            model = model.to("cuda")
        self.cfg = cfg
        self.engine = Engine(model, tokenizer, cfg.engine)
        r = cfg.rollout
        self.fmt = ChatFormat.from_tokenizer(tokenizer, r.chat_rewrites, r.chat_template_kwargs)
        self.strategy = build_strategy(cfg.strategy)

    @ray.method(concurrency_group="rollout")
    def run(self, seeds: list[int], sample_seeds: list[int]) -> tuple[int, list]:
        """Episodes on the newest weights staged; the weight version they began on, and the results."""
        self.engine.load_staged()
        version = self.engine.weights_version
        return version, run_seeds(self.cfg, self.engine, self.fmt, self.strategy, seeds, sample_seeds)

    @ray.method(concurrency_group="weights")
    def stage(self, state: dict, version: int) -> None:
        """New weights, loaded between two forwards of a running batch (or before the next one)."""
        self.engine.stage_weights(state, version)


@dataclass
class _Share:
    slot: int  # which worker
    worker: object  # the actor it was given to (a restarted slot has a new one)
    episodes: np.ndarray  # positions in the batch
    future: object


@dataclass
class _Pending:
    index: int
    seeds: list[int]
    sample_seeds: list[int]
    shares: list[_Share]


class RolloutPool(LagBounded):
    """``cluster.rollout_workers`` workers sampling the RL steps' batches for the driver."""

    def __init__(self, cfg, model: torch.nn.Module, tokenizer, first_index: int, worker=RolloutWorker):
        c = cfg.cluster
        self.cfg = cfg
        self.actor = ray.remote(num_cpus=c.rollout_cpus, num_gpus=c.rollout_gpus,
                                concurrency_groups={"rollout": 1, "weights": 1})(worker)  # fmt: skip
        on_gpu = next(model.parameters()).is_cuda  # the workers place their copy themselves
        self.model = ray.put(copy.deepcopy(model).cpu() if on_gpu else model)
        self.tokenizer = tokenizer
        self.latest: tuple | None = None  # (object ref of the newest trainable state, its version)
        self.pushed = 0
        self.next_index = first_index  # the data position a checkpoint records
        self.pending: deque[_Pending] = deque()
        self.workers = [self._start() for _ in range(c.rollout_workers)]

    def _start(self):
        w = self.actor.remote(self.cfg, self.model, self.tokenizer)
        if self.latest is not None:
            ray.get(w.stage.remote(*self.latest))
        return w

    def prefetch(self) -> None:
        """Submit batches until ``max_lag + 1`` are in flight (one with ``max_lag = 0``)."""
        while len(self.pending) < self.cfg.max_lag + 1:
            index = self.pending[-1].index + 1 if self.pending else self.next_index
            seeds, sample_seeds = batch_seeds(self.cfg, index)
            split = np.array_split(np.arange(len(seeds)), len(self.workers))
            shares = [self._give(slot, part, seeds, sample_seeds) for slot, part in enumerate(split)]
            self.pending.append(_Pending(index, seeds, sample_seeds, shares))

    def _give(self, slot: int, part: np.ndarray, seeds: list[int], sample_seeds: list[int]) -> _Share:
        w = self.workers[slot]
        fut = w.run.remote([seeds[i] for i in part], [sample_seeds[i] for i in part])
        return _Share(slot, w, part, fut)

    def _gather(self, p: _Pending) -> Batch:
        results: list = [None] * len(p.seeds)
        versions, restarts, rerun = [], 0, 0
        todo = deque(p.shares)
        while todo:
            share = todo.popleft()
            try:
                version, got = ray.get(share.future)
            except RayActorError as e:
                if self.workers[share.slot] is share.worker:  # not yet replaced by another batch's gather
                    restarts += 1
                    if restarts > self.cfg.cluster.max_restarts:
                        raise RuntimeError(
                            f"rollout workers died {restarts} times in one step (cluster.max_restarts = "
                            f"{self.cfg.cluster.max_restarts}); the last: {e}"
                        ) from e
                    note(f"rollout worker {share.slot} died; restarting it, rerunning its "
                         f"{len(share.episodes)} episodes of batch {p.index}")  # fmt: skip
                    self.workers[share.slot] = self._start()
                rerun += len(share.episodes)
                todo.append(self._give(share.slot, share.episodes, p.seeds, p.sample_seeds))
                continue
            versions.append(version)
            got = copy.deepcopy(got)  # writable arrays: the object store's are read-only views
            for i, r in zip(share.episodes, got, strict=True):
                results[i] = r
        return Batch(p.index, min(versions), results, restarts, rerun)

    def _next_batch(self) -> Batch:
        self.prefetch()
        return self._gather(self.pending.popleft())

    def push(self, model: torch.nn.Module) -> None:
        """Send the trainer's updated weights to every worker (once through the object store)."""
        self.pushed += 1
        self.latest = (ray.put(trainable_state(model)), self.pushed)
        for staged in [w.stage.remote(*self.latest) for w in self.workers]:
            try:
                ray.get(staged)
            except RayActorError:
                pass  # the batch it holds reruns on a fresh worker, which gets these weights

    def close(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers, self.pending = [], deque()
