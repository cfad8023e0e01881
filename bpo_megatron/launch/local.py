"""Local: the driver on this machine with its embedded Ray, through NeMo-Run's local executor.

Each run is ``python -m bpo_megatron.cli train CONFIG overrides...`` with this interpreter (the
environment the launcher runs in), so it works without activating a virtual environment. A sweep
runs its points one after the other.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from bpo_megatron.launch.base import Rendered
from bpo_megatron.launch.experiments import add_jobs, nemo_experiment
from bpo_megatron.launch.runs import Batch, Run
from bpo_megatron.launch.settings import ExecutorSettings

_MODULE = "bpo_megatron.cli"


def _args(run_: Run) -> list[str]:
    # absolute, so the recorded task still points at the file from any directory
    local = Run(name=run_.name, config=str(Path(run_.config).resolve()), overrides=run_.overrides)
    return local.driver_args()


def task(run_: Run):
    import nemo_run as run

    return run.Script(path=_MODULE, m=True, entrypoint=sys.executable, args=_args(run_))


class LocalLauncher:
    name = "local"

    def render(self, batch: Batch, settings: ExecutorSettings) -> list[Rendered]:
        return [Rendered(r.name, "command", shlex.join([sys.executable, "-m", _MODULE, *_args(r)]))
                for r in batch.runs]

    def submit(self, batch: Batch, settings: ExecutorSettings) -> int:
        import nemo_run as run
        from torchx.specs import AppState

        with nemo_experiment(batch, settings, quiet=False) as exp:
            add_jobs(exp, batch, task, run.LocalExecutor(env_vars=dict(settings.env)))
            exp.run(sequential=True, tail_logs=True)
        # leaving the context waited for the jobs: their states are final
        failed = 0
        for job in exp.jobs:
            ok = job.state == AppState.SUCCEEDED
            failed += not ok
            print(f"{job.id}: {job.state.name} "
                  f"(logs under {job.executor.job_dir})", flush=True)
        return 0 if not failed else 1


LAUNCHER = LocalLauncher()
