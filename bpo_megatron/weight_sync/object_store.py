"""``object_store``: each bucket of host tensors enters Ray's object store once; every engine actor
loads it. An engine that dies meanwhile is left out of the rest and reported.

A bucket travels packed (:func:`pack`): per tensor its name, dtype, shape and its bytes as a NumPy
array, which Ray writes into shared memory as one out-of-band buffer and hands to the actor
without a copy (:func:`unpack` gives views of it). Pickled torch tensors instead go through
torch's storage serialisation, about 30× slower than a memory copy on the bench model.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from bpo_megatron.weight_sync.transport import Bucket, EngineEndpoint, SendReport
from bpo_megatron.weights.buckets import tensor_bytes

Packed = list[tuple[str, str, tuple[int, ...], Any]]  # (name, dtype, shape, numpy uint8 array)


def pack(bucket: Bucket) -> Packed:
    """Host tensors → their bytes as NumPy arrays (views; copies only of non-contiguous tensors).
    NumPy views make torch mark a storage unresizable: pack copies, never a model's parameters."""
    return [(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
             tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()) for name, tensor in bucket]


def unpack(packed: Packed) -> Bucket:
    """Views of the packed bytes as tensors again (read them; the memory is Ray's, read-only)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return [(name, torch.from_numpy(array).view(getattr(torch, dtype)).view(shape))
                for name, dtype, shape, array in packed]


def deliver(packed: Packed, engines: dict[int, Any]) -> list[int]:
    """One packed bucket into the object store, loaded by every engine actor of ``engines``
    (position → actor); the positions of those that died."""
    import ray

    ref = ray.put(packed)
    replies = [(i, engine.update_weights_packed.remote(ref)) for i, engine in engines.items()]
    lost = []
    for i, reply in replies:
        try:
            ray.get(reply)
        except ray.exceptions.RayActorError:
            lost.append(i)
    return lost


class ObjectStore:
    host_tensors = True  # buckets are copied to host memory before they leave the trainer
    views = False  # pack() exports the tensors' memory to NumPy: never the parameters' own
    every_rank = False  # rank 0 sends
    whole_group = False  # any subset of the engines
    needs = frozenset({"actor"})  # the engine actors load the buckets (their update_weights_packed)

    def __init__(self) -> None:
        self._engines: list = []

    def prepare(self, endpoints: list[EngineEndpoint]) -> None:
        self._engines = [endpoint.actor for endpoint in endpoints]

    def send(self, buckets: Iterable[Bucket], version: int) -> SendReport:
        """Every bucket to every prepared engine; the bytes sent and the positions of the engines
        that died (``failed``)."""
        alive, failed, sent = list(range(len(self._engines))), [], 0
        for bucket in buckets:
            lost = deliver(pack(bucket), {i: self._engines[i] for i in alive})
            alive = [i for i in alive if i not in lost]
            failed += lost
            sent += sum(tensor_bytes(t) for _, t in bucket)
        return {"bytes": sent, "failed": failed}

    def close(self) -> None:
        self._engines = []
