"""The rollout engines (or a run's background evaluation engines) as a group of Ray actors.

Requests are spread over the engines in contiguous slices that even out the engines' outstanding
samples; a conversation's later turn (``GenerationRequest.affinity``) goes to the engine of its
previous turn, whose prefix cache holds the conversation, unless that engine was replaced since or
is full (``rollout.agent.affinity_backlog`` more samples outstanding than the least loaded one).
An engine that dies (its process
killed or crashed), loses its server (:class:`~bpo_megatron.rollout.engine.EngineLost`), stalls
(requests outstanding and no progress for ``rollout.stall_timeout_s``: a stopped or wedged process),
runs past ``rollout.generate_timeout_s`` or does not answer any other call within
``rollout.stall_timeout_s`` is killed and replaced, whatever the step is doing; its unfinished
requests are sent again to the replacement, once it holds the current weights.

Every call reaches an engine through one of three concurrency groups of its actor, so no kind of
call waits behind another: ``liveness`` (health, progress, version, address: answered while the
engine generates), ``update`` (weights and memory) and ``generate`` (as many at once as the
batches a step may have under way, ``train.async.max_staleness`` + 1, times the batches of turns
a conversation batch may have out, ``TURN_BATCHES_IN_FLIGHT``, with ``rollout.agent``). An engine
that cannot take a weight update while it generates (no partial rollouts) gets its updates in the
``generate`` group, one call at a time, and one generation at a time.

An engine streams each share's samples back as they finish (:class:`PendingGeneration`).
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Callable, Protocol

from bpo_megatron.orchestration.engine_group_spec import EngineGroupSpec
from bpo_megatron.orchestration.placement import EVALUATION, ROLLOUT, Placement
from bpo_megatron.orchestration.stall_watch import StallWatch
from bpo_megatron.orchestration.workers import EngineWorker
from bpo_megatron.rollout.agents.conversation import TURN_BATCHES_IN_FLIGHT
from bpo_megatron.rollout.engine import EngineLost, EngineUnresponsive
from bpo_megatron.weight_sync.transport import ENDPOINT_PARTS, EngineEndpoint

log = logging.getLogger(__name__)

LIVENESS, UPDATE, GENERATE = "liveness", "update", "generate"
_LIVENESS_CALLS = frozenset({"healthy", "progress", "weight_version", "endpoint", "captures_routing"})
LIVENESS_TIMEOUT_S = 30.0  # an engine that cannot say whether it is healthy in this time is not
PROBE_INTERVAL_S = 2.0  # how often a generating engine's progress is read
# joining a weight group (NCCL's communicator set-up across nodes) and hashing every weight an
# engine holds (a sync's check, tens of GB at 30B) take a while; past these an engine is stuck
JOIN_TIMEOUT_S = 600.0
FINGERPRINT_TIMEOUT_S = 1800.0
START_ALLOWANCE_S = 300.0  # an engine's start: its own start-up bound (a server's) plus this


class EnginesFailed(RuntimeError):
    """Rollout engines kept dying or hanging beyond their restart budget."""


def _cause(exc: Exception) -> Exception:
    return getattr(exc, "cause", None) or exc


def _lost_engine(exc: Exception) -> bool:
    """A call that failed because the engine is gone or unresponsive, not because it refused."""
    return isinstance(_cause(exc), (EngineLost, EngineUnresponsive))


@dataclass
class _Stream:
    """One engine's share of a generation, under way: its samples stream back as they finish."""

    generator: Any  # the engine's generate call (a Ray streaming generator)
    actor: Any  # the actor it went to
    served_by: tuple[int, int]  # (engine index, its start count): what its samples are tagged with
    requests: list[int]  # which of the generation's requests
    positions: list[int]  # the generation's sample position of each sample the share returns
    deadline: float | None  # rollout.generate_timeout_s from the moment it was sent
    missing: int = 0  # its samples not yet come (from this share or an earlier one)


