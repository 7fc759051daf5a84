"""Where an RL step's rollouts come from.

``max_lag = 0``: each batch is sampled when the step needs it, by the engine that shares the
trainer's model, so rollouts are exactly on-policy and a resumed run re-samples them exactly.

``max_lag = N > 0``: :class:`BackgroundSampler` samples ahead in a thread, on an engine with its
own copy of the weights, while the trainer trains. After each optimizer step the trainer hands
the new weights over (:meth:`Engine.stage_weights`); the engine loads them between two forwards,
so episodes in flight continue on the new weights with the KV they have (no flush) and every
token keeps the log-prob of the weights that sampled it (the loss's importance ratio corrects
for the staleness). A batch that began more than ``N`` updates before the step that would train
on it is dropped and the next one taken (counted in ``dropped_batches``). Thread timing decides
which weights sample which token, so such runs resume from checkpoints but not token for token.
"""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
from dataclasses import dataclass

import torch

from compactrl.agent.batch import run_episodes
from compactrl.engine import Engine
from compactrl.envs import make_env


@dataclass
class Batch:
    index: int  # data position: which env seeds and sampling seeds
    version: int  # weight updates the engine had loaded when sampling began
    results: list
    restarts: int = 0  # rollout workers restarted while sampling it (cluster.rollout_workers)
    rerun: int = 0  # episodes run again because their worker died


def batch_seeds(cfg, index: int) -> tuple[list[int], list[int]]:
    """Batch ``index``'s episodes: ``prompts`` env seeds x ``group_size``, and their sampling seeds."""
    env_seeds = [cfg.seed + (index - 1) * cfg.prompts + j for j in range(cfg.prompts)]
    seeds = [s for s in env_seeds for _ in range(cfg.group_size)]
    return seeds, [1_000_003 * s + g for s in env_seeds for g in range(cfg.group_size)]


def sample_batch(cfg, engine: Engine, fmt, strategy, index: int) -> list:
    """Batch ``index`` (:func:`batch_seeds`) on ``engine``."""
    return run_seeds(cfg, engine, fmt, strategy, *batch_seeds(cfg, index))


def run_seeds(cfg, engine: Engine, fmt, strategy, seeds: list[int], sample_seeds: list[int]) -> list:
    """One episode per (env seed, sampling seed), all at once; results in order."""
    make = lambda: make_env(cfg.env)  # noqa: E731
    episodes = run_episodes(engine, fmt, make, strategy, cfg.mode, cfg.rollout, seeds, len(seeds),
                            sample_seeds=sample_seeds, evictor=cfg.evictor)  # fmt: skip
    results = asyncio.run(episodes)
    return results


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What an update changes, and so what a sampling engine on its own copy must be sent."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class LagBounded:
    """What the train loop asks of a sampler that runs ahead: ``get`` the next batch begun at most
    ``max_lag`` updates before now (older ones dropped and counted), ``push`` weights, ``close``.
    Subclasses say where the next batch comes from (``_next_batch``) and keep ``pushed``."""

    cfg: object
    pushed: int
    next_index: int  # the data position a checkpoint records

    def _next_batch(self) -> Batch:
        raise NotImplementedError

    def get(self) -> tuple[Batch, int]:
        """The next batch within the lag bound, and how many older ones were dropped for it."""
        dropped = 0
        while True:
            batch = self._next_batch()
            self.next_index = batch.index + 1
            if self.pushed - batch.version <= self.cfg.max_lag:
                return batch, dropped
            dropped += 1


class BackgroundSampler(LagBounded):
    def __init__(self, cfg, model: torch.nn.Module, tokenizer, fmt, strategy, first_index: int):
        self.cfg, self.fmt, self.strategy = cfg, fmt, strategy
        self.engine = Engine(copy.deepcopy(model), tokenizer, cfg.engine)  # its own weights
        self.ready: queue.Queue[Batch] = queue.Queue(maxsize=cfg.max_lag)
        self.pushed = 0
        self.next_index = first_index  # the data position a checkpoint records
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(first_index,), daemon=True, name="sampler")
        self._thread.start()

    def _run(self, index: int) -> None:
        try:
            while not self._stop.is_set():
                self.engine.load_staged()  # begin the batch on the newest weights handed over
                batch = Batch(index, self.engine.weights_version, [])
                batch.results = sample_batch(self.cfg, self.engine, self.fmt, self.strategy, index)
                while not self._stop.is_set():
                    try:
                        self.ready.put(batch, timeout=0.05)
                        break
                    except queue.Full:
                        self.engine.load_staged()
                index += 1
        except BaseException as e:  # surfaced in the training thread by get()
            self._error = e

    def _next_batch(self) -> Batch:
        while True:
            if self._error is not None:
                raise RuntimeError(f"the background sampler failed: {self._error}") from self._error
            try:
                return self.ready.get(timeout=0.05)
            except queue.Empty:
                continue

    def push(self, model: torch.nn.Module) -> None:
        """Hand the trainer's updated weights to the engine (loaded in flight)."""
        self.pushed += 1
        self.engine.stage_weights(trainable_state(model), self.pushed)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
