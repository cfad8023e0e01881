"""What every launcher offers, and what a dry run returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from bpo_megatron.experiment import ExperimentConfig
    from bpo_megatron.launch.runs import Batch
    from bpo_megatron.launch.settings import ExecutorSettings


@dataclass(frozen=True)
class Rendered:
    """One job as it would be submitted: an sbatch script, a manifest or a command line."""

    name: str
    kind: str  # "sbatch" | "manifest" | "command": also the file suffix of --render-dir
    text: str


@dataclass(frozen=True)
class Resources:
    """Nodes and GPUs of one job: the settings' if given, else the experiment's cluster section."""

    nodes: int
    gpus_per_node: int

    @classmethod
    def resolve(cls, settings: ExecutorSettings, cfg: ExperimentConfig | None) -> Resources:
        nodes = settings.nodes or (cfg.cluster.nodes if cfg else 1)
        gpus = settings.gpus_per_node if settings.gpus_per_node is not None else (
            cfg.cluster.gpus_per_node if cfg else 0)
        return cls(nodes=nodes, gpus_per_node=gpus)


class Launcher(Protocol):
    name: str

    def render(self, batch: Batch, settings: ExecutorSettings) -> list[Rendered]:
        """The jobs, without submitting anything (no cluster, no network)."""

    def submit(self, batch: Batch, settings: ExecutorSettings) -> int:
        """Submit (or, locally, run) the jobs; 0 when all were accepted (or succeeded)."""
