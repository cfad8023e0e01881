"""The ``cluster`` section: where the trainer and rollout actors run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterConfig:
    """``ray_address`` None starts an embedded Ray on this machine (loopback only). The trainer
    world has ``trainer_ranks`` processes = tp × pp × dp. ``colocate`` puts engines on the
    trainer's devices (phases alternate; weights and KV caches are offloaded on GPU)."""

    ray_address: str | None = None
    trainer_ranks: int = 1
    gpus_per_trainer_rank: float = 0.0
    gpus_per_engine: float = 0.0
    cpus_per_actor: float = 1.0
    colocate: bool = True
    object_store_mb: int = 512

    def __post_init__(self) -> None:
        if self.trainer_ranks < 1:
            raise ValueError("cluster.trainer_ranks must be >= 1")
        if self.object_store_mb < 64:
            raise ValueError("cluster.object_store_mb must be >= 64")
