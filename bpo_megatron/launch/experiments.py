"""The NeMo-Run experiment one launch becomes (local and Slurm backends)."""

from __future__ import annotations

from bpo_megatron.launch.runs import Batch
from bpo_megatron.launch.settings import ExecutorSettings


def nemo_experiment(batch: Batch, settings: ExecutorSettings, *, quiet: bool):
    """A ``run.Experiment`` titled after the batch, recorded under the settings' home directory
    (passed explicitly, so nothing depends on NeMo-Run's environment variables)."""
    import nemo_run as run

    return run.Experiment(batch.title, base_dir=settings.home_dir(), log_level="WARN",
                          clean_mode=quiet, enable_goodbye_message=False)


def add_jobs(exp, batch: Batch, task, executor) -> None:
    """One job per run, each with its own copy of the executor (NeMo-Run assigns job dirs to it)."""
    for run_ in batch.runs:
        exp.add(task(run_), executor=executor.clone(), name=run_.name)
