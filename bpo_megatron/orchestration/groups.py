"""Groups of Ray actors: the trainer world and the rollout engines.

The trainer ranks sit in one placement group and form their own ``torch.distributed`` world
(gloo on CPU, NCCL on GPU). Their calls are collective, so one rank that fails leaves the others
waiting in a collective: the group then kills every rank at once and raises that rank's error
(:class:`TrainerFailed`), instead of waiting for the collective's timeout. The engines are
independent actors; a dead (or, with a timeout, hung) engine is replaced and its unfinished
requests are sent again, and one found dead between rollouts is replaced before the next.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from bpo_megatron.orchestration.cluster import address_and_free_port
from bpo_megatron.orchestration.placement import Placement, plan_layout
from bpo_megatron.orchestration.workers import EngineWorker, TrainWorker
from bpo_megatron.rollout.engine import EngineLost

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 30.0  # an engine that cannot say whether it is healthy in this time is not
FAILURE_GRACE_S = 2.0  # after a rank fails, how long the others get to report why they did


def run_placement(cfg) -> Placement:
    """The placement of a run's trainer and engines (``cluster`` and ``rollout.num_engines``)."""
    return Placement(plan_layout(cfg.cluster, num_engines=cfg.rollout.num_engines),
                     timeout_s=cfg.cluster.placement_timeout_s)


class TrainerFailed(RuntimeError):
    """A trainer rank raised or died; every rank has been stopped. ``str()`` is one line naming
    the rank and what happened; ``details`` holds the rank's traceback, when it raised."""

    def __init__(self, summary: str, details: str = "") -> None:
        super().__init__(summary)
        self.details = details


def _failure(ref) -> Exception | None:
    """The error a finished call ended with, or None."""
    import ray

    try:
        ray.get(ref)
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
        return exc
    return None


def _trainer_failed(failures: list[tuple[int, Exception]], what: str) -> TrainerFailed:
    """One error for the first cause: a rank that died before one that raised (its peers' errors
    follow from it), otherwise the lowest rank that raised; the others are listed in the details."""
    import ray

    died = [(rank, exc) for rank, exc in failures if not isinstance(exc, ray.exceptions.RayTaskError)]
    rank, exc = (died or failures)[0]
    others = "".join(f"\n(trainer rank {r} also failed: {type(_cause(e)).__name__}: {_cause(e)})"
                     for r, e in failures if r != rank)
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = _cause(exc)
        # str() of Ray's error is the rank's own traceback
        return TrainerFailed(f"trainer rank {rank} failed in {what}: {type(cause).__name__}: {cause}",
                             str(exc) + others)
    return TrainerFailed(f"trainer rank {rank} died during {what} (its process was killed or crashed); every rank "
                         "was stopped", others.strip())


def _cause(exc: Exception) -> Exception:
    return getattr(exc, "cause", None) or exc


class EnginesFailed(RuntimeError):
    """Rollout engines kept dying or hanging beyond their restart budget."""


class PendingGeneration:
    """Requests shared out over the engines, generating; :meth:`result` gathers the samples (a
    dead or hung engine is replaced and its share re-sent, to the engines of that moment)."""

    def __init__(self, engines: EngineGroup, requests: list) -> None:
        self._engines = engines
        self._shares = _split(requests, len(engines.workers))
        self._results: list[list | None] = [[] if not share else None for share in self._shares]
        self._futures = {i: engines.workers[i].generate.remote(share) for i, share in enumerate(self._shares) if share}
        self._samples: list | None = None

    def result(self) -> list:
        """All samples, in request order (waits for them the first time)."""
        while self._samples is None:
            failed = self._engines._collect(self._futures, self._results)
            if failed:
                self._engines.replace(failed)
                self._futures = {i: self._engines.workers[i].generate.remote(self._shares[i]) for i in failed}
            else:
                self._samples = [sample for part in self._results for sample in part]
        return self._samples