class PendingGeneration:
    """Requests shared out over the engines (:meth:`EngineGroup.place`), generating; each engine streams
    its samples back as they finish. :meth:`take_finished` hands over those that came since it
    was last called (a conversation's next turn need not wait for the batch's longest answer),
    :meth:`result` waits for all, :meth:`done` looks without waiting. A dead, hung or stalled
    engine is replaced and its unfinished requests are sent again to the engines of that moment;
    the samples it sent before are kept. ``rollout.generate_timeout_s`` counts from the moment a
    share is sent; a stall is judged over the time someone waits on the generation (a
    generation nobody waits on is not watched)."""

    def __init__(self, engines: EngineGroup, requests: list) -> None:
        self._engines, self._requests = engines, requests
        # request r's samples are positions first[r] … first[r + 1] - 1, as generate() returns them
        self._first = list(accumulate((r.sampling.n for r in requests), initial=0))
        self._samples: list = [None] * self._first[-1]
        self._arrived: list[tuple[int, Any]] = []  # since the last take_finished
        self._streams: dict[int, _Stream] = {}
        self._watch = StallWatch(engines.stall_timeout_s)
        self._probes: dict[int, Any] = {}  # engine -> its progress probe under way
        self._interval = min(PROBE_INTERVAL_S, engines.stall_timeout_s / 4)
        self._watched_at = -math.inf  # when a wait last looked
        for i, share in enumerate(engines.place(requests)):
            if share:
                self._send(i, share)
        engines.pending.add(self)

    def outstanding(self, engine: int) -> int:
        """The samples engine ``engine`` still owes this generation."""
        stream = self._streams.get(engine)
        return 0 if stream is None else stream.missing

    def take_finished(self, wait_s: float = 0.0, *, watch: bool | None = None) -> list[tuple[int, Any]]:
        """The samples that finished since the last call, each with its position in request
        order; waits up to ``wait_s`` for one while none has. ``watch`` (by default: when it
        waits): enforce stalls and ``rollout.generate_timeout_s`` — a loop that waits on several
        generations in turn watches each on every call, waiting or not."""
        watch = wait_s > 0 if watch is None else watch
        until = time.monotonic() + wait_s
        if self._streams:
            self._pump(0.0, watched=watch)
        while not self._arrived and self._streams and time.monotonic() < until:
            self._pump(until - time.monotonic(), watched=watch)
        taken, self._arrived = self._arrived, []
        return taken

    def done(self) -> bool:
        """Whether every sample has come, without waiting (what came is stored; a share whose
        engine died or lost its server is sent again, so it is not done). Stalls and
        ``rollout.generate_timeout_s`` are enforced by the waits."""
        while self._streams and self._pump(0.0, watched=False):
            pass
        return not self._streams

    def result(self) -> list:
        """All samples, in request order (waits for them the first time)."""
        while self._streams:
            self._pump(self._interval, watched=True)
        return list(self._samples)

    # ------------------------------------------------------------------------------ the shares
    def _send(self, engine: int, share: list[int]) -> None:
        worker = self._engines.workers[engine]
        timeout, now = self._engines.generate_timeout_s, time.monotonic()
        positions = [p for r in share for p in range(self._first[r], self._first[r + 1])]
        generator = self._engines.remote(worker, "generate", [self._requests[r] for r in share])
        self._streams[engine] = _Stream(generator, worker, (engine, self._engines.starts[engine]), share, positions,
                                        None if timeout is None else now + timeout,
                                        missing=sum(self._samples[p] is None for p in positions))
        self._watch.start(engine, now)
        self._probes.pop(engine, None)

    def _pump(self, wait_s: float, *, watched: bool) -> bool:
        """Take what the engines sent within ``wait_s`` (one batch per engine at most); with
        ``watched``, enforce deadlines and stalls. Whether anything came, ended or failed."""
        import ray

        now = time.monotonic()
        if watched and now - self._watched_at > 2 * self._interval:  # nobody looked meanwhile: judge from now
            for i in self._streams:
                self._watch.start(i, now)
        deadlines = [s.deadline for s in self._streams.values() if s.deadline is not None]
        if watched and deadlines:
            wait_s = min(wait_s, max(0.0, min(deadlines) - now))
        generators = {i: stream.generator for i, stream in self._streams.items()}
        ready, _ = ray.wait(list(generators.values()), num_returns=1, timeout=min(wait_s, self._interval))
        if ready:  # every engine that has something now
            ready, _ = ray.wait(list(generators.values()), num_returns=len(generators), timeout=0)
        moved, failed = False, {}
        for i in [i for i, generator in generators.items() if generator in ready]:
            stream = self._streams[i]
            try:
                batch = ray.get(next(stream.generator))
            except StopIteration:
                self._ended(i)
                moved = True
                continue
            except ray.exceptions.RayActorError:
                log.warning("%s engine %d died while generating", self._engines.role, i)
                failed[i] = stream.actor
                continue
            except ray.exceptions.RayTaskError as exc:
                if not _lost_engine(exc):
                    raise
                log.warning("%s engine %d lost its server while generating (%s)", self._engines.role, i,
                            str(_cause(exc)).splitlines()[0])
                failed[i] = stream.actor
                continue
            self._store(stream, batch)
            self._watch.progressed(i, time.monotonic())
            if not stream.missing:  # its call ends: nothing more to come
                self._ended(i)
            moved = True
        if watched:
            failed.update(self._overdue(failed))
        if failed:
            self._engines.replace_failed(failed)
            for i in failed:
                self._send_again(i)
        return moved or bool(failed)

    def _store(self, stream: _Stream, batch: list[tuple[int, Any]]) -> None:
        for local, sample in batch:
            position = stream.positions[local]
            if self._samples[position] is None:  # a share sent again may repeat what came before
                sample.served_by = stream.served_by
                self._samples[position] = sample
                self._arrived.append((position, sample))
                stream.missing -= 1

    def _ended(self, engine: int) -> None:
        """A share all of whose samples came, or whose call ended."""
        stream = self._streams.pop(engine)
        self._watch.stop(engine)
        self._probes.pop(engine, None)
        if stream.missing:
            raise RuntimeError(f"{self._engines.role} engine {engine} ended its generation with {stream.missing} "
                               f"of its {len(stream.positions)} samples not sent")

    def _send_again(self, engine: int) -> None:
        """The requests of a failed share that have a sample still to come, to the engine now in
        its place."""
        stream = self._streams.pop(engine)
        self._watch.stop(engine)
        unfinished = [r for r in stream.requests
                      if any(self._samples[p] is None for p in range(self._first[r], self._first[r + 1]))]
        if unfinished:
            self._send(engine, unfinished)

    def _overdue(self, failed: dict[int, Any]) -> dict[int, Any]:
        """The engines (besides ``failed``) past their deadline or stalled, each killed."""
        import ray

        now = time.monotonic()
        self._watched_at = now
        self._read_progress(now)
        overdue = {}

        def fail(i: int, message: str, *args: Any) -> None:
            log.warning(message, self._engines.role, i, *args)
            ray.kill(self._streams[i].actor, no_restart=True)
            overdue[i] = self._streams[i].actor

        for i, stream in self._streams.items():
            if i not in failed and stream.deadline is not None and now >= stream.deadline:
                fail(i, "%s engine %d did not answer within %.0f s (rollout.generate_timeout_s)",
                     self._engines.generate_timeout_s)
        for i in self._watch.stalled(now):
            if i not in failed and i not in overdue:
                fail(i, "%s engine %d made no progress for %.0f s with requests outstanding "
                        "(rollout.stall_timeout_s=%.0f: a stopped or wedged process)",
                     self._watch.quiet_for(i, now), self._engines.stall_timeout_s)
        return overdue

    def _read_progress(self, now: float) -> None:
        """Ask every engine still generating for its progress (one probe at a time each) and
        record the answers that came."""
        import ray

        for i, stream in self._streams.items():
            if i not in self._probes:
                self._probes[i] = self._engines.remote(stream.actor, "progress")
        answered, _ = ray.wait(list(self._probes.values()), num_returns=len(self._probes), timeout=0)
        for ref in answered:
            i = next(j for j, r in self._probes.items() if r == ref)
            self._probes.pop(i)
            try:
                self._watch.answered(i, ray.get(ref), now)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
                pass  # no answer: a dead engine's generate call fails on its own; a silent one stalls


