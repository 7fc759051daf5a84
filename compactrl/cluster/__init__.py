"""Scale-out: rollout workers and data-parallel trainer ranks as Ray actors around the same engine,
rollout and trainer objects a one-process run uses (``backend = "local"``, the default, starts none
of this). The loop knows nothing of Ray: :func:`launch` hands it a :class:`RayPlacement`. Ray is an
optional dependency: ``pip install 'compactrl[ray]'``.

Layout of a ``backend = "ray"`` run: the driver (``compactrl train``) is the single controller and
trainer rank 0 — it keeps the loop, checkpoints and evaluations exactly as in one process;
``rollout_workers`` actors each hold an engine on their own copy of the weights
(:mod:`compactrl.cluster.rollout`); ``trainer_workers - 1`` actors are the other trainer ranks,
joined to the driver by a torch.distributed group (:mod:`compactrl.cluster.data_parallel`).
"""

from __future__ import annotations

from compactrl.rl.config import ClusterConfig, TrainConfig
from compactrl.rl.loop import Placement, train
from compactrl.rl.trainer import Trainer


def connect(cluster: ClusterConfig) -> bool:
    """Start (no address) or join the Ray cluster, and refuse one too small for the actors before
    any of them is placed (Ray would otherwise wait for resources forever). True when this call
    connected (the caller then shuts Ray down); False when Ray was already initialised."""
    try:
        import ray
    except ImportError as e:
        raise ImportError("cluster.backend = 'ray' needs Ray: pip install 'compactrl[ray]'") from e
    owned = not ray.is_initialized()
    if owned:
        ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
    have = ray.cluster_resources()
    for kind, need in cluster.requested().items():
        if need > have.get(kind, 0.0):
            each = kind.lower() + "s"
            raise ValueError(
                f"the Ray cluster has {have.get(kind, 0.0):g} {kind}s but [cluster] asks for {need:g} "
                f"({cluster.rollout_workers} rollout workers x {getattr(cluster, 'rollout_' + each):g} + "
                f"{cluster.trainer_workers - 1} trainer ranks x {getattr(cluster, 'trainer_' + each):g}); "
                "lower the workers or their rollout_/trainer_ resources, or add nodes"
            )
    return owned


class RayPlacement(Placement):
    """Trainer ranks beyond the driver and rollout workers as Ray actors (``[cluster]``)."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cluster = cfg.cluster
        self.owned = connect(cfg.cluster)
        self.ranks = None  # the driver's DataParallelTrainer, when trainer_workers > 1

    def trainer(self, cfg: TrainConfig, model, head) -> Trainer:
        if self.cluster.trainer_workers == 1:
            return super().trainer(cfg, model, head)
        from compactrl.cluster.data_parallel import DataParallelTrainer

        self.ranks = DataParallelTrainer(model, cfg.train, head, temperature=cfg.rollout.temperature)
        return self.ranks

    def start(self, trainer: Trainer, cfg: TrainConfig) -> None:
        if self.ranks is not None:  # the other ranks copy the (resumed) weights and optimizer
            self.ranks.start(cfg)

    def sampler(self, cfg: TrainConfig, model, tokenizer, fmt, strategy, first: int):
        if not self.cluster.rollout_workers:
            return super().sampler(cfg, model, tokenizer, fmt, strategy, first)
        from compactrl.cluster.rollout import RolloutPool

        return RolloutPool(cfg, model, tokenizer, first)

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.close()
        if self.owned:
            import ray

            ray.shutdown()


def launch(cfg: TrainConfig, **kwargs) -> dict:
    """:func:`compactrl.rl.loop.train` where ``cfg.cluster`` says: in this process (``local``) or
    with Ray actors (``ray``: connects, and afterwards stops the actors and a Ray it started)."""
    if cfg.cluster.backend == "local":
        return train(cfg, **kwargs)
    placement = RayPlacement(cfg)
    try:
        return train(cfg, placement=placement, **kwargs)
    finally:
        placement.close()
