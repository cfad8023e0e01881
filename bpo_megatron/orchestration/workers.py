"""The Ray actors: one train worker per trainer rank, one engine worker per rollout engine.

Both are plain classes; :mod:`bpo_megatron.orchestration.groups` turns them into Ray actors.
Keeping Ray out of them keeps them testable and lets the trainer world run without Ray too.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from bpo_megatron import platform
from bpo_megatron.observability.library_logs import quiet_library_logs
from bpo_megatron.orchestration import gloo_interface
from bpo_megatron.orchestration.cluster import host_rendezvous
from bpo_megatron.orchestration.host_values import returns_host_values

if TYPE_CHECKING:
    from bpo_megatron.weight_sync.plan import SyncPlan
    from bpo_megatron.weight_sync.sender import SentReport

# How long a rendezvous waits for its members: a trainer rank for rank 0's store, a weight group's
# host for the engines' TP ranks.
START_TIMEOUT = datetime.timedelta(minutes=10)


@returns_host_values
class TrainWorker:
    """One rank of the trainer world: a :class:`~bpo_megatron.trainer.actor.TrainActor`."""

    def __init__(self, spec, rank: int, world_size: int, threads: int = 1) -> None:
        """``spec``: the :class:`~bpo_megatron.trainer.spec.TrainerSpec` every rank builds its
        actor from (the experiment's trainer sections, not the experiment). The rank joins its
        world and builds the actor in :meth:`join`; rank 0 hosts the world's rendezvous from here
        on (:meth:`rendezvous`)."""
        quiet_library_logs()
        torch.set_num_threads(threads)
        # read by the CUDA driver when this process makes its context (bind_device makes it)
        connections_note = platform.set_device_max_connections(spec.parallel.device_max_connections)
        if connections_note and rank == 0:
            print(f"trainer: {connections_note}", flush=True)
        platform.bind_device()  # before NCCL binds this rank to a GPU
        network_note = gloo_interface.apply()  # before any gloo group exists
        if network_note and rank == 0:
            print(f"trainer: {network_note}", flush=True)
        self.rank, self.world_size, self.spec, self.hf = rank, world_size, spec, spec.hf
        self._transports: dict[tuple[str, str], Any] = {}  # (transport, engine group) -> it (a group stays open)
        self._held_weights: dict[str, Any] = {}  # engine group -> what its engines hold (delta syncs' HeldWeights)
        self._weight_stores: dict[str, Any] = {}  # engine group -> the store its weight group will meet at
        self._store = host_rendezvous(START_TIMEOUT.total_seconds())[0] if rank == 0 else None

    def rendezvous(self) -> str:
        """Where rank 0 hosts the world's rendezvous (``address:port``)."""
        return f"{self._store.host}:{self._store.port}"

    def join(self, master: str) -> tuple[int, int, bool]:
        """Join the trainer world at ``master`` (rank 0's :meth:`rendezvous`), build the actor, and
        say where this rank stands (:meth:`ready`)."""
        if self._store is None:
            host, port = master.rsplit(":", 1)
            self._store = dist.TCPStore(host, int(port), self.world_size, is_master=False, timeout=START_TIMEOUT)
        dist.init_process_group(backend=platform.distributed_backend(), store=self._store, rank=self.rank,
                                world_size=self.world_size, timeout=datetime.timedelta(minutes=30))
        self.actor = self.spec.build()
        return self.ready()

    def ready(self) -> tuple[int, int, bool]:
        """Where this rank stands: its data-parallel index and size, and whether it returns the
        results of its share."""
        ranks = self.actor.ranks
        return ranks.dp, ranks.dp_size, self.actor.returns_share_results

    def load_hf(self, directory: str) -> int:
        return self.actor.load_hf(directory)

    def set_learning_rate(self, lr: float) -> None:
        self.actor.set_learning_rate(lr)

    def set_loss(self, loss) -> None:
        self.actor.set_loss(loss)

    def logprobs_of_share(self, share, record_routing: bool = False):
        """This rank's data-parallel share (one object-store copy per share, read by its ranks);
        the results from the one rank per share that returns them (None from the others)."""
        scored = self.actor.logprobs_of_share(share, record_routing=record_routing)
        return scored if self.actor.returns_share_results else None

    def train_share(self, share, totals) -> dict[str, float]:
        return self.actor.train_share(share, totals)

    def plan_offload(self, parts: str, keep_across_saves: bool) -> int:
        return self.actor.plan_offload(parts, keep_across_saves=keep_across_saves)

    def offload(self) -> int:
        return self.actor.offload()

    def release_cached_memory(self) -> None:
        """Free blocks of the caching allocator back to the device (before colocated engines
        resume their weights beside this rank)."""
        platform.release_cached_memory()

    def onload(self) -> int:
        return self.actor.onload()

    def save(self, root: str, step: int, trainer_state: dict[str, Any], keep_last: int | None,
             background: bool = False) -> dict[str, float]:
        self.actor.save(root, trainer_state=trainer_state, keep_last=keep_last, step=step, background=background)
        return {"waited_s": self.actor.saves.waited_s, "staged_s": self.actor.saves.staged_s}

    def finish_saves(self) -> int | None:
        return self.actor.finish_saves("the run needs its checkpoint written")

    def load(self, root: str, verify: bool = True) -> dict[str, Any]:
        return self.actor.load(root, verify=verify)

    def host_weight_group(self, channel: str = "rollout") -> tuple[str, int] | None:
        """Rank 0 starts hosting the rendezvous of the weight group of ``channel``'s engines and
        says where it is (its node's address and the port it got); None from the others."""
        if self.rank != 0:
            return None
        self._weight_stores[channel], address, port = host_rendezvous(START_TIMEOUT.total_seconds())
        return address, port

    def nccl_version(self):
        """The NCCL version this rank runs (None without NCCL): what the weight group checks."""
        from bpo_megatron.rollout.sglang.weights import DistributedWeightSender

        return DistributedWeightSender.nccl_version()

    def open_weight_group(self, transport: str, world_size: int, channel: str = "rollout") -> None:
        """Rank 0 forms the group of ``transport`` shared with the engines' TP ranks at the
        rendezvous :meth:`host_weight_group` opened, and waits for them to join; others do nothing.
        ``channel``: which engine group it serves (rollout or evaluation engines: a group each)."""
        if self.rank == 0:
            self._transport(transport, channel).open(self._weight_stores.pop(channel), world_size,
                                                     platform.distributed_backend())

    def push_weights(self, plan: SyncPlan, endpoints: list, version: int, channel: str = "rollout",
                     held: int | None = None) -> SentReport:
        """This rank's part of a sync to the engines of ``channel`` at ``endpoints`` (the driver's
        :class:`~bpo_megatron.weight_sync.transport.EngineEndpoint` records), as ``plan`` says:
        :func:`~bpo_megatron.weight_sync.sender.send_weights` over this rank's transport, a delta
        against this rank's record of what those engines hold where they all hold ``held``."""
        from bpo_megatron.weight_sync.delta import HeldWeights
        from bpo_megatron.weight_sync.sender import send_weights

        record = self._held_weights.setdefault(channel, HeldWeights()) if plan.delta is not None else None
        return send_weights(self.actor, self._transport(plan.transport, channel), plan, endpoints, version,
                            rank=self.rank, record=record, held=held)

    def close_transport(self, transport: str, channel: str = "rollout") -> None:
        """Release what this rank's ``transport`` to the engines of ``channel`` holds (a weight
        group, before it is formed again); the next sync builds it anew."""
        if (transport, channel) in self._transports:
            self._transports.pop((transport, channel)).close()

    def _transport(self, name: str, channel: str = "rollout"):
        """This rank's transport ``name`` to the engines of ``channel`` (each engine group its
        own: a weight group holds one group's engines)."""
        from bpo_megatron.weight_sync import transport_class

        if (name, channel) not in self._transports:
            self._transports[(name, channel)] = transport_class(name)()
        return self._transports[(name, channel)]

    def shutdown(self) -> None:
        self.actor.close()
        dist.destroy_process_group()


@returns_host_values
class EngineWorker:
    """One rollout engine: the engine ``engine`` names (its spec in ``rollout/<engine>/``), built
    from its own options and the context the engine group gives it."""

    def __init__(self, engine: str, options, context) -> None:
        """``options``: the engine's section (``rollout.<engine>``); ``context``: an
        :class:`~bpo_megatron.rollout.EngineContext` whose empty ``node_address`` means the
        address other nodes reach this actor's node at (Ray's, found here on that node)."""
        quiet_library_logs()
        from dataclasses import replace

        from bpo_megatron.rollout.engine import engine_spec

        if not context.node_address:
            import ray

            context = replace(context, node_address=ray.util.get_node_ip_address())
        self.engine = engine_spec(engine).build(options, context)

    def captures_routing(self) -> bool:
        return self.engine.capabilities.captures_routing

    def generate(self, requests):
        """The samples as they finish, in batches of (position, sample) (a Ray streaming generator)."""
        yield from self.engine.generate_as_finished(requests)

    def update_weights(self, bucket) -> int:
        return self.engine.update_weights(bucket)

    def weight_details(self) -> tuple[str, object]:
        """This actor's node and what the engine's own weight transports need to reach it
        (:meth:`~bpo_megatron.rollout.engine.RolloutEngine.weight_details`, opaque here)."""
        import ray

        return ray.get_runtime_context().get_node_id(), self.engine.weight_details()

    def update_weights_packed(self, packed) -> int:
        """A bucket as the ``object_store`` transport sends it."""
        from bpo_megatron.weight_sync.object_store import unpack

        return self.engine.update_weights(unpack(packed))

    def update_weights_shared(self, shared) -> int:
        """A bucket in the sender's device memory (a ``weights.shared_bucket.SharedBucket``, what
        the embedded engine's ``cuda_ipc`` transport hands over): mapped, copied into the
        engine's weights, let go before this returns."""
        with shared.opened() as flat:
            return self.engine.update_weights(flat)

    def fingerprints(self) -> dict[str, str]:
        from bpo_megatron.weights.checksums import fingerprints

        return fingerprints(self.engine.named_hf_weights())

    def endpoint(self):
        """Where the engine's server is reached, on its node's address, and with which key
        (engines that run a server)."""
        return self.engine.endpoint()

    def nccl_version(self):
        """The NCCL version the engine's server runs (engines that run one)."""
        return self.engine.nccl_version()

    def join_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        from bpo_megatron.rollout.sglang.nccl_broadcast import GROUP_NAME

        self.engine.join_weight_group(master_address, master_port, rank_offset, world_size, GROUP_NAME,
                                      platform.distributed_backend())

    def leave_weight_group(self) -> None:
        from bpo_megatron.rollout.sglang.nccl_broadcast import GROUP_NAME

        self.engine.leave_weight_group(GROUP_NAME)

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        self.engine.resume_memory(tags)

    def begin_weight_update(self, version: int) -> None:
        self.engine.begin_weight_update(version)

    def end_weight_update(self) -> None:
        self.engine.end_weight_update()

    def weight_version(self) -> int:
        return self.engine.weight_version

    def healthy(self) -> bool:
        return self.engine.health().healthy

    def progress(self) -> int | None:
        """See :meth:`~bpo_megatron.rollout.engine.RolloutEngine.progress`."""
        return self.engine.progress()

    def shutdown(self) -> None:
        self.engine.shutdown()
