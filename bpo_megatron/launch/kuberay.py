"""KubeRay: one RayJob per run, a Ray cluster of GPU worker pods and the driver as its entrypoint.

Built on NeMo-Run's ``KubeRayExecutor`` (the RayCluster spec: head, one worker group of
``nodes`` pods with ``gpus_per_node`` GPUs each, image, volumes, environment) and ``KubeRayJob``
(submission through the KubeRay operator). The entrypoint is ``bpo-megatron train CONFIG
overrides... cluster.ray_address=auto``, run in the cluster from ``/workspace``: CONFIG must be in
the image or on a mounted volume. NeMo-Run has no experiment records for KubeRay, so a sweep is
one RayJob per grid point.

The dry run assembles the same manifest ``KubeRayJob.start`` submits, without a kube config.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import sys
from typing import Any

import yaml

from bpo_megatron.launch.base import Rendered, Resources
from bpo_megatron.launch.runs import Batch, Run, experiment_config, sizing_config
from bpo_megatron.launch.settings import ExecutorSettings

DRIVER = "bpo-megatron"
WORKDIR = "/workspace"  # KubeRayJob's working directory of the Ray containers without a workdir
# The driver (the RL loop: data, rewards, samples) runs on the head pod; its memory follows the
# experiment (bpo_megatron.planner.host), its CPUs score the responses.
HEAD_CPU, DEFAULT_HEAD_GIB = "16", 64
# Worker pods' requests unless given; the memory is raised to what the planner says the busiest
# trainer node holds at a checkpoint save (bpo_megatron.planner.host) when that is more.
CPUS_PER_GPU, MEMORY_GIB_PER_GPU = 16, 96
_MAX_NAME = 63  # Kubernetes object names


def _volumes(mounts: tuple[str, ...]) -> tuple[list[dict], list[dict]]:
    """``/host/path:/dst`` becomes a hostPath volume, ``claim:/dst`` a PersistentVolumeClaim."""
    volumes, volume_mounts = [], []
    for i, mount in enumerate(mounts):
        src, _, dst = mount.partition(":")
        name = f"mount-{i}"
        source = {"hostPath": {"path": src}} if src.startswith("/") else {"persistentVolumeClaim": {"claimName": src}}
        volumes.append({"name": name, **source})
        volume_mounts.append({"name": name, "mountPath": dst})
    return volumes, volume_mounts


class _Dumper(yaml.SafeDumper):
    """Writes repeated sub-trees (e.g. the shared lifecycle hook) out in full, without anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _worker_requests(settings: ExecutorSettings, resources: Resources,
                     host_gib: int | None = None) -> tuple[str, int]:
    """The worker pods' CPU request and memory request (= limit) in GiB. ``host_gib``: the host
    memory a trainer node needs at a checkpoint save (the planner's); a ``--memory-per-node``
    below it is refused, the default is raised to it."""
    gpus = max(resources.gpus_per_node, 1)
    if settings.memory_per_node:
        memory = int(settings.memory_per_node.removesuffix("Gi"))
        if host_gib is not None and memory < host_gib:
            raise ValueError(f"--memory-per-node {settings.memory_per_node} is less than the {host_gib}Gi a trainer "
                             "node holds at a checkpoint save (bpo-megatron plan CONFIG: host memory of the busiest "
                             "trainer node): the pod would be killed at the first save; pass --memory-per-node "
                             f"{host_gib}Gi or more, or leave it out")
    else:
        memory = max(gpus * MEMORY_GIB_PER_GPU, host_gib or 0)
    return str(settings.cpus_per_node or gpus * CPUS_PER_GPU), memory


