"""Data-parallel training: ``cluster.trainer_workers`` ranks, the driver being rank 0 and the others
Ray actors, joined by a torch.distributed group (gloo on CPU, NCCL when the policy is on a GPU).

Each optimizer step the driver splits the batch's rollouts across the ranks, balanced by tokens
(:func:`split_by_tokens`; a re-prefill rollout's segments stay on one rank), and computes the
per-token loss weights over the *whole* batch before splitting: token-level normalisation divides
by the batch's trained tokens, sequence-level by its rollouts, not by one rank's share (dividing by
each rank's own count is the classic data-parallel bug; N ranks then take a different step than
one process). Each rank accumulates its share's gradient, the gradients are summed in one flat
all-reduce, and every rank clips and steps the same summed gradient with the same AdamW state, so
all ranks hold the same weights and equal one process's update to float32 rounding.

A failure in one rank's share fails the step on every rank: each rank computes its share inside a
try, then all say whether theirs failed before any gradient is reduced (``rl.trainer._agree``), so
no rank waits in an all-reduce another never reaches and none steps; the driver raises
:class:`DataParallelError` naming the rank and its cause, and the run continues with ``--resume``
from its newest checkpoint. A rank that dies or hangs is bounded by the process group's timeout
(``cluster.collective_timeout_s``).

Why actors and not torchrun-launched processes: the driver already is the single controller that
owns the rollout workers, the checkpoints and the loop; ranks it starts itself are placed by the
same Ray resources, need no second launcher, and the loop runs once, not once per rank. Why a
hand-written all-reduce and not DDP: the engine shares rank 0's module (a DDP wrapper would stand
between them), and the gradient is accumulated over micro-batches of differently weighted parts
before a single reduction per optimizer step, which DDP's per-backward hooks do not fit.
"""

from __future__ import annotations

import copy
import socket
import time
from datetime import timedelta

import numpy as np
import ray
import torch
import torch.distributed as dist

from compactrl.rl.trainer import (
    DataParallelError,
    PeerFailed,
    Sample,
    Trainer,
    add_sums,
    finish,
    token_weights,
)


def split_by_tokens(samples: list[Sample], ranks: int) -> list[list[int]]:
    """Sample indices per rank: whole rollouts (``Sample.sequence``), longest first onto the rank
    with the fewest tokens so far (ties to the lower rank); deterministic."""
    size: dict[int, int] = {}
    for s in samples:
        size[s.sequence] = size.get(s.sequence, 0) + len(s.trace)
    load, owner = [0] * ranks, {}
    for seq in sorted(size, key=lambda q: (-size[q], q)):
        r = min(range(ranks), key=lambda k: (load[k], k))
        owner[seq], load[r] = r, load[r] + size[seq]
    return [[i for i, s in enumerate(samples) if owner[s.sequence] == r] for r in range(ranks)]


