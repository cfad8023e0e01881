"""``nccl_broadcast``: trainer rank 0 and every TP rank of every SGLang engine in one process group.

The group is joined as SGLang 0.5.23 joins it (see
:class:`~bpo_megatron.rollout.sglang.weights.DistributedWeightSender`): trainer rank 0 is rank 0
and hosts the rendezvous; engine ``e`` joins with ``rank_offset = 1 + Σ TP sizes of the engines
before it``. Each bucket is announced to every server (``/update_weights_from_distributed`` with
its names, dtypes, shapes and the weight version) and broadcast once from where the tensors lie:
the trainer's GPU with NCCL, host memory with gloo on a CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from bpo_megatron.rollout.sglang.endpoint import ServerEndpoint
from bpo_megatron.rollout.sglang.nccl import NcclVersion, check_nccl_versions
from bpo_megatron.rollout.sglang.weights import DistributedWeightSender
from bpo_megatron.weight_sync.transport import Bucket, EngineEndpoint, SendReport
from bpo_megatron.weights.buckets import tensor_bytes

GROUP_NAME = "bpo-weight-sync"
ANNOUNCE_TIMEOUT_S = 600.0  # a server answers once its ranks received the whole bucket


class BroadcastFailed(RuntimeError):
    """A server refused or did not answer a bucket; the message names it."""


class NcclBroadcast:
    host_tensors = False  # buckets stay where the trainer holds them (its GPU)
    views = True  # buckets may hold views of the parameters: each is packed into one buffer (one copy)
    every_rank = False  # rank 0 sends
    whole_group = True  # a broadcast reaches every member: all engines, in one group
    needs = frozenset({"details"})  # each engine's server (its ServerEndpoint) is told of each bucket

    def __init__(self) -> None:
        self.sender: DistributedWeightSender | None = None
        self._servers: list[ServerEndpoint] = []

    @staticmethod
    def group_ranks(servers: list[ServerEndpoint]) -> tuple[list[int], int]:
        """Where each engine's TP ranks start in the group (after trainer rank 0 and the engines
        before it), and the group's size."""
        offsets = [1 + sum(server.tp_size for server in servers[:i]) for i in range(len(servers))]
        return offsets, 1 + sum(server.tp_size for server in servers)

    @staticmethod
    def check_members(trainer_version: NcclVersion | None, engine_versions: Callable[[], list]) -> None:
        """NCCL refuses a communicator whose members run different versions (found only at the
        first broadcast): refuse the group before it forms. The engines are asked only when the
        trainer runs NCCL (gloo has no such rule)."""
        if trainer_version is not None:
            check_nccl_versions(trainer_version, engine_versions())

    def open(self, store, world_size: int, backend: str) -> None:
        """Form the group at ``store`` (the rendezvous this process hosts) and wait for every
        engine rank to join (they are asked to, at the same time, by the driver)."""
        self.close()
        self.sender = DistributedWeightSender(store, world_size, backend, GROUP_NAME)

    def prepare(self, endpoints: list[EngineEndpoint]) -> None:
        """``endpoints``: every engine in the group (all of them: a broadcast needs every member)."""
        self._servers = [endpoint.details for endpoint in endpoints]

    def send(self, buckets: Iterable[Bucket], version: int) -> SendReport:
        if self.sender is None:
            raise RuntimeError("the weight group is not open: the driver forms it before the first sync")
        sent = 0
        for bucket in buckets:
            body = {**self.sender.metadata(bucket), "weight_version": str(version)}
            errors: list[str] = []
            announcements = [threading.Thread(target=_announce, args=(server, body, errors), daemon=True)
                             for server in self._servers]
            for thread in announcements:
                thread.start()
            self.sender.broadcast(bucket)
            for thread in announcements:
                thread.join(ANNOUNCE_TIMEOUT_S)
            if errors or any(thread.is_alive() for thread in announcements):
                raise BroadcastFailed("; ".join(errors) or f"a server did not confirm a bucket within "
                                      f"{ANNOUNCE_TIMEOUT_S:.0f} s")
            sent += sum(tensor_bytes(t) for _, t in bucket)
        return {"bytes": sent, "failed": []}

    def close(self) -> None:
        self._servers = []
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def _announce(server: ServerEndpoint, body: dict, errors: list[str]) -> None:
    try:
        reply = server.post("update_weights_from_distributed", body, timeout=ANNOUNCE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - reported with the server it came from
        errors.append(f"{server.url}: {exc}")
        return
    if isinstance(reply, dict) and reply.get("success") is False:
        errors.append(f"{server.url} refused the bucket: {reply.get('message')}")
