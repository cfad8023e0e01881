"""``cuda_ipc``: SGLang engines on the trainer's own GPUs map the trainer's memory.

Engine ``e``'s TP rank ``t`` shares a GPU with trainer rank ``e × tp + t`` (the colocated placement
puts engine ``e`` on trainer bundles ``e × tp …``). Every trainer rank receives each bucket on its
own GPU straight into one buffer in SGLang's ``flattened_bucket`` layout (the export's
:class:`~bpo_megatron.weights.flat_bucket.FlatBucket`: rank 0 packs its tensors into it, the
bucket's one copy, and one broadcast fills it elsewhere) and turns that buffer, uncopied, into a
CUDA IPC handle; the handles are gathered, and the trainer rank beside each engine's TP rank 0
posts that engine one ``/update_weights_from_tensor`` whose entry ``t`` is the handle from TP rank
``t``'s own GPU. Buffers stay alive until every engine has answered (each server copies out of
them while it handles the request). Host tensors never travel this way (:func:`ipc_payload`
refuses them).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist

from bpo_megatron import platform
from bpo_megatron.rollout.sglang.endpoint import ServerEndpoint
from bpo_megatron.rollout.sglang.http import ServerUnavailable
from bpo_megatron.rollout.sglang.weights import flattened_bucket, ipc_payload, ipc_update_body
from bpo_megatron.weight_sync.transport import Bucket, EngineEndpoint, SendReport
from bpo_megatron.weights.buckets import tensor_bytes
from bpo_megatron.weights.flat_bucket import FlatBucket

UPDATE_TIMEOUT_S = 600.0  # a server answers once its ranks loaded the bucket


class IpcUpdateFailed(RuntimeError):
    """A server refused a bucket; the message names it."""


def colocated_ranks(engine: int, tp_size: int, trainer_ranks: int) -> tuple[int, ...]:
    """The trainer ranks sharing a GPU with engine ``engine``'s TP ranks, in TP order."""
    ranks = tuple(range(engine * tp_size, (engine + 1) * tp_size))
    if ranks[-1] >= trainer_ranks:
        raise ValueError(f"colocated engine {engine} of TP {tp_size} needs trainer ranks {ranks[0]}–{ranks[-1]}, "
                         f"the trainer has {trainer_ranks} (rollout.num_engines × rollout.sglang.tp_size ≤ "
                         "cluster.trainer_ranks)")
    return ranks


class CudaIpc:
    host_tensors = False  # each rank keeps its copy on its own GPU
    views = True  # the export packs each bucket into one flat buffer before it is sent
    every_rank = True  # every trainer rank receives the buckets and hands its GPU's copy over
    whole_group = False  # engines are updated one by one (a restarted one alone)
    needs = frozenset({"details"})  # each engine's server endpoint (its TP size places it beside trainer ranks)

    def __init__(self, serializer=None) -> None:
        self.serializer = serializer  # tests only: replaces the IPC pickler (see ipc_payload)
        self._targets: list[tuple[ServerEndpoint, tuple[int, ...]]] = []

    def prepare(self, endpoints: list[EngineEndpoint]) -> None:
        """Runs on every trainer rank with the same ``endpoints``: each engine's server and the
        trainer ranks beside its TP ranks (engine ``e`` of TP ``t`` beside ranks ``e × t …``)."""
        world = dist.get_world_size()
        self._targets = [(endpoint.details, colocated_ranks(endpoint.index, endpoint.details.tp_size, world))
                         for endpoint in endpoints]

    def send(self, buckets: Iterable[FlatBucket | Bucket], version: int) -> SendReport:
        """Runs on every trainer rank; every rank returns the same report (bytes sent, positions
        of the engines whose server was lost). A :class:`FlatBucket` (what
        ``export_weights(all_ranks=True)`` yields) is handed over in its own buffer; a list of
        named tensors is packed into one first."""
        targets = self._targets
        rank, world = dist.get_rank(), dist.get_world_size()
        beside_an_engine = {r for _, ranks in targets for r in ranks}
        alive, failed, sent = list(range(len(targets))), [], 0
        for bucket in buckets:
            flat = flattened_bucket(bucket)
            mine = ipc_payload(flat, self.serializer) if rank in beside_an_engine else None
            payloads: list[str | None] = [None] * world
            dist.all_gather_object(payloads, mine)
            outcome: dict[int, str] = {}  # engine position -> "lost" or the refusal
            for i in alive:
                server, ranks = targets[i]
                if ranks[0] == rank:
                    outcome.update(_post(i, server, ipc_update_body([payloads[r] for r in ranks], version)))
            outcomes: list[dict[int, str]] = [{}] * world
            dist.all_gather_object(outcomes, outcome)  # also keeps every buffer alive until all servers answered
            del flat, payloads
            merged = {i: what for each in outcomes for i, what in each.items()}
            refused = [what for what in merged.values() if what != "lost"]
            if refused:
                raise IpcUpdateFailed("; ".join(refused))
            lost = sorted(merged)
            alive = [i for i in alive if i not in lost]
            failed += lost
            sent += sum(tensor_bytes(t) for _, t in bucket)
        platform.release_cached_memory()  # the buckets' buffers, which the servers mapped and let go
        return {"bytes": sent, "failed": failed}

    def close(self) -> None:
        self._targets = []


def _post(index: int, server: ServerEndpoint, body: dict) -> dict[int, str]:
    try:
        reply = server.post("update_weights_from_tensor", body, timeout=UPDATE_TIMEOUT_S)
    except ServerUnavailable:
        return {index: "lost"}
    except Exception as exc:  # noqa: BLE001 - reported with the server it came from, on every rank
        return {index: f"{server.url}: {exc}"}
    if isinstance(reply, dict) and reply.get("success") is False:
        return {index: f"{server.url} refused the bucket: {reply.get('message')}"}
    return {}
