"""The ``logging`` section: where a run writes metrics, and how it reports progress."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoggingConfig:
    run_dir: str = "runs/{name}"  # {name} is the experiment name
    tensorboard: bool = True  # also write TensorBoard events when tensorboard is installed
    progress: bool = True  # a progress bar and one line per step on the terminal