class TrainerRank:
    """Rank ``rank >= 1``: a :class:`Trainer` on its own copy of the policy (and critic), shipped
    from the driver with the optimizer's state so that a resumed run's ranks resume with it."""

    def __init__(self, cfg, model, head, optimizer_state: dict, rank: int, world: int, address: str):
        torch.set_num_threads(max(1, int(cfg.cluster.trainer_cpus)))
        device = "cuda" if cfg.cluster.trainer_gpus else "cpu"
        head = head.to(device) if head is not None else None
        self.trainer = Trainer(model.to(device), cfg.train, head, temperature=cfg.rollout.temperature)
        self.trainer.optimizer.load_state_dict(optimizer_state)
        self.rank, self.world, self.address = rank, world, address
        self.timeout = timedelta(seconds=cfg.cluster.collective_timeout_s)

    def join(self) -> None:
        dist.init_process_group(_backend(next(self.trainer.model.parameters())), init_method=self.address,
                                rank=self.rank, world_size=self.world, timeout=self.timeout)  # fmt: skip
        self.trainer.group = dist.group.WORLD

    def set_reference(self, reference) -> None:
        self.trainer.reference = reference.to(next(self.trainer.model.parameters()).device)

    def step(self, parts, weights, lrs: list[float]) -> tuple[list[dict], float] | None:
        """This rank's share; None when another rank's failed (that rank reports the cause); its own
        failure is raised (to the driver, after every rank has agreed not to step)."""
        parts, weights = copy.deepcopy((parts, weights))  # writable: the object store's arrays are not
        for group, lr in zip(self.trainer.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        try:
            return self.trainer.step_share(parts, weights)
        except PeerFailed:
            return None

    def parameters(self) -> list[torch.Tensor]:
        return [p.detach().cpu() for p in self.trainer.params]


class DataParallelTrainer(Trainer):
    """Rank 0, in the driver: the loop uses it as a :class:`Trainer`; :meth:`start` (after any
    resume, so the ranks copy the resumed weights and optimizer) starts the other ranks."""

    def __init__(self, *args, **kwargs) -> None:
        self.ranks: list = []  # before Trainer's __init__, which sets the reference
        self.timeout_s = 0.0
        super().__init__(*args, **kwargs)

    def start(self, cfg) -> None:
        world, self.timeout_s = cfg.cluster.trainer_workers, cfg.cluster.collective_timeout_s
        address = f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"
        actor = ray.remote(num_cpus=cfg.cluster.trainer_cpus, num_gpus=cfg.cluster.trainer_gpus)(TrainerRank)
        model, head, state = (ray.put(x) for x in (self.model, self.value_head, self.optimizer.state_dict()))
        self.ranks = [actor.remote(cfg, model, head, state, r, world, address) for r in range(1, world)]
        joined = [r.join.remote() for r in self.ranks]
        dist.init_process_group(_backend(next(self.model.parameters())), init_method=address, rank=0,
                                world_size=world, timeout=timedelta(seconds=self.timeout_s))  # fmt: skip
        ray.get(joined)
        self.group = dist.group.WORLD
        if self.reference is not None:
            self._send_reference()

    @property
    def reference(self):
        return self._reference

    @reference.setter
    def reference(self, model) -> None:  # the KL anchor / distill teacher goes to every rank
        self._reference = model
        if self.ranks and model is not None:
            self._send_reference()

    def _send_reference(self) -> None:
        ref = ray.put(self._reference)
        ray.get([r.set_reference.remote(ref) for r in self.ranks])

    def share_weights(self, samples: list[Sample], shares: list[list[int]]) -> list[list[np.ndarray]]:
        """Each rank's per-token loss weights: the whole batch's normalisation, sliced."""
        w = token_weights(samples, self.settings.norm, self.settings.norm_constant)
        return [[w[i] for i in share] for share in shares]

    def step_parts(self, parts):
        if not self.ranks or not all(samples for samples, _, _ in parts):
            return super().step_parts(parts)  # one rank; or refused there, as in one process
        t0, world = time.perf_counter(), len(self.ranks) + 1
        per_rank: list[tuple[list, list]] = [([], []) for _ in range(world)]
        for samples, loss, scale in parts:
            shares = split_by_tokens(samples, world)
            for r, (share, w) in enumerate(zip(shares, self.share_weights(samples, shares), strict=True)):
                per_rank[r][0].append(([samples[i] for i in share], loss, scale))
                per_rank[r][1].append(w)
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        futures = [rank.step.remote(*per_rank[r], lrs) for r, rank in enumerate(self.ranks, start=1)]
        failed: dict[int, str] = {}
        try:  # rank 0's share, between the others' (every rank agrees on failures before reducing)
            sums, norm = self.step_share(*per_rank[0])
        except PeerFailed as e:
            failed |= dict.fromkeys(e.ranks, "(no cause reported)")  # replaced by the rank's own below
        except Exception as e:
            failed[0] = _cause(e)
        others = []
        for r, future in enumerate(futures, start=1):
            try:  # past the agreement the others only step: the collectives' timeout bounds the wait
                others.append(ray.get(future, timeout=self.timeout_s))
            except Exception as e:  # its share raised, its actor died, or it did not answer
                failed[r] = _cause(e)
        if failed:
            raise DataParallelError(failed)
        for other, _ in others:
            sums = [add_sums(a, b) for a, b in zip(sums, other, strict=True)]
        return [finish(x) for x in sums], {"grad_norm": norm, "train_s": time.perf_counter() - t0}

    def rank_parameters(self, rank: int) -> list[torch.Tensor]:
        """Rank ``rank``'s trainable parameters (tests: every rank holds rank 0's)."""
        return ray.get(self.ranks[rank - 1].parameters.remote())

    def close(self) -> None:
        for r in self.ranks:
            ray.kill(r)
        self.ranks = []
        if dist.is_initialized():
            dist.destroy_process_group()
        self.group = None


def _cause(e: Exception) -> str:
    """``Type: message`` of a failure; a remote one's original exception, not Ray's wrapper."""
    cause = getattr(e, "cause", None)
    e = cause if isinstance(cause, BaseException) else e
    return f"{type(e).__name__}: {e}"


def _backend(p: torch.Tensor) -> str:
    return "nccl" if p.is_cuda else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
