"""The ``logging`` section: where a run writes metrics, which experiment trackers mirror them, and
how it reports progress."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoggingConfig:
    """Where a run writes its record (``run_dir``: config.yaml, metrics.jsonl, checkpoints), which
    experiment trackers mirror its metrics, and the terminal's progress report."""

    run_dir: str = "runs/{name}"  # {name} is the experiment name
    # Experiment trackers that mirror metrics.jsonl, any of bpo_megatron.observability.trackers.TRACKERS
    # (tensorboard, wandb, mlflow). null: TensorBoard alone unless tensorboard=false, what runs did
    # before this list existed.
    trackers: tuple[str, ...] | None = None
    # The TensorBoard switch from before `trackers`, kept so existing configs and overrides work:
    # false turns TensorBoard off when `trackers` is null, and contradicts a `trackers` naming it.
    tensorboard: bool = True
    progress: bool = True  # a progress bar and one line per step on the terminal
    wandb_project: str = "bpo-megatron"  # the Weights & Biases project of the run
    # null: a file store in <run_dir>/mlflow; any MLflow tracking URI otherwise (sqlite:///..., http://...)
    mlflow_uri: str | None = None
    mlflow_experiment: str = "bpo-megatron"  # the MLflow experiment the run is recorded under

    def __post_init__(self) -> None:
        from bpo_megatron.observability.trackers import TRACKERS  # a registry of names: imports no tracker

        if self.trackers is None:
            return
        for name in self.trackers:
            TRACKERS.check(name)
        repeated = sorted({name for name in self.trackers if self.trackers.count(name) > 1})
        if repeated:
            raise ValueError(f"logging.trackers lists {repeated[0]} twice; list each tracker once")
        if "tensorboard" in self.trackers and not self.tensorboard:
            raise ValueError(f"logging.tensorboard=false contradicts logging.trackers={list(self.trackers)}, which "
                             "lists tensorboard: drop one of them")

    @property
    def tracker_names(self) -> tuple[str, ...]:
        """The trackers this run starts."""
        if self.trackers is None:
            return ("tensorboard",) if self.tensorboard else ()
        return self.trackers
