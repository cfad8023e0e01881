"""A flat bucket handed to another process on the same GPU without a copy: the CUDA IPC handle of
its buffer and its table of entries (:class:`SharedBucket`), plain values any pickler carries
(Ray's included); the receiver maps the sender's device memory and reads the tensors in place.

The handle is torch's own reduction of a CUDA tensor for IPC (the allocation's handle, offsets,
its reference counter and the event the sender's writes are ordered by) with the device named by
its UUID instead of its index: two processes that see different ``CUDA_VISIBLE_DEVICES`` number
one GPU differently. The sender keeps the buffer alive until the receiver is done with it (the
receiver's copies are complete when :meth:`SharedBucket.opened` returns); torch frees a shared
block only once the receiver let go of it (``torch.cuda.ipc_collect``).

Where CUDA IPC cannot run (a CPU), tests hand the buffer itself (:class:`ByValue`, a copy travels):
everything up to the mapping is the same path.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch.multiprocessing import reductions

from bpo_megatron.weights.flat_bucket import FlatBucket

# where torch's CUDA reduction puts the storage's device among rebuild_cuda_tensor's arguments
DEVICE_ARG = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters).index("storage_device")


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(uuid: str) -> int:
    """This process's index of the CUDA device with ``uuid``."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise RuntimeError(f"no CUDA device of this process has UUID {uuid}: the sender's GPU is not visible here "
                       "(the receiver must run on the sender's GPU)")


@dataclass(frozen=True)
class DeviceHandle:
    """A CUDA buffer as torch's IPC reduction describes it, its device by UUID."""

    args: tuple  # rebuild_cuda_tensor's arguments; at DEVICE_ARG the device's UUID

    def open(self) -> torch.Tensor:
        """The sender's buffer, mapped into this process (no copy)."""
        args = list(self.args)
        args[DEVICE_ARG] = device_index(args[DEVICE_ARG])
        return reductions.rebuild_cuda_tensor(*args)


def device_handle(buffer: torch.Tensor) -> DeviceHandle:
    """The IPC handle of ``buffer``, a dense CUDA tensor; host memory is refused (another process
    cannot map it; it would travel as a copy inside the message)."""
    if not buffer.is_cuda:
        raise ValueError(f"a CUDA IPC handle maps device memory; this buffer is on {buffer.device}: weights reach an "
                         "engine by CUDA IPC only from the trainer's GPU")
    rebuild, args = reductions.reduce_tensor(buffer)
    if rebuild is not reductions.rebuild_cuda_tensor:
        raise ValueError(f"a {buffer.layout} tensor on {buffer.device} reduces to {rebuild!r}, not to a CUDA IPC handle")
    args = list(args)
    args[DEVICE_ARG] = device_uuid(args[DEVICE_ARG])
    return DeviceHandle(tuple(args))


@dataclass(frozen=True)
class ByValue:
    """The buffer itself (its bytes travel): where CUDA IPC cannot run, for tests of the path up
    to the mapping; never a way to send weights."""

    buffer: torch.Tensor

    def open(self) -> torch.Tensor:
        return self.buffer


def by_value(buffer: torch.Tensor) -> ByValue:
    return ByValue(buffer.detach().cpu())


@dataclass(frozen=True)
class SharedBucket:
    """A :class:`~bpo_megatron.weights.flat_bucket.FlatBucket` as another process receives it."""

    handle: DeviceHandle | ByValue
    entries: list[SimpleNamespace]

    @contextlib.contextmanager
    def opened(self) -> Iterator[FlatBucket]:
        """The bucket over the sender's memory while the block runs; on leaving, the work queued
        on it (the receiver's copies out of it) is complete, so once the receiver drops the
        bucket (the mapping goes with its last reference) the sender may free or reuse it."""
        flat = FlatBucket(self.handle.open(), self.entries)
        try:
            yield flat
        finally:
            if flat.buffer.is_cuda:
                torch.cuda.synchronize(flat.buffer.device)
