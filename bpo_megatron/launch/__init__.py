"""Launchers built on NeMo-Run: ``local`` (embedded Ray), ``slurm`` (Ray on the allocation, then
the driver), ``kuberay`` (a RayJob).

    from bpo_megatron.launch import ExecutorSettings, launch
    rendered = launch("slurm", "configs/qwen3_30b_a3b_bpo.yaml", ["loss.name=bpo,grpo"],
                      ExecutorSettings(nodes=4, gpus_per_node=8, container_image="..."), dryrun=True)

Comma-separated override values form a grid: one job per point, one NeMo-Run experiment
(:mod:`.sweep`). Each backend is a module with a ``LAUNCHER`` (see :class:`.base.Launcher`),
imported on use: NeMo-Run takes seconds to import.
"""

from __future__ import annotations

from bpo_megatron.launch.base import Launcher, Rendered
from bpo_megatron.launch.runs import Batch, validate_runs
from bpo_megatron.launch.settings import ExecutorSettings
from bpo_megatron.launch.sweep import expand
from bpo_megatron.registry import LazyRegistry

LAUNCHERS = LazyRegistry({
    "local": "bpo_megatron.launch.local:LAUNCHER",
    "slurm": "bpo_megatron.launch.slurm:LAUNCHER",
    "kuberay": "bpo_megatron.launch.kuberay:LAUNCHER",
}, unknown="unknown launcher {name!r}; choose one of {listed}")


def launcher(name: str) -> Launcher:
    return LAUNCHERS.load(name)


def plan_batch(config: str, overrides: list[str], settings: ExecutorSettings) -> Batch:
    """The runs of a launch (a grid expands to one per point), validated against their configs.
    Explicit ``--nodes``/``--gpus-per-node`` are recorded in each run's config as well."""
    recorded = [f"cluster.{key}={value}" for key, value in
                (("nodes", settings.nodes), ("gpus_per_node", settings.gpus_per_node)) if value is not None]
    batch = expand(config, list(overrides) + recorded)
    validate_runs(batch.runs)
    return batch


def launch(backend: str, config: str, overrides: list[str], settings: ExecutorSettings, *,
           dryrun: bool = False) -> list[Rendered] | int:
    """Render (``dryrun``) or submit one launch; submitting returns the exit status."""
    chosen = launcher(backend)
    batch = plan_batch(config, overrides, settings)
    return chosen.render(batch, settings) if dryrun else chosen.submit(batch, settings)


__all__ = ["ExecutorSettings", "LAUNCHERS", "Rendered", "launch", "launcher", "plan_batch"]
