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

from bpo_megatron.weights.buckets import tensor_bytes

Packed = list[tuple[str, str, tuple[int, ...], Any]]  # (name, dtype, shape, numpy uint8 array)


def pack(bucket: list[tuple[str, torch.Tensor]]) -> Packed:
    """Host tensors → their bytes as NumPy arrays (views; copies only of non-contiguous tensors).
    NumPy views make torch mark a storage unresizable: pack copies, never a model's parameters."""
    return [(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
             tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()) for name, tensor in bucket]


def unpack(packed: Packed) -> list[tuple[str, torch.Tensor]]:
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

    @staticmethod
    def destinations(engines, indices: list[int]) -> list:
        return [engines.workers[i] for i in indices]

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], engines: list, version: int) -> dict[str, Any]:
        """``engines``: the engine actors to load the buckets into (their ``update_weights_packed``).
        Returns the bytes sent and the positions of the engines that died (``failed``)."""
        alive, failed, sent = list(range(len(engines))), [], 0
        for bucket in buckets:
            lost = deliver(pack(bucket), {i: engines[i] for i in alive})
            alive = [i for i in alive if i not in lost]
            failed += lost
            sent += sum(tensor_bytes(t) for _, t in bucket)
        return {"bytes": sent, "failed": failed}

    def close(self) -> None:
        pass
