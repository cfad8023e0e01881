"""Where the actors run: one Ray placement group, one bundle per device, engines on the trainer's
devices (``cluster.colocate``) or on their own.

A *slot* is a bundle in logical order: bundles are sorted by (node, GPU id) once Ray has placed
them, so consecutive trainer ranks (and so tensor-parallel groups, which Megatron builds from
consecutive ranks) stay inside a node, and an engine's GPUs are consecutive GPUs of one node.

* Colocated: ``max(trainer ranks, engines × engine GPUs)`` bundles. Trainer rank ``r`` takes half
  of slot ``r`` (its GPU and CPUs); engine ``i`` spans slots ``[i·t, (i+1)·t)`` and its actor takes
  the other half of the first one (fractional shares of one bundle get the same GPU). The
  engine's server uses all ``t`` GPUs of its slots.
* Apart: ``trainer ranks + engines × engine GPUs`` bundles: the trainer's first, then each
  engine's ``t``.
* Evaluation engines (``eval.mode=background``) always have bundles of their own, after all the
  others (colocated or not): they generate while the trainer trains, so they share no device.
* Every bundle is alike (one GPU, ``cluster.cpus_per_actor`` CPUs): Ray packs bundles greedily by
  size, and bundles of unequal CPU counts can leave GPUs of a node without CPUs to go with them.
* On a CPU-only cluster (no ``gpus_per_*``) the same layout is made of CPU bundles.

A layout the cluster cannot hold fails at once naming the ``cluster.*`` fields (or after
``cluster.placement_timeout_s`` when the totals fit but Ray cannot place the bundles), never a
silent wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TRAINER_SHARE = 0.5  # of a shared GPU bundle; the engine actor takes the rest
LAYOUT_FIELDS = ("cluster.trainer_ranks, cluster.gpus_per_trainer_rank, rollout.num_engines, "
                 "cluster.gpus_per_engine, cluster.colocate, cluster.cpus_per_actor, eval.mode, eval.engines")
ROLLOUT, EVALUATION = "rollout", "evaluation"  # the roles of engines


class PlacementError(RuntimeError):
    """Ray cannot place the layout; the message names the fields that decide it."""


@dataclass(frozen=True)
class Slot:
    """Where one actor runs: a logical bundle and the resources it takes there."""

    bundle: int
    num_cpus: float
    num_gpus: float


@dataclass(frozen=True)
class LayoutPlan:
    bundles: tuple[dict[str, float], ...]
    trainer: tuple[Slot, ...]
    engines: tuple[Slot, ...]  # each engine actor's slot (the first of its bundles)
    engine_bundles: tuple[tuple[int, ...], ...]  # the slots whose devices each engine uses
    uses_gpus: bool
    eval_engines: tuple[Slot, ...] = ()  # background evaluation engines, on bundles of their own
    eval_engine_bundles: tuple[tuple[int, ...], ...] = ()

    def engine_slots(self, role: str) -> tuple[tuple[Slot, ...], tuple[tuple[int, ...], ...]]:
        """The slots of the engines of ``role`` (rollout or evaluation) and the slots they span."""
        if role == EVALUATION:
            return self.eval_engines, self.eval_engine_bundles
        return self.engines, self.engine_bundles

    @property
    def gpus(self) -> float:
        return sum(b.get("GPU", 0.0) for b in self.bundles)

    @property
    def cpus(self) -> float:
        return sum(b.get("CPU", 0.0) for b in self.bundles)


def plan_layout(cluster: Any, *, num_engines: int, eval_engines: int = 0) -> LayoutPlan:
    """The bundles of a run's trainer and ``num_engines`` engines (0: the trainer alone), then
    ``eval_engines`` evaluation engines on bundles of their own."""
    ranks, cpus = cluster.trainer_ranks, cluster.cpus_per_actor
    uses_gpus = cluster.gpus_per_trainer_rank > 0 or cluster.gpus_per_engine > 0
    if uses_gpus:
        if cluster.gpus_per_trainer_rank != 1:
            raise PlacementError(f"cluster.gpus_per_trainer_rank={cluster.gpus_per_trainer_rank:g}: a trainer rank "
                                 "drives one GPU (1), or none on a CPU cluster (0)")
        whole = cluster.gpus_per_engine >= 1 and cluster.gpus_per_engine == int(cluster.gpus_per_engine)
        if (num_engines or eval_engines) and not whole:
            raise PlacementError(f"cluster.gpus_per_engine={cluster.gpus_per_engine:g}: an engine spans a whole "
                                 "number of GPUs (its tensor parallelism)")
    width = int(cluster.gpus_per_engine) if uses_gpus else 1
    engine_devices = num_engines * width
    if cluster.colocate and num_engines:
        if engine_devices > ranks:
            raise PlacementError(
                f"colocated engines need {num_engines} × {width} = {engine_devices} devices but the trainer has "
                f"{ranks} (rollout.num_engines × cluster.gpus_per_engine ≤ cluster.trainer_ranks, or "
                "cluster.colocate=false)")
        first, count, share = 0, ranks, TRAINER_SHARE
    else:
        first, count, share = ranks, ranks + engine_devices, 1.0
    gpu = 1.0 if uses_gpus else 0.0
    trainer = tuple(Slot(r, cpus * share, gpu * share) for r in range(ranks))
    engine_bundles = tuple(tuple(range(first + i * width, first + (i + 1) * width)) for i in range(num_engines))
    engine_share = 1.0 - share if first == 0 else 1.0
    engines = tuple(Slot(spans[0], cpus * engine_share, gpu * engine_share) for spans in engine_bundles)
    eval_bundles = tuple(tuple(range(count + i * width, count + (i + 1) * width)) for i in range(eval_engines))
    evaluation = tuple(Slot(spans[0], float(cpus), gpu) for spans in eval_bundles)
    count += eval_engines * width
    bundle = {"CPU": float(cpus), **({"GPU": 1.0} if uses_gpus else {})}
    return LayoutPlan(tuple(dict(bundle) for _ in range(count)), trainer, engines, engine_bundles, uses_gpus,
                      evaluation, eval_bundles)


def _where() -> tuple[str, list[int]]:
    """This task's node (Ray's node id: several nodes may share an address) and GPU ids."""
    import ray

    return ray.get_runtime_context().get_node_id(), [int(g) for g in ray.get_gpu_ids()]


def logical_order(where: list[tuple[str, list[int]]]) -> list[int]:
    """The bundles (given by where Ray put each: its node and GPU ids) in logical order: nodes in
    the order their first bundle appears, GPUs ascending within a node (bundle index without GPUs)."""
    nodes = {node: rank for rank, node in enumerate(dict.fromkeys(node for node, _ in where))}
    return sorted(range(len(where)), key=lambda b: (nodes[where[b][0]], where[b][1] or [b], b))


class Placement:
    """The placement group of a :class:`LayoutPlan`, its bundles in logical (node, GPU) order."""

    def __init__(self, plan: LayoutPlan, *, timeout_s: float) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.plan = plan
        self._check_totals()
        self.group = placement_group(list(plan.bundles), strategy="PACK")
        try:
            ray.get(self.group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.remove()
            raise PlacementError(
                f"Ray could not place {len(plan.bundles)} bundles ({plan.gpus:g} GPUs, {plan.cpus:g} CPUs) within "
                f"{timeout_s:.0f} s (cluster.placement_timeout_s): the nodes lack the resources for this layout "
                f"({LAYOUT_FIELDS}); available: {ray.available_resources()}") from None
        self.order, self.where = self._sort_bundles()
        self._check_engine_spans()

    # -------------------------------------------------------------------------------- layout
    def _check_totals(self) -> None:
        import ray

        total = ray.cluster_resources()
        short = [f"{need:g} {kind}s, the cluster has {total.get(kind, 0):g}"
                 for kind, need in (("GPU", self.plan.gpus), ("CPU", self.plan.cpus))
                 if need > total.get(kind, 0.0) + 1e-9]
        if short:
            raise PlacementError(f"the layout needs {' and '.join(short)} ({LAYOUT_FIELDS})")

    def _sort_bundles(self) -> tuple[list[int], list[tuple[str, list[int]]]]:
        """Physical bundle of each logical slot, sorted by (node, GPU); each bundle's node and GPUs."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        probes = []
        for index, bundle in enumerate(self.plan.bundles):
            resources = {"num_gpus": 0.01} if self.plan.uses_gpus else {"num_cpus": 0.01}
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=index)
            probes.append(ray.remote(_where).options(scheduling_strategy=strategy, **resources).remote())
        where = ray.get(probes)
        return logical_order(where), where

    def _check_engine_spans(self) -> None:
        for role, engine, spans in [*((ROLLOUT, e, s) for e, s in enumerate(self.plan.engine_bundles)),
                                    *((EVALUATION, e, s) for e, s in enumerate(self.plan.eval_engine_bundles))]:
            nodes = {self.where[self.order[s]][0] for s in spans}
            if len(nodes) > 1:
                raise PlacementError(f"{role} engine {engine}'s {len(spans)} GPUs landed on {len(nodes)} nodes; an engine's "
                                     "tensor parallelism stays in a node: make cluster.gpus_per_engine divide the "
                                     "GPUs of a node")

    # ------------------------------------------------------------------------------ options
    def _options(self, slot: Slot) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                    placement_group_bundle_index=self.order[slot.bundle])
        return {"num_cpus": slot.num_cpus, "num_gpus": slot.num_gpus, "scheduling_strategy": strategy}

    def trainer_options(self, rank: int) -> dict[str, Any]:
        """Ray actor options of trainer rank ``rank``."""
        return self._options(self.plan.trainer[rank])

    def engine_options(self, engine: int, role: str = ROLLOUT) -> dict[str, Any]:
        return self._options(self.plan.engine_slots(role)[0][engine])

    def engine_gpus(self, engine: int, role: str = ROLLOUT) -> tuple[int, ...]:
        """The GPU ids (on its node) the engine's server uses: one per slot it spans."""
        return tuple(gpu for s in self.plan.engine_slots(role)[1][engine] for gpu in self.where[self.order[s]][1])

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
