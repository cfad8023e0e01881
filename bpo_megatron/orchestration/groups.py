"""Groups of Ray actors: the trainer world and the rollout engines.

The trainer ranks sit in one placement group and form their own ``torch.distributed`` world
(gloo on CPU, NCCL on GPU). The engines are independent actors; a dead (or, with a timeout,
hung) engine is replaced and its unfinished requests are sent again.
"""

from __future__ import annotations

import logging
import time
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
    """``rollout.num_engines`` engines; requests are spread over them in contiguous slices.

    An engine whose actor dies (its process killed or crashed) is replaced by a fresh one, and so
    is, with ``generate_timeout_s``, one that has not answered a ``generate`` within that many
    seconds (it is killed first: a hung engine is as useless as a dead one). ``on_restart`` is then
    called with the replaced indices (to load the current weights into them) before their shares
    are sent again; the answers of the other engines are kept. ``max_restarts`` per engine, on
    average, bounds the replacements over the group's life.
    """

    def __init__(self, cfg, model_dir: str, *, max_restarts: int = 2,
                 generate_timeout_s: float | None = None) -> None:
        import ray

        if generate_timeout_s is not None and not generate_timeout_s > 0:
            raise ValueError(f"generate_timeout_s must be > 0 (or None: wait forever), got {generate_timeout_s}")
        self.cfg, self.model_dir = cfg, model_dir
        self.max_restarts = max_restarts
        self.generate_timeout_s = generate_timeout_s
        self.restarts = 0
        self.on_restart: Callable[[list[int]], None] | None = None  # reload weights into new engines
        self._actor = ray.remote(EngineWorker)
        self.workers = self._start(list(range(cfg.rollout.num_engines)))

    def _start(self, indices: list[int]) -> list:
        """New engines for ``indices``, started side by side: each spends seconds importing its
        libraries and loading the model, mostly waiting on the disk."""
        import ray

        workers = [self._actor.options(num_cpus=self.cfg.cluster.cpus_per_actor,
                                       num_gpus=self.cfg.cluster.gpus_per_engine).remote(self.cfg, self.model_dir, i)
                   for i in indices]
        ray.get([w.captures_routing.remote() for w in workers])  # raise here if an engine cannot start
        return workers

    def captures_routing(self) -> bool:
        import ray

        return all(ray.get([w.captures_routing.remote() for w in self.workers]))

    def generate(self, requests: list) -> list:
        """All samples, in request order; a dead or hung engine is replaced and its share re-sent."""
        shares = _split(requests, len(self.workers))
        results: list[list | None] = [[] if not share else None for share in shares]
        pending = [i for i, share in enumerate(shares) if share]
        while pending:
            futures = {i: self.workers[i].generate.remote(shares[i]) for i in pending}
            failed = self._collect(futures, results)
            if failed:
                self._replace(failed)
            pending = failed
        return [sample for part in results for sample in part]

    def _collect(self, futures: dict[int, Any], results: list[list | None]) -> list[int]:
        """Store every engine's answer; return the engines that died or ran out of time (the
        engines work in parallel, so they share one deadline)."""
        import ray

        timeout = self.generate_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        failed = []
        for i, future in futures.items():
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                results[i] = ray.get(future, timeout=left)
            except ray.exceptions.GetTimeoutError:
                log.warning("rollout engine %d did not answer within %.0f s; replacing it", i, timeout)
                ray.kill(self.workers[i])
                failed.append(i)
            except ray.exceptions.RayActorError:
                log.warning("rollout engine %d died; replacing it", i)
                failed.append(i)
        return failed

    def _replace(self, indices: list[int]) -> None:
        if self.restarts + len(indices) > self.max_restarts * max(1, len(self.workers)):
            raise RuntimeError(f"rollout engines {indices} died or timed out again after {self.restarts} "
                               f"restarts (at most {self.max_restarts} per engine)")
        for i, worker in zip(indices, self._start(indices)):
            self.workers[i] = worker
        self.restarts += len(indices)
        if self.on_restart is not None:
            self.on_restart(indices)

    def call(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            try:  # bounded: a hung engine must not hang the shutdown; it is killed either way
                ray.get(w.shutdown.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            ray.kill(w)


def _split(items: list, parts: int) -> list[list]:
    size, extra = divmod(len(items), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(parts)]
