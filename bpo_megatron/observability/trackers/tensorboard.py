"""TensorBoard event files in ``<run_dir>/tensorboard``."""

from __future__ import annotations

import shutil
from typing import Any

import yaml

from bpo_megatron.observability.trackers import TrackedRun, Tracker


class TensorBoardTracker(Tracker):
    package = "tensorboard"
    rewinds = True  # purge_step hides the events of steps after the checkpoint

    def __init__(self, run: TrackedRun, recorded: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        events = run.run_dir / "tensorboard"
        if run.resume_after is None:
            shutil.rmtree(events, ignore_errors=True)  # a fresh start keeps nothing of an earlier attempt
        first_step = 0 if run.resume_after is None else run.resume_after + 1
        self.continued = run.resume_after is not None
        self._writer = SummaryWriter(str(events), purge_step=None if run.resume_after is None else first_step)
        # the identity and the config this attempt runs with, at the first step it logs
        identity = f"name: {run.name}  \nrun directory: {run.run_dir}  \ngit commit: {run.git_commit or 'unknown'}"
        self._writer.add_text("run", identity, first_step)
        self._writer.add_text("config", "```\n" + yaml.safe_dump(run.config, sort_keys=False) + "```", first_step)

    def log(self, step: int, metrics: dict[str, float], time: float) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step, walltime=time)
        self._writer.flush()

    def close(self, *, failed: bool) -> None:
        self._writer.close()
