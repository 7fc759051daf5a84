"""Scale-out: rollout workers and data-parallel trainer ranks as Ray actors around the same engine,
rollout and trainer objects a one-process run uses (``backend = "local"``, the default, imports none
of this). Ray is an optional dependency: ``pip install 'compactrl[ray]'``.

Layout of a ``backend = "ray"`` run: the driver (``compactrl train``) is the single controller and
trainer rank 0 — it keeps the loop, checkpoints and evaluations exactly as in one process;
``rollout_workers`` actors each hold an engine on their own copy of the weights
(:mod:`compactrl.cluster.rollout`); ``trainer_workers - 1`` actors are the other trainer ranks,
joined to the driver by a torch.distributed group (:mod:`compactrl.cluster.data_parallel`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


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