class TrainerGroup:
    """The trainer ranks, on their slots of ``placement`` (by default a placement of their own)."""

    def __init__(self, cfg, *, threads_per_rank: int = 1, placement: Placement | None = None) -> None:
        import ray

        ranks = cfg.cluster.trainer_ranks
        self.workers: list = []
        self._owns_placement = placement is None
        self.placement = placement or Placement(plan_layout(cfg.cluster, num_engines=0),
                                                timeout_s=cfg.cluster.placement_timeout_s)
        # The rendezvous address is rank 0's node, found by running a task on its slot.
        options = self.placement.trainer_options(0)
        probe = ray.remote(address_and_free_port).options(num_cpus=0, scheduling_strategy=options["scheduling_strategy"])
        address, port = ray.get(probe.remote())
        actor = ray.remote(TrainWorker)
        self.workers = [
            actor.options(**self.placement.trainer_options(rank)).remote(cfg, rank, ranks, f"{address}:{port}",
                                                                         threads_per_rank)
            for rank in range(ranks)
        ]
        # each rank's data-parallel index and size, and whether it returns its share's results
        self.layout: list[tuple[int, int, bool]] = self._collect([w.ready.remote() for w in self.workers], "start-up")
        self.dp_size = self.layout[0][1]
        self.hf, self.replaying = cfg.hf_config(), cfg.model.routing_replay
        self.correction = cfg.loss.correction
        self.sent_bytes = 0  # written into the object store for the ranks (see take_sent_bytes)

    # ---------------------------------------------------------------------------- the algorithm
    def train_step(self, minibatch: list) -> dict[str, float]:
        """One optimizer step on ``minibatch``: checked here once, each data-parallel share put
        into the object store once and read by its ranks only; the step's metrics."""
        from bpo_megatron.trainer.actor import check_batch, minibatch_totals

        check_batch(minibatch, self.hf, replaying=self.replaying, dp_size=self.dp_size,
                    correction=self.correction)
        shares, totals = self._put_shares(minibatch), minibatch_totals(minibatch)
        return self._collect([w.train_share.remote(shares[dp], totals)
                              for w, (dp, _, _) in zip(self.workers, self.layout)], "train_step")[-1]

    def compute_logprobs(self, samples: list, *, record_routing: bool = False):
        """log π and entropies (and, with ``record_routing``, the routers' free choices) of
        ``samples``, as host tensors in sample order, each share's from one rank."""
        from bpo_megatron.trainer.actor import ScoredSamples, check_batch

        check_batch(samples, self.hf, replaying=self.replaying and not record_routing, dp_size=self.dp_size)
        shares = self._put_shares(samples)
        results = self._collect([w.logprobs_of_share.remote(shares[dp], record_routing)
                                 for w, (dp, _, _) in zip(self.workers, self.layout)], "compute_logprobs")
        by_share = {dp: scored for (dp, _, returns), scored in zip(self.layout, results) if returns}
        parts = [by_share[dp] for dp in range(self.dp_size)]
        return ScoredSamples(
            logprobs=[t for part in parts for t in part.logprobs],
            entropies=[t for part in parts for t in part.entropies],
            routed_experts=None if parts[0].routed_experts is None else [t for p in parts for t in p.routed_experts])

    def take_sent_bytes(self) -> int:
        """Bytes put into the object store for the ranks since the last call."""
        sent, self.sent_bytes = self.sent_bytes, 0
        return sent

    def _put_shares(self, samples: list) -> list:
        import ray

        from bpo_megatron.trainer.samples import split

        refs = [ray.put(share) for share in split(samples, self.dp_size)]
        sizes = ray.experimental.get_object_locations(refs)
        self.sent_bytes += sum(sizes[ref]["object_size"] or 0 for ref in refs)
        return refs

    def call(self, method: str, *args: Any) -> list[Any]:
        """Every rank runs ``method`` (the trainer's methods are collective); results by rank."""
        return self.wait(self.submit(method, *args), method)

    def submit(self, method: str, *args: Any) -> list:
        """Start ``method`` on every rank; :meth:`wait` for it (e.g. after starting its peers)."""
        return [getattr(w, method).remote(*args) for w in self.workers]

    def wait(self, futures: list, what: str) -> list[Any]:
        return self._collect(futures, what)

    def on_every_rank(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(worker, *args)`` on every rank's :class:`TrainWorker`, collectively."""
        return self._collect([w.__ray_call__.remote(fn, *args) for w in self.workers], fn.__name__)

    def _collect(self, futures: list, what: str) -> list[Any]:
        """The results by rank, or, as soon as one rank fails, :class:`TrainerFailed` with every
        rank stopped (the others may be blocked in a collective the failed rank never joins)."""
        import ray

        pending = list(futures)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            if _failure(done[0]) is not None:
                # A rank that dies takes its peers' collectives down with it within moments; the
                # grace period lets the death itself, not a peer's broken connection, be reported.
                more, _ = ray.wait(pending, num_returns=len(pending), timeout=FAILURE_GRACE_S)
                failures = [(rank, f) for rank, ref in enumerate(futures)
                            if ref in [done[0], *more] and (f := _failure(ref)) is not None]
                self.abort()
                raise _trainer_failed(failures, what)
        return ray.get(futures)

    def abort(self) -> None:
        """Kill every rank now (no clean-up call: ranks may be blocked in a collective)."""
        import ray

        workers, self.workers = self.workers, []
        for w in workers:
            ray.kill(w, no_restart=True)
        if self._owns_placement and self.placement is not None:
            self.placement.remove()
            self.placement = None

    def shutdown(self) -> None:
        """Release the trainer world cleanly (bounded: a rank that does not answer is killed)."""
        import ray

        if self.workers:
            try:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                pass
        self.abort()


class EngineGroup:
    """``rollout.num_engines`` engines; requests are spread over them in contiguous slices.

    An engine whose actor dies (its process killed or crashed), or that lost its server
    (:class:`~bpo_megatron.rollout.engine.EngineLost`), is replaced by a fresh one, and so is, with
    ``generate_timeout_s``, one that has not answered a ``generate`` within that many
    seconds (it is killed first: a hung engine is as useless as a dead one). ``on_restart`` is then
    called with the replaced indices (to load the current weights into them) before their shares
    are sent again; the answers of the other engines are kept. ``max_restarts`` per engine, on
    average, bounds the replacements over the group's life.
    """

    def __init__(self, cfg, model_dir: str, *, max_restarts: int | None = None,
                 generate_timeout_s: float | None = None, placement: Placement | None = None) -> None:
        import ray

        if generate_timeout_s is not None and not generate_timeout_s > 0:
            raise ValueError(f"generate_timeout_s must be > 0 (or None: wait forever), got {generate_timeout_s}")
        self.cfg, self.model_dir, self.placement = cfg, model_dir, placement
        self.max_restarts = cfg.rollout.max_restarts if max_restarts is None else max_restarts
        self.generate_timeout_s = cfg.rollout.generate_timeout_s if generate_timeout_s is None else generate_timeout_s
        self.restarts = 0
        self.on_restart: Callable[[list[int]], None] | None = None  # reload weights into new engines
        self.weight_group: tuple[str, ...] | None = None  # the engines (actor ids) a weight group joined
        self._actor = ray.remote(EngineWorker)
        self.workers = self._start(list(range(cfg.rollout.num_engines)))

    def _start(self, indices: list[int]) -> list:
        """New engines for ``indices``, started side by side: each spends seconds importing its
        libraries and loading the model, mostly waiting on the disk."""
        import ray

        workers = [self._actor.options(**self._options(i)).remote(self.cfg, self.model_dir, i, self._devices(i))
                   for i in indices]
        ray.get([w.captures_routing.remote() for w in workers])  # raise here if an engine cannot start
        return workers

    def _options(self, index: int) -> dict[str, Any]:
        if self.placement is not None:  # on its slots of the run's placement (shared or its own)
            options = self.placement.engine_options(index)
        else:
            options = {"num_cpus": self.cfg.cluster.cpus_per_actor, "num_gpus": self.cfg.cluster.gpus_per_engine}
        if self.partial_rollouts:  # a weight update reaches an engine while it generates
            options["max_concurrency"] = 2
        return options

    @property
    def partial_rollouts(self) -> bool:
        """Whether the engines pause a generation under way for a weight update (train.async with
        an engine that can): their actors then take calls while they generate."""
        return bool(self.cfg.train.asynchronous.max_staleness) and self.cfg.rollout.spec.partial_rollouts

    def _devices(self, index: int) -> tuple[int, ...]:
        return self.placement.engine_gpus(index) if self.placement is not None else ()

    def actor_ids(self) -> tuple[str, ...]:
        return tuple(w._actor_id.hex() for w in self.workers)

    def captures_routing(self) -> bool:
        import ray

        return all(ray.get([w.captures_routing.remote() for w in self.workers]))

    def generate(self, requests: list) -> list:
        """All samples, in request order; a dead or hung engine is replaced and its share re-sent."""
        return self.submit(requests).result()

    def submit(self, requests: list) -> PendingGeneration:
        """Start generating ``requests`` on the engines and return at once; ``.result()`` waits.
        The engines take later calls (a weight update, say) only after this generation."""
        return PendingGeneration(self, requests)

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
            except ray.exceptions.RayTaskError as exc:
                if not isinstance(_cause(exc), EngineLost):
                    raise
                log.warning("rollout engine %d lost its server (%s); replacing it", i, str(_cause(exc)).splitlines()[0])
                failed.append(i)
        return failed

    def replace(self, indices: list[int], *, load_weights: bool = True) -> None:
        """New engines for ``indices``; ``load_weights``: give them the current weights
        (``on_restart``) at once; otherwise the caller is about to sync them anyway."""
        import ray

        if self.restarts + len(indices) > self.max_restarts * max(1, len(self.workers)):
            raise EnginesFailed(f"rollout engines {indices} died or timed out again after {self.restarts} "
                                f"restarts (at most rollout.max_restarts={self.max_restarts} per engine)")
        for i in indices:
            ray.kill(self.workers[i], no_restart=True)  # a hung or unhealthy one must not linger
        for i, worker in zip(indices, self._start(indices)):
            self.workers[i] = worker
        self.restarts += len(indices)
        if load_weights and self.on_restart is not None:
            self.on_restart(indices)

    def replace_unhealthy(self) -> list[int]:
        """Replace the engines that died, or report themselves unhealthy (or do not answer
        within ``HEALTH_TIMEOUT_S``), since the last call; returns their indices. The new
        engines hold the initial weights: call this right before a weight sync."""
        import ray

        checks = [w.healthy.remote() for w in self.workers]
        unhealthy = []
        for i, check in enumerate(checks):
            try:
                if not ray.get(check, timeout=HEALTH_TIMEOUT_S):
                    unhealthy.append(i)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                unhealthy.append(i)
        if unhealthy:
            log.warning("rollout engines %s died or are unhealthy; replacing them", unhealthy)
            self.replace(unhealthy, load_weights=False)
        return unhealthy

    def call(self, method: str, *args: Any, only: list[int] | None = None) -> list[Any]:
        import ray

        indices = range(len(self.workers)) if only is None else only
        return ray.get([getattr(self.workers[i], method).remote(*args) for i in indices])

    def call_surviving(self, method: str, *args: Any, only: list[int]) -> tuple[dict[int, Any], list[int]]:
        """``method`` on the engines ``only``: the answers of those alive, and those found dead
        (a kill is asynchronous: an engine that looked healthy a moment ago may be gone)."""
        import ray

        futures = {i: getattr(self.workers[i], method).remote(*args) for i in only}
        answers, dead = {}, []
        for i, future in futures.items():
            try:
                answers[i] = ray.get(future)
            except ray.exceptions.RayActorError:
                dead.append(i)
        return answers, dead

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
