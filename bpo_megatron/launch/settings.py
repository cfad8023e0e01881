"""Executor settings shared by the launchers (each backend reads the fields it has a use for)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

Packager = Literal["none", "git"]
_GIB = re.compile(r"[1-9][0-9]*Gi")


@dataclass(frozen=True)
class ExecutorSettings:
    """Where and how the driver and the Ray cluster run.

    ``nodes``/``gpus_per_node`` None take the experiment's ``cluster.nodes`` and
    ``cluster.gpus_per_node``. ``cpus_per_node``: the CPUs each Ray node takes (Slurm: by default
    every CPU Slurm gives the job on the node; KubeRay: the worker pods' request, by default 16 per
    GPU). ``memory_per_node``: the KubeRay worker pods' memory request (Kubernetes quantity, by
    default 96Gi per GPU); half of it backs ``/dev/shm`` (NCCL, SGLang, Ray's object store). ``mounts`` are ``SRC:DST`` (Slurm: host paths for the container;
    KubeRay: a host path, or the name of a PersistentVolumeClaim). ``setup`` lines run in every
    container before Ray starts (e.g. ``pip install -e /nemo_run/code``).

    Slurm: ``account``, ``partition``, ``time``; the job directory ``remote_dir`` on the cluster
    (reached over SSH with ``ssh_host``/``ssh_user``, or directly from a login node); the
    ``packager`` ships code to ``/nemo_run/code`` in the containers (``git``: the committed
    repository, whose ``configs/`` CONFIG paths then resolve; ``none``: nothing, so CONFIG must be
    a path inside the container). KubeRay: ``namespace``.
    ``home`` is where NeMo-Run keeps its experiment records (default: NeMo-Run's own home).
    """

    nodes: int | None = None
    gpus_per_node: int | None = None
    cpus_per_node: int | None = None
    memory_per_node: str | None = None
    container_image: str | None = None
    mounts: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    setup: tuple[str, ...] = ()
    account: str | None = None
    partition: str | None = None
    time: str = "04:00:00"
    remote_dir: str | None = None
    ssh_host: str | None = None
    ssh_user: str | None = None
    packager: Packager = "git"
    namespace: str = "default"
    home: str | None = None

    def __post_init__(self) -> None:
        if self.nodes is not None and self.nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise ValueError(f"--gpus-per-node must be >= 0, got {self.gpus_per_node}")
        if self.cpus_per_node is not None and self.cpus_per_node < 1:
            raise ValueError(f"--cpus-per-node must be >= 1, got {self.cpus_per_node}")
        if self.memory_per_node is not None and not _GIB.fullmatch(self.memory_per_node):
            raise ValueError(f"--memory-per-node {self.memory_per_node!r} must be a number of GiB such as 768Gi")
        for mount in self.mounts:
            src, sep, dst = mount.partition(":")
            if not (src and sep and dst.startswith("/")):
                raise ValueError(f"mount {mount!r} must look like SRC:/container/path")
        if self.packager not in ("none", "git"):
            raise ValueError(f"packager {self.packager!r} must be 'none' or 'git'")

    def home_dir(self) -> str:
        if self.home:
            return self.home
        from nemo_run.config import get_nemorun_home

        return get_nemorun_home()
