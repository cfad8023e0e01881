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
CPUS_PER_GPU, MEMORY_GIB_PER_GPU = 16, 96  # worker pods' requests unless given
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


def _worker_requests(settings: ExecutorSettings, resources: Resources) -> tuple[str, int]:
    """The worker pods' CPU request and memory request in GiB."""
    gpus = max(resources.gpus_per_node, 1)
    memory = int(settings.memory_per_node.removesuffix("Gi")) if settings.memory_per_node else gpus * MEMORY_GIB_PER_GPU
    return str(settings.cpus_per_node or gpus * CPUS_PER_GPU), memory


def executor(settings: ExecutorSettings, resources: Resources, *, head_memory_gib: int = DEFAULT_HEAD_GIB):
    from importlib.metadata import version

    from nemo_run.core.execution.kuberay import KubeRayExecutor, KubeRayWorkerGroup

    if not settings.container_image:
        raise ValueError("kuberay needs --container-image: an image with bpo-megatron installed")
    cpus, memory_gib = _worker_requests(settings, resources)
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


class KubeRayLauncher:
    name = "kuberay"

    def _executor(self, batch: Batch, settings: ExecutorSettings):
        from bpo_megatron.planner.host import driver_memory_gib

        sized = [sizing_config(run_) for run_ in batch.runs]
        head = max((driver_memory_gib(cfg) for cfg in sized if cfg is not None), default=DEFAULT_HEAD_GIB)
        return executor(settings, Resources.resolve(settings, experiment_config(batch.runs[0])),
                        head_memory_gib=max(head, DEFAULT_HEAD_GIB))

    def render(self, batch: Batch, settings: ExecutorSettings) -> list[Rendered]:
        from nemo_run.run.ray.kuberay import get_user

        user = get_user()
        rendered = []
        for run_ in batch.runs:
            manifest = rayjob_manifest(k8s_name(run_.name, user), self._executor(batch, settings),
                                       entrypoint(run_), user)
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
