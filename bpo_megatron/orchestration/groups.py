"""Groups of Ray actors: the trainer world (here) and the rollout engines
(:mod:`bpo_megatron.orchestration.engine_group`, re-exported).

The trainer ranks sit in one placement group and form their own ``torch.distributed`` world
(gloo on CPU, NCCL on GPU). Their calls are collective, so one rank that fails leaves the others
waiting in a collective: the group then kills every rank at once and raises that rank's error
(:class:`TrainerFailed`), instead of waiting for the collective's timeout.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from bpo_megatron.orchestration.config import ClusterConfig
from bpo_megatron.orchestration.engine_group import EngineGroup, EnginesFailed, PendingGeneration
from bpo_megatron.orchestration.engine_group_spec import EngineGroupSpec
from bpo_megatron.orchestration.placement import Placement, plan_layout
from bpo_megatron.orchestration.workers import TrainWorker

if TYPE_CHECKING:
    from bpo_megatron.trainer.spec import TrainerSpec

__all__ = ["EngineGroup", "EngineGroupSpec", "EnginesFailed", "PendingGeneration", "TrainerFailed", "TrainerGroup",
           "run_placement"]

log = logging.getLogger(__name__)

FAILURE_GRACE_S = 2.0  # after a rank fails, how long the others get to report why they did


def run_placement(cluster: ClusterConfig, num_engines: int, *, eval_engines: int = 0) -> Placement:
    """The placement of a run's trainer and ``num_engines`` rollout engines on ``cluster``, and of
    ``eval_engines`` background evaluation engines."""
    return Placement(plan_layout(cluster, num_engines=num_engines, eval_engines=eval_engines),
                     timeout_s=cluster.placement_timeout_s)


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


class TrainerGroup:
    """``cluster.trainer_ranks`` ranks, each built from ``spec``, on their slots of ``placement`` (by
    default a placement of their own on ``cluster``)."""

    def __init__(self, spec: TrainerSpec, cluster: ClusterConfig, *, threads_per_rank: int = 1,
                 placement: Placement | None = None) -> None:
        import ray

        from bpo_megatron.trainer.balance import CostModel

        ranks = cluster.trainer_ranks
        self.workers: list = []
        self._owns_placement = placement is None
        self.placement = placement or run_placement(cluster, 0)
        actor = ray.remote(TrainWorker)
        self.workers = [actor.options(**self.placement.trainer_options(rank)).remote(spec, rank, ranks, threads_per_rank)
                        for rank in range(ranks)]
        # Rank 0 hosts the rendezvous, on a port bound as it was chosen; then every rank joins.
        master = self._collect([self.workers[0].rendezvous.remote()], "start-up")[0]
        # each rank's data-parallel index and size, and whether it returns its share's results
        self.layout: list[tuple[int, int, bool]] = self._collect([w.join.remote(master) for w in self.workers],
                                                                 "start-up")
        self.dp_size = self.layout[0][1]
        self.hf, self.replaying = spec.hf, spec.model.routing_replay
        self.loss = spec.loss  # what training batches are checked for (set_loss changes it)
        self.budget = spec.trainer.max_tokens_per_micro_batch  # > 0: packed micro-batches, shares balanced by cost
        self.cost = CostModel.of(self.hf)
        self.cp = spec.parallel.cp  # context parallelism: each sample split over cp ranks of the budget
        self.sent_bytes = 0  # written into the object store for the ranks (see take_sent_bytes)

    # ---------------------------------------------------------------------------- the algorithm
    def train_step(self, minibatch: list) -> dict[str, float]:
        """One optimizer step on ``minibatch``: checked here once, each data-parallel share put
        into the object store once and read by its ranks only; the step's metrics, with packed
        micro-batches also ``dp_imbalance``: the costliest share's estimated cost over the mean
        share's (:func:`~bpo_megatron.trainer.balance.imbalance`; 1.0 is perfect balance)."""
        from bpo_megatron.trainer.balance import imbalance

        shares = self._prepare(minibatch, replaying=self.replaying, loss=self.loss)
        refs = self._put_shares(minibatch, shares.indices)
        metrics = self._collect([w.train_share.remote(refs[dp], shares.totals)
                                 for w, (dp, _, _) in zip(self.workers, self.layout)], "train_step")[-1]
        if self.budget:
            metrics["dp_imbalance"] = imbalance(minibatch, shares.indices, self.cost)
        return metrics

    def compute_logprobs(self, samples: list, *, record_routing: bool = False):
        """log π and entropies (and, with ``record_routing``, the routers' free choices) of
        ``samples``, as host tensors in sample order, each share's from one rank."""
        from bpo_megatron.trainer.actor import ScoredSamples
        from bpo_megatron.trainer.balance import in_sample_order

        shares = self._prepare(samples, replaying=self.replaying and not record_routing).indices
        refs = self._put_shares(samples, shares)
        results = self._collect([w.logprobs_of_share.remote(refs[dp], record_routing)
                                 for w, (dp, _, _) in zip(self.workers, self.layout)], "compute_logprobs")
        by_share = {dp: scored for (dp, _, returns), scored in zip(self.layout, results) if returns}
        parts = [by_share[dp] for dp in range(self.dp_size)]
        return ScoredSamples(
            logprobs=in_sample_order([p.logprobs for p in parts], shares),
            entropies=in_sample_order([p.entropies for p in parts], shares),
            routed_experts=None if parts[0].routed_experts is None
            else in_sample_order([p.routed_experts for p in parts], shares),
            head_logprobs=None if parts[0].head_logprobs is None
            else in_sample_order([p.head_logprobs for p in parts], shares))

    # ------------------------------------------------------------- state, loss and memory (collective)
    def load(self, root: str, *, verify: bool = True) -> None:
        """The newest checkpoint under ``root`` (model, optimizer, RNG), on every rank."""
        self.call("load", root, verify)

    def load_hf(self, directory: str) -> None:
        """Hugging Face weights from ``directory``, on every rank."""
        self.call("load_hf", directory)

    def save(self, root: str, step: int, trainer_state: dict[str, Any], keep_last: int | None,
             background: bool = False) -> dict[str, float]:
        """The checkpoint of ``step`` under ``root`` (atomic), keeping the newest ``keep_last``;
        with ``background`` written by a background process and published later (at a training
        step or :meth:`finish_saves`). How long the trainer waited: ``waited_s`` for the save before
        it, ``staged_s`` for this one (the slowest rank's)."""
        timings = self.call("save", root, step, trainer_state, keep_last, background)
        return {key: max(t[key] for t in timings) for key in timings[0]}

    def finish_saves(self) -> int | None:
        """Wait for the background save in flight, if any, and publish it; its step."""
        return self.call("finish_saves")[0]

    def set_loss(self, loss) -> None:
        self.loss = loss
        self.call("set_loss", loss)

    def set_learning_rate(self, lr: float) -> None:
        self.call("set_learning_rate", lr)

    def plan_offload(self, parts: str, keep_across_saves: bool) -> int:
        """What :meth:`offload` moves from now on (``cluster.offload``'s choice), its host
        buffers allocated now on every rank; the bytes rank 0 allocated."""
        return self.call("plan_offload", parts, keep_across_saves)[0]

    def offload(self) -> int:
        """Hand the devices back (what :meth:`plan_offload` chose to host memory, gradients
        freed); the bytes rank 0 moved."""
        return self.call("offload")[0]

    def onload(self) -> None:
        self.call("onload")

    def release_cached_memory(self) -> None:
        self.call("release_cached_memory")

    # ---------------------------------------------------------------------- weights to engines
    def push_weights(self, plan, endpoints: list, version: int, role: str, held: int | None = None) -> dict[str, Any]:
        """The weights, the ``version``-th update, to the engines of ``role`` at ``endpoints`` as
        ``plan`` (a :class:`~bpo_megatron.weight_sync.plan.SyncPlan`) says (every rank takes part
        in the gather; a delta where the plan asks for one and those engines all hold ``held``);
        rank 0's report (bytes, seconds, failed endpoints, fingerprints, whether it was a delta)."""
        return self.call("push_weights", plan, endpoints, version, role, held)[0]

    def nccl_version(self):
        """The NCCL version rank 0 runs (None without NCCL)."""
        return self.call("nccl_version")[0]

    def host_weight_group(self, role: str) -> tuple[str, int]:
        """Rank 0 starts hosting the rendezvous of the weight group of the engines of ``role``:
        its node's address and the port it got."""
        return self.call("host_weight_group", role)[0]

    def open_weight_group(self, transport: str, world_size: int, role: str) -> list:
        """Form the weight group of ``transport`` for the engines of ``role`` at rank 0's rendezvous;
        returns the calls under way, :meth:`wait` for them once the engines have joined."""
        return self.submit("open_weight_group", transport, world_size, role)

    def close_transport(self, transport: str, role: str) -> None:
        """Every rank releases its ``transport`` to the engines of ``role`` (e.g. a weight group
        about to be formed again)."""
        self.call("close_transport", transport, role)

    def take_sent_bytes(self) -> int:
        """Bytes put into the object store for the ranks since the last call."""
        sent, self.sent_bytes = self.sent_bytes, 0
        return sent

    def _prepare(self, samples: list, *, replaying: bool, loss=None):
        """Refuse, before anything is sent, what every rank would refuse; the shares the ranks'
        own whole-batch calls would choose, so results map back to sample order alike (the
        routing came from an engine, which checked its ids on arrival)."""
        from bpo_megatron.trainer.shares import prepare_shares

        return prepare_shares(samples, self.hf, dp_size=self.dp_size, budget=self.budget, cost=self.cost,
                              replaying=replaying, loss=loss, routing_ids=False, cp=self.cp)

    def _put_shares(self, samples: list, shares: list[list[int]]) -> list:
        import ray

        refs = [ray.put([samples[i] for i in share]) for share in shares]
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
