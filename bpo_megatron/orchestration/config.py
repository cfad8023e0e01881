"""The ``cluster`` section: where the trainer and rollout actors run."""

from __future__ import annotations

from dataclasses import dataclass

from bpo_megatron.trainer.offload import OFFLOAD_PARTS


@dataclass(frozen=True)
class ClusterConfig:
    """``ray_address`` None starts an embedded Ray on this machine (loopback only). The trainer
    world has ``trainer_ranks`` processes = tp × pp × dp. ``colocate`` puts engines on the
    trainer's devices (phases alternate; weights and KV caches are offloaded on GPU); see
    :mod:`bpo_megatron.orchestration.placement` for where each actor runs. ``offload``: what a
    colocated trainer hands the engines while they generate: ``everything`` (weights and optimizer
    state to host memory), ``optimizer`` (the optimizer state alone), ``nothing`` (trainer and
    engines hold the GPUs together), or ``auto``, the least of these that fits ``gpu_memory_gb``
    by the planner (:mod:`bpo_megatron.planner.offload`; ``bpo-megatron plan`` shows it).

    ``nodes``, ``gpus_per_node`` and ``gpu_memory_gb`` describe the allocation the experiment is
    meant for: the launchers take them as their defaults and ``bpo-megatron plan`` checks the
    layout and the memory per GPU against them. They change nothing on a CPU run.
    """

    ray_address: str | None = None
    trainer_ranks: int = 1
    gpus_per_trainer_rank: float = 0.0  # 1 on a GPU cluster (a rank drives one GPU), 0 on CPUs
    gpus_per_engine: float = 0.0  # GPUs one engine spans (a whole number; its tensor parallelism), 0 on CPUs
    cpus_per_actor: float = 1.0  # CPUs of each placement bundle (one per device), shared when colocated
    colocate: bool = True
    offload: str = "auto"
    placement_timeout_s: float = 300.0  # how long Ray may take to place the actors (autoscaling included)
    object_store_mb: int = 512  # the embedded Ray's object store (weights pass through it to engines that load from it)
    nodes: int = 1
    gpus_per_node: int = 0
    gpu_memory_gb: float = 80.0

    def __post_init__(self) -> None:
        if self.trainer_ranks < 1:
            raise ValueError("cluster.trainer_ranks must be >= 1")
        if self.object_store_mb < 64:
            raise ValueError("cluster.object_store_mb must be >= 64")
        if self.nodes < 1 or self.gpus_per_node < 0:
            raise ValueError(f"cluster.nodes must be >= 1 and cluster.gpus_per_node >= 0, got "
                             f"{self.nodes} and {self.gpus_per_node}")
        if not self.placement_timeout_s > 0:
            raise ValueError(f"cluster.placement_timeout_s must be > 0, got {self.placement_timeout_s}")
        if not self.gpu_memory_gb > 0:
            raise ValueError(f"cluster.gpu_memory_gb must be > 0, got {self.gpu_memory_gb}")
        if self.offload not in ("auto", *OFFLOAD_PARTS):
            raise ValueError(f"cluster.offload={self.offload!r}: choose auto or one of {sorted(OFFLOAD_PARTS)}")
        if self.offload != "auto" and not self.colocate:
            raise ValueError(f"cluster.offload={self.offload} chooses what a trainer sharing its devices with the "
                             "engines hands them; with cluster.colocate=false nothing is shared: leave it auto")