def place(requests: list, load: list[int], starts: list[int], backlog: int) -> list[list[int]]:
    """Each engine's share of ``requests`` (their indices), the engines owing ``load`` samples
    and started ``starts`` times each. A request with an ``affinity`` (engine, start count) goes
    to that engine while it is the one that served it (not replaced since: a replacement's cache
    is empty) and is not full — ``backlog`` samples or more beyond the least loaded engine's; the
    others go in contiguous slices that bring the engines' outstanding samples as near one level
    as whole requests allow (with equal loads: nearly equal slices, the first ones one longer)."""
    load, shares, free = list(load), [[] for _ in load], []
    for r, request in enumerate(requests):
        home = request.affinity
        if (home is not None and 0 <= home[0] < len(load) and starts[home[0]] == home[1]
                and load[home[0]] - min(load) < backlog):
            shares[home[0]].append(r)
            load[home[0]] += request.sampling.n
        else:
            free.append(r)
    counts = [0] * len(load)
    for r in free:  # each to the least loaded engine (the lowest index on a tie)
        i = min(range(len(load)), key=lambda j: (load[j], j))
        counts[i] += 1
        load[i] += requests[r].sampling.n
    start = 0
    for i, count in enumerate(counts):
        shares[i] += free[start:start + count]
        start += count
    return shares


