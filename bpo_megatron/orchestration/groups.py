"""Groups of Ray actors: the trainer world and the rollout engines.

The trainer ranks sit in one placement group and form their own ``torch.distributed`` world
(gloo on CPU, NCCL on GPU). The engines are independent actors; a dead engine is replaced and
its unfinished requests are sent again.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from bpo_megatron.orchestration.workers import EngineWorker, TrainWorker

log = logging.getLogger(__name__)


def _address_and_port() -> tuple[str, int]:
    import ray

    from bpo_megatron.orchestration.cluster import free_port

    return ray.util.get_node_ip_address(), free_port()


class TrainerGroup:
    def __init__(self, cfg, *, threads_per_rank: int = 1) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ranks = cfg.cluster.trainer_ranks
        bundle = {"CPU": cfg.cluster.cpus_per_actor}
        if cfg.cluster.gpus_per_trainer_rank:
            bundle["GPU"] = cfg.cluster.gpus_per_trainer_rank
        self.placement = placement_group([dict(bundle) for _ in range(ranks)], strategy="PACK")
        ray.get(self.placement.ready())

        def on_bundle(index: int):
            return PlacementGroupSchedulingStrategy(placement_group=self.placement,
                                                    placement_group_bundle_index=index)

        # The rendezvous address is rank 0's node, found by running a task in its bundle.
        probe = ray.remote(num_cpus=0)(_address_and_port).options(scheduling_strategy=on_bundle(0))
        address, port = ray.get(probe.remote())
        actor = ray.remote(TrainWorker)
        self.workers = [
            actor.options(num_cpus=cfg.cluster.cpus_per_actor, num_gpus=cfg.cluster.gpus_per_trainer_rank,
                          scheduling_strategy=on_bundle(rank)).remote(cfg, rank, ranks, f"{address}:{port}",
                                                                       threads_per_rank)
            for rank in range(ranks)
        ]
        ray.get([w.ready.remote() for w in self.workers])

    def call(self, method: str, *args: Any) -> list[Any]:
        """Every rank runs ``method`` (the trainer's methods are collective)."""
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def on_last_stage(self, method: str, *args: Any) -> Any:
        """Collective call whose result lives on the last pipeline stage (the last rank)."""
        return self.call(method, *args)[-1]

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            self.call("shutdown")
        finally:
            for w in self.workers:
                ray.kill(w)
            remove_placement_group(self.placement)


class EngineGroup:
    """``rollout.num_engines`` engines; requests are spread over them in contiguous slices."""

    def __init__(self, cfg, model_dir: str, *, max_restarts: int = 2) -> None:
        import ray

        self.cfg, self.model_dir = cfg, model_dir
        self.max_restarts = max_restarts
        self._actor = ray.remote(EngineWorker)
        self.workers = [self._start(i) for i in range(cfg.rollout.num_engines)]
        self.restarts = 0
        self.on_restart: Callable[[list[int]], None] | None = None  # reload weights into new engines

    def _start(self, index: int):
        import ray

        worker = self._actor.options(num_cpus=self.cfg.cluster.cpus_per_actor,
                                     num_gpus=self.cfg.cluster.gpus_per_engine).remote(self.cfg, self.model_dir, index)
        ray.get(worker.captures_routing.remote())  # raise here if the engine cannot start
        return worker

    def captures_routing(self) -> bool:
        import ray

        return all(ray.get([w.captures_routing.remote() for w in self.workers]))

    def generate(self, requests: list) -> list:
        """All samples, in request order; an engine that dies is replaced and its share re-sent."""
        import ray

        shares = _split(requests, len(self.workers))
        results: list[list | None] = [None] * len(shares)
        pending = [i for i, share in enumerate(shares) if share]
        for i, share in enumerate(shares):
            if not share:
                results[i] = []
        while pending:
            futures = {i: self.workers[i].generate.remote(shares[i]) for i in pending}
            dead = []
            for i, future in futures.items():
                try:
                    results[i] = ray.get(future)
                except ray.exceptions.RayActorError:
                    dead.append(i)
            if dead:
                self._replace(dead)
            pending = dead
        return [sample for part in results for sample in part]

    def _replace(self, indices: list[int]) -> None:
        if self.restarts + len(indices) > self.max_restarts * max(1, len(self.workers)):
            raise RuntimeError(f"rollout engines {indices} died again after {self.restarts} restarts")
        for i in indices:
            log.warning("rollout engine %d died; starting a new one and re-sending its requests", i)
            self.workers[i] = self._start(i)
            self.restarts += 1
        if self.on_restart is not None:
            self.on_restart(indices)

    def call(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.get(w.shutdown.remote())
            except ray.exceptions.RayActorError:
                pass
            ray.kill(w)


def _split(items: list, parts: int) -> list[list]:
    size, extra = divmod(len(items), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(parts)]