def executor(settings: ExecutorSettings, resources: Resources, *, head_memory_gib: int = DEFAULT_HEAD_GIB,
             host_gib: int | None = None):
    from importlib.metadata import version

    from nemo_run.core.execution.kuberay import KubeRayExecutor, KubeRayWorkerGroup

    if not settings.container_image:
        raise ValueError("kuberay needs --container-image: an image with bpo-megatron installed")
    cpus, memory_gib = _worker_requests(settings, resources, host_gib)
    volumes, volume_mounts = _volumes(settings.mounts)
    # NCCL, SGLang and Ray's object store live in /dev/shm; a container's default is 64 MiB
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{memory_gib // 2}Gi"}})
    volume_mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    lifecycle = {}
    if settings.setup:  # what KubeRayJob.start does with pre_ray_start_commands
        lifecycle["postStart"] = {"exec": {"command": ["/bin/sh", "-c", "\n".join(settings.setup)]}}
    return KubeRayExecutor(
        namespace=settings.namespace,
        ray_version=version("ray"),  # the Ray this project runs with, which the image must carry
        image=settings.container_image,
        head_cpu=HEAD_CPU,
        head_memory=f"{head_memory_gib}Gi",
        worker_groups=[KubeRayWorkerGroup(group_name="gpu-workers", replicas=resources.nodes,
                                          gpus_per_worker=resources.gpus_per_node or None,
                                          cpu_requests=cpus, cpu_limits=cpus, memory_requests=f"{memory_gib}Gi",
                                          memory_limits=f"{memory_gib}Gi")],
        volumes=volumes,
        volume_mounts=volume_mounts,
        env_vars=dict(settings.env),
        lifecycle_kwargs=lifecycle,
    )


def k8s_name(name: str, user: str) -> str:
    """``name`` made a valid Kubernetes name that leaves room for KubeRayJob's decorations
    (``<user>-<name>-rayjob-raycluster``); shortened names keep a hash so they stay distinct."""
    clean = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "run"
    room = _MAX_NAME - len(f"{user}--rayjob-raycluster")
    if len(clean) > room:
        digest = hashlib.sha1(name.encode()).hexdigest()[:6]
        clean = f"{clean[: room - 7].rstrip('-')}-{digest}"
    return clean


def entrypoint(run_: Run) -> str:
    return shlex.join([DRIVER, *run_.driver_args("cluster.ray_address=auto")])


def rayjob_manifest(name: str, ex, command: str, user: str) -> dict[str, Any]:
    """The RayJob ``KubeRayJob(name, ex).start(command)`` creates (nemo-run 0.11)."""
    job_name = f"{user}-{name}-rayjob"
    spec = ex.get_cluster_body(f"{job_name}-raycluster").get("spec", {})
    templates = [spec["headGroupSpec"]["template"], *(w["template"] for w in spec.get("workerGroupSpecs", []))]
    for template in templates:
        for container in template["spec"]["containers"]:
            container["workingDir"] = WORKDIR
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": job_name, "namespace": ex.namespace},
        "spec": {"entrypoint": command, "shutdownAfterJobFinishes": True,
                 "rayClusterSpec": spec, "runtimeEnvYAML": None},
    }


def _node_host_gib(batch: Batch, sized: list, settings: ExecutorSettings) -> int | None:
    """The most host memory a trainer node of any run of ``batch`` holds at a checkpoint save
    (the planner's figure, GiB); None when no run could be planned here, which is said."""
    from bpo_megatron.planner.plan import node_memory_gib

    figures, unplanned = [], []
    for run_, cfg in zip(batch.runs, sized):
        try:
            figure = node_memory_gib(cfg) if cfg is not None else None
        except (OSError, ValueError) as exc:
            unplanned.append(f"{run_.name} ({exc})")
            continue
        if cfg is None:
            unplanned.append(f"{run_.name} ({run_.config} is not on this machine)")
        elif figure is not None:
            figures.append(figure)
    if unplanned:
        memory = settings.memory_per_node or "the per-GPU default"
        print(f"kuberay: the worker pods' memory ({memory}) is not checked against the host memory a checkpoint save "
              f"needs for {', '.join(unplanned)}: run bpo-megatron plan on the config and pass --memory-per-node",
              file=sys.stderr)
    return max(figures, default=None)


class KubeRayLauncher:
    name = "kuberay"

    def _executor(self, batch: Batch, settings: ExecutorSettings):
        from bpo_megatron.planner.host import driver_memory_gib

        sized = [sizing_config(run_) for run_ in batch.runs]
        head = max((driver_memory_gib(cfg) for cfg in sized if cfg is not None), default=DEFAULT_HEAD_GIB)
        return executor(settings, Resources.resolve(settings, experiment_config(batch.runs[0])),
                        head_memory_gib=max(head, DEFAULT_HEAD_GIB), host_gib=_node_host_gib(batch, sized, settings))

    def render(self, batch: Batch, settings: ExecutorSettings) -> list[Rendered]:
        from nemo_run.run.ray.kuberay import get_user

        user = get_user()
        rendered = []
        ex = self._executor(batch, settings)  # the batch's runs share one cluster spec
        for run_ in batch.runs:
            manifest = rayjob_manifest(k8s_name(run_.name, user), ex, entrypoint(run_), user)
            rendered.append(Rendered(run_.name, "manifest", yaml.dump(manifest, Dumper=_Dumper, sort_keys=False)))
        return rendered

    def submit(self, batch: Batch, settings: ExecutorSettings) -> int:
        from nemo_run.run.ray.kuberay import KubeRayJob, get_user

        user = get_user()
        for run_ in batch.runs:
            job = KubeRayJob(name=k8s_name(run_.name, user), executor=self._executor(batch, settings))
            job.start(command=entrypoint(run_))
            print(f"submitted {run_.name}: RayJob {job.job_name} in namespace {settings.namespace}")
        return 0


LAUNCHER = KubeRayLauncher()
