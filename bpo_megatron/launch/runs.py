"""Runs to launch: a config, its overrides and a name, one per grid point.

A run's driver is ``bpo-megatron train CONFIG overrides...``; each backend adds how the driver
reaches its Ray cluster (``cluster.ray_address=...``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bpo_megatron.config import apply_overrides, load_yaml

if TYPE_CHECKING:
    from bpo_megatron.experiment import ExperimentConfig


@dataclass(frozen=True)
class Run:
    name: str  # unique within a launch: the NeMo-Run task name and the experiment's ``name``
    config: str  # as the driver will see it (relative to its working directory, or absolute)
    overrides: tuple[str, ...]

    def driver_args(self, *extra: str) -> list[str]:
        """Arguments of ``bpo-megatron``: ``train CONFIG overrides... extra...``."""
        return ["train", self.config, *self.overrides, *extra]


@dataclass(frozen=True)
class Batch:
    """What one launch command submits: one NeMo-Run experiment titled ``title``."""

    title: str  # the experiment's base name
    runs: tuple[Run, ...]


def experiment_name(config: str, overrides: list[str]) -> str:
    """The experiment's ``name`` (the YAML's, after overrides), or the config file's stem when the
    file is not on this machine."""
    data = load_yaml(config) if Path(config).is_file() else {}
    name = apply_overrides(data, list(overrides)).get("name")
    return str(name) if name else Path(config).stem


def validate_runs(runs: tuple[Run, ...]) -> None:
    """Load every run's config with its overrides, so a typo fails here and not on the cluster.

    The model is not checked (its checkpoint usually lives on the cluster only); configs that are
    not on this machine are left to the driver.
    """
    from bpo_megatron.experiment import load_experiment

    for run in runs:
        if Path(run.config).is_file():
            load_experiment(run.config, list(run.overrides), check_model=False)


def experiment_config(run: Run) -> ExperimentConfig | None:
    """The run's resolved config when its file is on this machine (for the cluster section)."""
    from bpo_megatron.experiment import load_experiment

    if not Path(run.config).is_file():
        return None
    return load_experiment(run.config, list(run.overrides), check_model=False)


def sizing_config(run: Run) -> ExperimentConfig | None:
    """:func:`experiment_config` for sizing the job: a ``model.path`` override naming a checkpoint
    only the cluster has is left out, so the recipe's own architecture file describes the model."""
    local = tuple(o for o in run.overrides
                  if not (o.startswith("model.path=") and not Path(o.partition("=")[2]).exists()))
    return experiment_config(Run(run.name, run.config, local))
