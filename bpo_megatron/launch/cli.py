"""``bpo-megatron launch {local,slurm,kuberay} CONFIG [section.key=value ...] [executor options]``.

Comma-separated values sweep a grid, one job per point in one NeMo-Run experiment:
``loss.name=bpo,grpo,gspo,cispo,dppo_tv`` or ``loss.bpo_eps=0.05,0.1,0.2,0.3``. ``--dryrun``
prints the sbatch scripts / RayJob manifests / command lines without submitting anything.

Exit status: 0 submitted (local: every run succeeded), 1 a job failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env {item!r} must look like KEY=VALUE")
        env[key] = value
    return env


def _mounts(items: list[str]) -> tuple[str, ...]:
    return tuple(m for item in items for m in item.split(",") if m)


def _parser(backends: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bpo-megatron launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("backend", choices=backends)
    parser.add_argument("config", help="experiment YAML, as the driver sees it (see --packager)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides; a,b,c values sweep a grid")
    res = parser.add_argument_group("resources (default: the config's cluster section)")
    res.add_argument("--nodes", type=int)
    res.add_argument("--gpus-per-node", type=int)
    res.add_argument("--cpus-per-node", type=int, help="CPUs of each Ray node (Slurm: default all the job has "
                     "on the node; KubeRay: the worker request, default 16 per GPU)")
    res.add_argument("--memory-per-node", help="KubeRay worker memory request, e.g. 768Gi (default 96Gi per GPU); "
                     "half of it is the pods' /dev/shm")
    res.add_argument("--container-image", help="image with bpo-megatron installed (Slurm: enroot/pyxis)")
    res.add_argument("--mounts", action="append", default=[], metavar="SRC:DST[,SRC:DST]",
                     help="container mounts (KubeRay: a host path or a PersistentVolumeClaim name as SRC)")
    res.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    res.add_argument("--setup", action="append", default=[], metavar="CMD",
                     help="shell command run in every container before Ray starts")
    slurm = parser.add_argument_group("Slurm")
    slurm.add_argument("--account")
    slurm.add_argument("--partition")
    slurm.add_argument("--time", default="04:00:00")
    slurm.add_argument("--remote-dir", help="job directory on the cluster")
    slurm.add_argument("--ssh-host", help="submit over SSH through this login node")
    slurm.add_argument("--ssh-user")
    slurm.add_argument("--packager", choices=["git", "none"], default="git",
                       help="git: ship the committed repository to /nemo_run/code (the driver's working "
                            "directory); none: CONFIG must be a path inside the container")
    parser.add_argument("--namespace", default="default", help="KubeRay: Kubernetes namespace")
    parser.add_argument("--home", help="NeMo-Run's experiment directory (default: NeMo-Run's home)")
    parser.add_argument("--dryrun", action="store_true", help="render the jobs, submit nothing")
    parser.add_argument("--render-dir", type=Path, help="with --dryrun: also write each job to DIR/<name>.<kind>")
    return parser


def main(argv: list[str]) -> int:
    from bpo_megatron.config import ConfigError
    from bpo_megatron.launch import LAUNCHERS, launch
    from bpo_megatron.launch.settings import ExecutorSettings

    args = _parser(list(LAUNCHERS)).parse_intermixed_args(argv)
    try:
        settings = ExecutorSettings(
            nodes=args.nodes, gpus_per_node=args.gpus_per_node, cpus_per_node=args.cpus_per_node,
            memory_per_node=args.memory_per_node, container_image=args.container_image,
            mounts=_mounts(args.mounts), env=_env(args.env), setup=tuple(args.setup),
            account=args.account, partition=args.partition, time=args.time, remote_dir=args.remote_dir,
            ssh_host=args.ssh_host, ssh_user=args.ssh_user, packager=args.packager,
            namespace=args.namespace, home=args.home)
        result = launch(args.backend, args.config, args.overrides, settings, dryrun=args.dryrun)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"bpo-megatron launch: {exc}", file=sys.stderr)
        return 2
    if not args.dryrun:
        return int(result)
    for job in result:
        print(f"# ---- {job.name} ({job.kind}) ----")
        print(job.text.rstrip("\n"))
        if args.render_dir:
            args.render_dir.mkdir(parents=True, exist_ok=True)
            (args.render_dir / f"{job.name}.{job.kind}").write_text(job.text)
    return 0
