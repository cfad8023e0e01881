"""Weights & Biases, offline by default: the run's files in ``<run_dir>/wandb``, uploaded later
with ``wandb sync <run_dir>/wandb/offline-run-*`` (each attempt of the run leaves one directory,
all under the same run id). A ``WANDB_MODE`` the user set (``online``) is honoured instead.

wandb's own step must only grow and starts at 0, while warm-start steps are negative and a step
may be written twice (the warm start's last step and the evaluation at step 0): every record is
one wandb row carrying its step as the ``step`` metric, which every other metric is plotted
against (``define_metric``), wandb's way to log steps of one's own.
"""

from __future__ import annotations

import os
from typing import Any

from bpo_megatron.observability.trackers import TrackedRun, Tracker

STEP_METRIC = "step"


class WandbTracker(Tracker):
    package = "wandb"
    def __init__(self, run: TrackedRun, recorded: dict[str, Any]) -> None:
        import wandb

        project = run.settings.wandb_project
        self.continued = bool(recorded.get("run_id")) and recorded.get("project") == project
        run_id = recorded["run_id"] if self.continued else None  # None: wandb makes one up
        directory = run.run_dir  # wandb puts its files in <dir>/wandb
        # offline unless the user's WANDB_MODE says otherwise (a mode given here would override it):
        # a run never needs the network
        offline = {} if os.environ.get("WANDB_MODE") else {"mode": "offline"}
        settings = wandb.Settings(git_commit=run.git_commit, **offline)
        self._run = wandb.init(project=project, id=run_id, resume="allow", name=run.name, dir=str(directory),
                               notes=f"run directory: {run.run_dir}", config=run.config, settings=settings)
        self._run.config.update(run.config, allow_val_change=True)  # a resume may change resume-safe settings
        self._run.define_metric(STEP_METRIC)
        self._run.define_metric("*", step_metric=STEP_METRIC)
        self._project = project

    def record(self) -> dict[str, Any]:
        return {"run_id": self._run.id, "project": self._project}

    def log(self, step: int, metrics: dict[str, float], time: float) -> None:
        self._run.log({**metrics, STEP_METRIC: step})

    def close(self, *, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)
