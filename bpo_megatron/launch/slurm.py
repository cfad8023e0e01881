"""Slurm: a Ray cluster on the allocation, then the driver on the head node.

Built on NeMo-Run's Ray-on-Slurm support: a ``run.Script`` tagged ``use_with_ray_cluster`` in a
``run.Experiment`` makes NeMo-Run's Slurm scheduler render a ``SlurmRayRequest`` from the
executor's ``ray_template`` — ours, ``templates/ray_on_slurm.sub.j2`` beside this module, package data (NeMo-Run's own
templates hard-code 8 GPUs per node and another project's container paths). NeMo-Run fills in the
``#SBATCH`` flags, container image and mounts (plus its job directory at ``/nemo_run``),
environment, log paths and the driver command; the template starts ``ray start --head`` on the
first node, ``ray start --address`` on the others, waits for all of them, then runs
``bpo-megatron train CONFIG overrides... cluster.ray_address=<head>`` on the head node. A sweep is
one experiment with one such job per grid point.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from bpo_megatron.launch.base import Rendered, Resources
from bpo_megatron.launch.experiments import add_jobs, nemo_experiment
from bpo_megatron.launch.runs import Batch, Run, experiment_config
from bpo_megatron.launch.settings import ExecutorSettings

RAY_TEMPLATE = Path(__file__).resolve().parent / "templates" / "ray_on_slurm.sub.j2"  # package data
DRIVER = "bpo-megatron"  # the console script installed in the container


def _packager(settings: ExecutorSettings):
    import nemo_run as run

    packagers = {"none": run.Packager, "git": run.GitArchivePackager}
    return packagers[settings.packager]()


def _tunnel(settings: ExecutorSettings):
    import nemo_run as run

    if settings.ssh_host:
        if not (settings.ssh_user and settings.remote_dir):
            raise ValueError("--ssh-host needs --ssh-user and --remote-dir (the job directory on the cluster)")
        return run.SSHTunnel(host=settings.ssh_host, user=settings.ssh_user, job_dir=settings.remote_dir)
    # submitting from a login node: jobs live under --remote-dir, or NeMo-Run's home
    return run.LocalTunnel(job_dir=settings.remote_dir or str(Path(settings.home_dir()) / "slurm"))


def executor(settings: ExecutorSettings, resources: Resources, template: Path = RAY_TEMPLATE):
    import nemo_run as run

    if not template.is_file():
        raise FileNotFoundError(f"Ray-on-Slurm template {template} not found: the package's data files are "
                                "missing (reinstall bpo-megatron) or the template named does not exist")
    return run.SlurmExecutor(
        account=settings.account,
        partition=settings.partition,
        time=settings.time,
        # job names are bpo-<run>; without a prefix NeMo-Run derives one from the account
        job_name_prefix="bpo-",
        nodes=resources.nodes,
        ntasks_per_node=1,  # one Ray node per machine; Ray places the GPU actors
        gpus_per_node=resources.gpus_per_node or None,
        exclusive=True,
        mem="0",
        container_image=settings.container_image,
        container_mounts=list(settings.mounts),
        # the CPUs each Ray node step takes (the template's default: all the job has on the node)
        env_vars={**settings.env, **({"BPO_CPUS_PER_NODE": str(settings.cpus_per_node)}
                                     if settings.cpus_per_node else {})},
        setup_lines="\n".join(settings.setup) or None,
        tunnel=_tunnel(settings),
        packager=_packager(settings),
        # NeMo-Run joins its template directory with this name; an absolute path selects ours
        ray_template=str(template),
    )


def task(run_: Run):
    """The driver as a NeMo-Run script: ``bpo-megatron train CONFIG overrides...``.

    NeMo-Run writes ``entrypoint path args`` joined by spaces into the sbatch script, so the
    arguments are shell-quoted here.
    """
    import nemo_run as run
    from nemo_run.config import USE_WITH_RAY_CLUSTER_KEY

    args = [shlex.quote(a) for a in run_.driver_args()]
    return run.Script(path=args[0], args=args[1:], entrypoint=DRIVER,
                      metadata={USE_WITH_RAY_CLUSTER_KEY: True})


class SlurmLauncher:
    name = "slurm"

    def _executor(self, batch: Batch, settings: ExecutorSettings):
        return executor(settings, Resources.resolve(settings, experiment_config(batch.runs[0])))

    def render(self, batch: Batch, settings: ExecutorSettings) -> list[Rendered]:
        base = self._executor(batch, settings)
        with nemo_experiment(batch, settings, quiet=True) as exp:
            add_jobs(exp, batch, task, base)
            exp.dryrun(log=False)
            # NeMo-Run keeps each job's dry-run request (a SlurmRayRequest) on the job
            return [Rendered(job.id, "sbatch", job._dryrun_info.request.materialize()) for job in exp.jobs]

    def submit(self, batch: Batch, settings: ExecutorSettings) -> int:
        base = self._executor(batch, settings)
        with nemo_experiment(batch, settings, quiet=False) as exp:
            add_jobs(exp, batch, task, base)
            exp.run(detach=True)  # sbatch and return; the jobs outlive this process
            handles = {job.id: job.handle for job in exp.jobs}
        for name, handle in handles.items():
            print(f"submitted {name}: {handle or 'FAILED'}")
        return 0 if all(handles.values()) else 1


LAUNCHER = SlurmLauncher()
