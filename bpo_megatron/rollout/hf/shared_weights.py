"""An embedded engine's weights in one shared-memory segment, writable from another process.

On a CPU node the trainer (rank 0) and an engine actor are separate processes of separate trees.
Moving the engine's parameters into a shared segment once lets the trainer write each Hugging Face
tensor straight into the engine's parameter view: one copy per sync, as a copy inside one process,
instead of a copy into Ray's object store and another out of it.

The segment is an anonymous memory file (``memfd_create``) with no name in any file system, so
nothing can outlive its users: another process of the same user maps it through
``/proc/<pid>/fd/<fd>`` (:func:`attach`), and the memory is freed when the last mapping goes.
"""

from __future__ import annotations

import mmap
import os
import uuid
from dataclasses import dataclass

import torch
from torch import nn

ALIGN = 64  # bytes; every parameter starts on a cache line


@dataclass(frozen=True)
class TensorPlace:
    """Where one weight view lies in the segment (element offset, shape and strides of its dtype)."""

    dtype: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class SegmentLayout:
    name: str  # unique per segment
    pid: int  # the owner, and its descriptor of the segment
    fd: int
    nbytes: int
    places: dict[str, TensorPlace]  # Hugging Face name -> place


class SharedWeights:
    """Moves ``model``'s parameters into a fresh segment (their values unchanged; every parameter
    then views the segment). ``views``: the model's Hugging Face weight views, taken afterwards."""

    def __init__(self, model: nn.Module) -> None:
        params = [p for p in model.parameters()]
        if any(p.device.type != "cpu" for p in params):
            raise ValueError("only weights in host memory can be shared this way")
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
        self.name, self.nbytes = f"bpo-weights-{uuid.uuid4().hex[:12]}", max(total, ALIGN)
        self.fd = os.memfd_create(self.name)
        os.ftruncate(self.fd, self.nbytes)
        self._map = mmap.mmap(self.fd, self.nbytes)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        with torch.no_grad():
            for p, offset in zip(params, offsets):
                nbytes = p.numel() * p.element_size()
                place = whole[offset:offset + nbytes].view(p.dtype).view(p.shape)
                place.copy_(p.data)
                p.data = place
        self._whole = whole

    def layout(self, views: dict[str, torch.Tensor]) -> SegmentLayout:
        """Where each of ``views`` (tensors viewing the segment) lies in it."""
        base = self._whole.data_ptr()
        places = {}
        for name, view in views.items():
            start = view.data_ptr() - base
            if not 0 <= start < self.nbytes or start % view.element_size():
                raise ValueError(f"{name} does not lie in the shared weights")
            places[name] = TensorPlace(str(view.dtype).removeprefix("torch."), start // view.element_size(),
                                       tuple(view.shape), tuple(view.stride()))
        return SegmentLayout(self.name, os.getpid(), self.fd, self.nbytes, places)

    def close(self) -> None:
        """Give up this process's descriptor; the memory goes with the last mapping (the
        parameters, and any process that attached)."""
        self._whole = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def attach(layout: SegmentLayout) -> tuple[mmap.mmap, dict[str, torch.Tensor]]:
    """Map another process's segment (same node, same user); the weights' views into it, by name."""
    fd = os.open(f"/proc/{layout.pid}/fd/{layout.fd}", os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, layout.nbytes)
    finally:
        os.close(fd)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    views = {}
    for name, place in layout.places.items():
        typed = whole[:len(whole) - len(whole) % _itemsize(place.dtype)].view(getattr(torch, place.dtype))
        views[name] = typed.as_strided(place.shape, place.stride, place.offset)
    return mapping, views


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()