class Custodian(Protocol):
    """Who owns an engine group's devices and weights, and so its replacements: the device phases
    (rollout engines), the evaluation scheduler (evaluation engines)."""

    def starting_engines(self, indices: list[int], start: Callable[[], None]) -> None:
        """Run ``start()``, which brings up new engines for ``indices``, when their devices are
        free, and leave them in their peers' memory state."""

    def resync(self, indices: list[int]) -> None:
        """Give the engines ``indices``, just replaced (they hold the initial weights), the
        current ones before any of their requests is sent again."""


class EngineGroup:
    """The engines ``spec`` describes (:class:`EngineGroupSpec`: ``rollout.num_engines`` of them, or
    its ``num_engines``), started from the checkpoint in ``model_dir``, on their slots of
    ``placement`` (None: each with the resources of ``spec.cluster``). Role evaluation: a run's
    background evaluation engines, on their slots of the placement, without routing capture, one
    generation at a time; log lines and errors name them so.

    Its replacements go through its :class:`Custodian`, the owner of its devices and weights
    (the device phases for the rollout engines, the evaluation scheduler for the evaluation
    engines), which takes charge as it is built (:meth:`entrust`; until then a replacement starts
    at once and is recorded in :attr:`unsynced`). ``max_restarts`` per engine, on average, bounds
    the replacements over the group's life.
    """

    def __init__(self, spec: EngineGroupSpec, model_dir: str, *, placement: Placement | None = None) -> None:
        import ray

        self.spec, self.model_dir, self.placement, self.role = spec, model_dir, placement, spec.role
        count = spec.count
        self.max_restarts = spec.rollout.max_restarts
        self.generate_timeout_s = spec.rollout.generate_timeout_s
        self.stall_timeout_s = spec.rollout.stall_timeout_s
        self.restarts = 0
        self.custodian: Custodian | None = None  # who starts replacements and gives them the weights
        self.unsynced: set[int] = set()  # replaced engines that hold the initial weights
        self.starts = [0] * count  # how often each engine index was started again (a replacement's cache is empty)
        self.pending: weakref.WeakSet = weakref.WeakSet()  # the generations under way: the engines' load
        self.affinity_backlog = spec.rollout.agent.affinity_backlog
        self.weight_group: tuple[str, ...] | None = None  # the engines (actor ids) a weight group joined
        generating = spec.max_staleness + 1 if self.partial_rollouts else 1
        if spec.rollout.agent.enabled and self._updates_apart:  # each conversation batch's turns go in batches
            generating *= TURN_BATCHES_IN_FLIGHT
        self._actor = ray.remote(concurrency_groups={LIVENESS: 2, UPDATE: 1, GENERATE: generating})(EngineWorker)
        # the engine's own start bound (a server's, with an FP8 server's copy and kernel compilation)
        self._start_timeout_s = getattr(spec.rollout.options, "start_bound_s", 0.0) + START_ALLOWANCE_S
        self.workers: list = []
        self.workers = self._start(list(range(count)))

    # ------------------------------------------------------------------------------- calls
    def _group_of(self, method: str) -> str:
        if method in _LIVENESS_CALLS:
            return LIVENESS
        if method == "generate" or not self._updates_apart:
            return GENERATE
        return UPDATE

    def remote(self, worker, method: str, *args: Any):
        """Start ``method`` on one engine, in its concurrency group; returns the call's reference."""
        return getattr(worker, method).options(concurrency_group=self._group_of(method)).remote(*args)

    def call_surviving(self, method: str, *args: Any, only: list[int]) -> tuple[dict[int, Any], list[int]]:
        """``method`` on the engines ``only``: the answers of those that gave one, and those found
        dead, lost or silent for ``rollout.stall_timeout_s`` (killed: a silent engine is as
        useless as a dead one). Nothing is replaced here."""
        import ray

        futures = {i: (self.remote(self.workers[i], method, *args), self.workers[i]) for i in only}
        deadline = time.monotonic() + self.stall_timeout_s
        answers, lost = {}, []
        for i, (future, worker) in futures.items():
            try:
                answers[i] = ray.get(future, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                log.warning("%s engine %d did not answer %s within %.0f s (rollout.stall_timeout_s); "
                            "replacing it", self.role, i, method, self.stall_timeout_s)
                ray.kill(worker, no_restart=True)
                lost.append(i)
            except ray.exceptions.RayActorError:
                log.warning("%s engine %d died (during %s); replacing it", self.role, i, method)
                lost.append(i)
            except ray.exceptions.RayTaskError as exc:
                if not _lost_engine(exc):
                    raise
                log.warning("%s engine %d lost its server during %s (%s); replacing it", self.role, i, method,
                            str(_cause(exc)).splitlines()[0])
                lost.append(i)
        return answers, lost

    def call(self, method: str, *args: Any, only: list[int] | None = None) -> list[Any]:
        """``method`` on every engine (``only``: those); an engine found dead or silent is
        replaced (its peers' memory state, the initial weights: see :attr:`unsynced`) and asked
        again. The answers, in the order of ``only``."""
        indices = list(range(len(self.workers))) if only is None else list(only)
        answers, lost = self.call_surviving(method, *args, only=indices)
        while lost:
            self.replace(lost, load_weights=False)
            more, lost = self.call_surviving(method, *args, only=lost)
            answers.update(more)
        return [answers[i] for i in indices]

    # ------------------------------------------------------------------------------ engines
    def _start(self, indices: list[int]) -> list:
        """New engines for ``indices``, started side by side: each spends seconds importing its
        libraries and loading the model, mostly waiting on the disk."""
        import ray

        rollout = self.spec.rollout
        workers = [self._actor.options(**self._options(i)).remote(rollout.engine, rollout.options, self._context(i))
                   for i in indices]
        try:  # raise here if an engine cannot start
            ray.get([self.remote(w, "captures_routing") for w in workers], timeout=self._start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            for w in workers:
                ray.kill(w, no_restart=True)
            raise EnginesFailed(f"{self.role} engines {indices} did not start within {self._start_timeout_s:.0f} s "
                                "(the engine's start-up bound plus placement); see the engines' logs") from None
        return workers

    def _context(self, index: int):
        """What engine ``index`` is built with besides its options: a background evaluation engine
        runs on devices of its own and captures no routing (evaluation requests never ask for it)."""
        from bpo_megatron.models.routing import RoutingLayout
        from bpo_megatron.rollout import EngineContext

        spec, evaluation = self.spec, self.role == EVALUATION
        capture = spec.rollout.capture_routed_experts and spec.hf.num_experts > 0 and not evaluation
        return EngineContext(model_dir=self.model_dir, index=spec.first_index + index,
                             routing=RoutingLayout.of(spec.hf) if capture else None,
                             threads=spec.rollout.threads_per_engine,
                             colocated=spec.cluster.colocate and not evaluation,
                             devices=self._devices(index), node_address="",
                             longest_sequence=spec.longest_sequence,
                             weight_bucket_bytes=spec.weight_bucket_bytes)

    def _options(self, index: int) -> dict[str, Any]:
        if self.placement is not None:  # on its slots of the run's placement (shared or its own)
            return self.placement.engine_options(index, self.role)
        return {"num_cpus": self.spec.cluster.cpus_per_actor, "num_gpus": self.spec.cluster.gpus_per_engine}

    @property
    def partial_rollouts(self) -> bool:
        """Whether the engines pause a generation under way for a weight update (train.async with
        an engine that can): their updates then run beside their generations."""
        return self.role == ROLLOUT and bool(self.spec.max_staleness) and self.spec.rollout.spec.partial_rollouts

    @property
    def _updates_apart(self) -> bool:
        """Whether weight updates go in a concurrency group of their own: engines that can take one
        while they generate (partial rollouts). The others get them in the ``generate`` group, one
        call at a time, so that an update never runs beside a generation."""
        return self.role == ROLLOUT and self.spec.rollout.spec.partial_rollouts

    def _devices(self, index: int) -> tuple[int, ...]:
        return self.placement.engine_gpus(index, self.role) if self.placement is not None else ()

    def actor_ids(self) -> tuple[str, ...]:
        return tuple(w._actor_id.hex() for w in self.workers)

    # ---------------------------------------------------------------- typed calls (every engine or ``only``)
    def endpoints(self, only: list[int] | None = None) -> list:
        """Each engine's endpoint (a server's address, TP size and node; None for an in-process engine)."""
        return self.call("endpoint", only=only)

    def weight_details(self, only: list[int] | None = None) -> list:
        """Each engine's ``(node, details)``: what its own weight transports reach it by."""
        return self.call("weight_details", only=only)

    def weight_endpoints(self, only: list[int], needs: frozenset[str]) -> list[EngineEndpoint]:
        """What a weight transport reaches each engine of ``only`` by: the parts of an
        :class:`~bpo_megatron.weight_sync.transport.EngineEndpoint` it ``needs``, asked of the
        engines here (an engine found dead meanwhile is replaced, as :meth:`call` does), so the
        transport never calls back into the group."""
        if not needs <= ENDPOINT_PARTS:
            raise ValueError(f"a weight transport needs {sorted(needs - ENDPOINT_PARTS)}; an engine endpoint has "
                             f"{sorted(ENDPOINT_PARTS)}")
        details = self.weight_details(only=only) if {"node", "details"} & needs else [(None, None)] * len(only)
        # the actors last: the call above may have replaced one
        return [EngineEndpoint(index=i, actor=self.workers[i] if "actor" in needs else None, node=node,
                               details=detail)
                for i, (node, detail) in zip(only, details)]

    def nccl_versions(self) -> list:
        return self.call("nccl_version")

    def release_memory(self, only: list[int] | None = None) -> None:
        self.call("release_memory", only=only)

    def resume_memory(self, tags: tuple[str, ...], only: list[int] | None = None) -> None:
        self.call("resume_memory", tags, only=only)

    # ------------------------------------------ a weight update's calls: the engines found lost, none replaced
    def begin_weight_update(self, version: int, only: list[int]) -> list[int]:
        """Open an update bringing ``version`` on the engines ``only``; those found lost."""
        return self.call_surviving("begin_weight_update", version, only=only)[1]

    def end_weight_update(self, only: list[int]) -> list[int]:
        return self.call_surviving("end_weight_update", only=only)[1]

    def held_versions(self, only: list[int]) -> tuple[dict[int, int], list[int]]:
        """The weights version each engine of ``only`` holds, and those found lost."""
        return self.call_surviving("weight_version", only=only)

    def fingerprints(self, only: list[int]) -> list[dict]:
        """Each engine of ``only``'s weights fingerprinted, in ``only``'s order (a sync's check),
        within ``FINGERPRINT_TIMEOUT_S``."""
        refs = {i: self.workers[i].fingerprints.remote() for i in only}
        return self._within(refs, FINGERPRINT_TIMEOUT_S, "fingerprint their weights (weight_sync.verify)")

    def join_weight_group(self, address: str, port: int, offsets: list[int], world_size: int) -> None:
        """Every engine's ranks join the weight group hosted at ``address:port`` (engine ``i``'s
        from rank ``offsets[i]``); returns once all joined (the host joins meanwhile), within
        ``JOIN_TIMEOUT_S``."""
        refs = {i: w.join_weight_group.remote(address, port, offset, world_size)
                for i, (w, offset) in enumerate(zip(self.workers, offsets))}
        self._within(refs, JOIN_TIMEOUT_S, f"join the weight group at {address}:{port}")

    def _within(self, refs: dict[int, Any], timeout_s: float, what: str) -> list[Any]:
        """The answers of ``refs`` (engine index -> call), in order; :class:`EnginesFailed` naming
        the engines that did not answer within ``timeout_s`` and what they were asked to do."""
        import ray

        _, late = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        if late:
            silent = sorted(i for i, ref in refs.items() if ref in late)
            raise EnginesFailed(f"{self.role} engines {silent} did not {what} within {timeout_s:.0f} s")
        return ray.get(list(refs.values()))

    def leave_weight_group(self, only: list[int]) -> list[int]:
        return self.call_surviving("leave_weight_group", only=only)[1]

    def captures_routing(self) -> bool:
        return all(self.call("captures_routing"))

    def entrust(self, custodian: Custodian) -> None:
        """``custodian`` starts this group's replacements and gives them the weights from now on
        (it calls this as it is built: the group starts first, its engines' memory handed back
        before the trainer is built beside them). One custodian per group."""
        if self.custodian is not None and self.custodian is not custodian:
            raise RuntimeError(f"the {self.role} engines already have a custodian ({type(self.custodian).__name__})")
        self.custodian = custodian

    def replace(self, indices: list[int], *, load_weights: bool = True) -> None:
        """New engines for ``indices``, started by the custodian; ``load_weights``: it gives them
        the current weights at once; otherwise they are recorded in :attr:`unsynced` (the caller,
        or the next weight sync, gives them the weights)."""
        import ray

        if self.restarts + len(indices) > self.max_restarts * max(1, len(self.workers)):
            raise EnginesFailed(f"{self.role} engines {indices} died, hung or stalled again after {self.restarts} "
                                f"restarts (at most rollout.max_restarts={self.max_restarts} per engine)")
        for i in indices:
            ray.kill(self.workers[i], no_restart=True)  # a hung or unhealthy one must not linger

        def start() -> None:
            for i, worker in zip(indices, self._start(indices)):
                self.workers[i] = worker

        self.restarts += len(indices)
        for i in indices:
            self.starts[i] += 1
        if self.custodian is not None:
            self.custodian.starting_engines(indices, start)
        else:
            start()
        if load_weights and self.custodian is not None:
            self.custodian.resync(indices)
        else:
            self.unsynced.update(indices)

    def replace_failed(self, failed: dict[int, Any]) -> None:
        """Engines whose call failed, each with the actor the call went to: those still in place
        are replaced (and given the weights); one already replaced meanwhile (by another
        generation or a sync) is not replaced again, only given the weights if it lacks them."""
        current = [i for i, actor in failed.items() if self.workers[i]._actor_id == actor._actor_id]
        for i in current:  # once per engine, however many of its generations failed with it
            log.warning("%s engine %d: replacing it and sending its requests again", self.role, i)
        if current:
            self.replace(current)
        behind = sorted(i for i in failed if i not in current and i in self.unsynced)
        if behind and self.custodian is not None:
            self.custodian.resync(behind)
            self.unsynced.difference_update(behind)

    def replace_unhealthy(self) -> list[int]:
        """Replace the engines that died, or report themselves unhealthy (or do not answer
        within ``LIVENESS_TIMEOUT_S``), since the last call; returns their indices. The new
        engines hold the initial weights: call this right before a weight sync."""
        import ray

        checks = [(self.remote(w, "healthy"), w) for w in self.workers]
        deadline = time.monotonic() + LIVENESS_TIMEOUT_S
        unhealthy = []
        for i, (check, worker) in enumerate(checks):
            try:
                if not ray.get(check, timeout=max(0.0, deadline - time.monotonic())):
                    unhealthy.append(i)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                unhealthy.append(i)
        if unhealthy:
            log.warning("%s engines %s died or are unhealthy; replacing them", self.role, unhealthy)
            self.replace(unhealthy, load_weights=False)
        return unhealthy

    # --------------------------------------------------------------------------- generation
    def load(self) -> list[int]:
        """Each engine's outstanding samples, over the generations under way."""
        return [sum(generation.outstanding(i) for generation in list(self.pending)) for i in range(len(self.workers))]

    def place(self, requests: list) -> list[list[int]]:
        """Each engine's share of ``requests`` (their indices): :func:`place`."""
        return place(requests, self.load(), self.starts, self.affinity_backlog)

    def generate(self, requests: list) -> list:
        """All samples, in request order; a dead, hung or stalled engine is replaced and its share re-sent."""
        return self.submit(requests).result()

    def submit(self, requests: list) -> PendingGeneration:
        """Start generating ``requests`` on the engines and return at once; ``.result()`` waits."""
        return PendingGeneration(self, requests)

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            try:  # bounded: a hung engine must not hang the shutdown; it is killed either way
                ray.get(w.shutdown.options(concurrency_group=UPDATE).remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            ray.kill(w)
