"""``cuda_ipc``: the embedded engine on the trainer's GPU takes each bucket from the trainer's
device memory, mapped by CUDA IPC: no host copy, no object store, no serialisation of the bytes.

Engine ``e`` (one GPU) shares its GPU with trainer rank ``e`` (the colocated placement,
``orchestration/placement.py``). Every trainer rank receives each bucket on its own GPU as one flat
buffer (the export's :class:`~bpo_megatron.weights.flat_bucket.FlatBucket`: rank 0 packs it, one
broadcast fills it elsewhere, as for SGLang's ``cuda_ipc``); the rank beside an engine hands the
engine's actor the buffer's IPC handle and its table
(:class:`~bpo_megatron.weights.shared_bucket.SharedBucket`) and waits until the engine has
copied every tensor into its weights (a device-to-device copy; ≈ 2 TB/s between two processes on
an H200, the kit's ``ipc_weights``) before the buffer may go. Engines found dead on any rank are
reported by every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from bpo_megatron import platform
from bpo_megatron.weight_sync.transport import Bucket, EngineEndpoint, SendReport
from bpo_megatron.weights.buckets import tensor_bytes
from bpo_megatron.weights.flat_bucket import FlatBucket
from bpo_megatron.weights.shared_bucket import SharedBucket, device_handle

LOAD_TIMEOUT_S = 600.0  # an engine answers once it has copied a bucket into its weights


class EngineLoadTimeout(RuntimeError):
    """An engine did not load a bucket within LOAD_TIMEOUT_S."""


def _rank_and_world() -> tuple[int, int]:
    """This trainer rank and the trainer world's size; a trainer of one process that formed no
    world (a stand-in trainer in the driver) is rank 0 of 1."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def beside(engine: int, world: int) -> int:
    """The trainer rank on the GPU of colocated engine ``engine`` (one GPU each)."""
    if engine >= world:
        raise ValueError(f"colocated engine {engine} needs trainer rank {engine} beside it, the trainer has {world} "
                         "(rollout.num_engines ≤ cluster.trainer_ranks)")
    return engine


class CudaIpc:
    host_tensors = False  # each rank keeps its copy on its own GPU
    views = True  # the export packs each bucket into one flat buffer before it is sent
    every_rank = True  # the rank beside each engine hands over its own GPU's copy
    whole_group = False  # engines are updated one by one (a replaced one alone)
    needs = frozenset({"actor"})  # the engine's actor loads the bucket (its update_weights_shared)

    def __init__(self, share: Callable[[torch.Tensor], Any] = device_handle) -> None:
        # share: how the buffer travels (tests on a CPU: weights.shared_bucket.by_value)
        self.share = share
        self._mine: dict[int, Any] = {}  # position in the endpoints -> actor of an engine beside this rank

    def prepare(self, endpoints: list[EngineEndpoint]) -> None:
        """Runs on every trainer rank with the same ``endpoints``: the engines beside this rank."""
        rank, world = _rank_and_world()
        self._mine = {i: endpoint.actor for i, endpoint in enumerate(endpoints)
                      if beside(endpoint.index, world) == rank}

    def send(self, buckets: Iterable[FlatBucket | Bucket], version: int) -> SendReport:
        """Runs on every trainer rank; every rank returns the same report (the bytes of the
        buckets, the positions of the engines found dead)."""
        alive, failed, sent = dict(self._mine), [], 0
        self._mine = {}
        for bucket in buckets:
            flat = bucket if isinstance(bucket, FlatBucket) else FlatBucket.pack(list(bucket))
            sent += sum(tensor_bytes(tensor) for _, tensor in flat)
            if alive:
                lost = _load(SharedBucket(self.share(flat.buffer), flat.entries), alive)
                alive = {i: actor for i, actor in alive.items() if i not in lost}
                failed += lost
            del flat, bucket  # loaded (or its engine lost): the buffer may go
        _, world = _rank_and_world()
        if world > 1:
            everyone: list[list[int]] = [[] for _ in range(world)]
            dist.all_gather_object(everyone, failed)
            failed = [i for each in everyone for i in each]
        platform.release_cached_memory()  # the buffers the engines mapped and let go
        return {"bytes": sent, "failed": sorted(failed)}

    def close(self) -> None:
        self._mine = {}


def _load(shared: SharedBucket, engines: dict[int, Any]) -> list[int]:
    """``shared`` loaded by every engine actor of ``engines`` (position → actor), each within
    LOAD_TIMEOUT_S; the positions of those that died."""
    import ray

    replies = [(i, engines[i].update_weights_shared.remote(shared)) for i in engines]
    lost = []
    for i, reply in replies:
        try:
            ray.get(reply, timeout=LOAD_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            lost.append(i)
        except ray.exceptions.GetTimeoutError as exc:
            raise EngineLoadTimeout(f"engine {i} did not load a bucket of weights within {LOAD_TIMEOUT_S:.0f} s "
                                    "(CUDA IPC)") from exc
    return lost
