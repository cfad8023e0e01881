"""A bucket of named tensors held in one byte buffer: the form in which a bucket is packed once,
moved in one collective, and handed to an engine as is.

:func:`layout` is the one definition of where each tensor lies: back to back in the given order,
each starting at a multiple of ``align`` bytes. With the default :data:`ALIGN` this is SGLang's
``flattened_bucket`` load format (the entries carry its field names: ``name, shape, dtype,
start_idx, end_idx, numel`` with ``numel`` in bytes); SGLang's loader reads entry ``e`` as
``buffer[e.start_idx:e.end_idx].view(e.dtype).view(e.shape)``. The entries are
``SimpleNamespace``s because SGLang's safe unpickler admits them, so neither side imports the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch

ALIGN = 16  # bytes: a tensor starting here may be viewed as any dtype (the widest is 16 bytes)


def layout(specs: Iterable[tuple[str, Sequence[int], torch.dtype]], align: int = ALIGN
           ) -> tuple[list[SimpleNamespace], int]:
    """The entries for ``(name, shape, dtype)`` in order, and the buffer's size in bytes.

    Every offset must be a multiple of its dtype's size (a byte range is viewed as the dtype in
    place); ``align=ALIGN`` guarantees that, a smaller ``align`` only where the order does (e.g.
    largest element size first with ``align=1``)."""
    entries, offset = [], 0
    for name, shape, dtype in specs:
        shape = torch.Size(shape)
        if offset % dtype.itemsize:
            raise ValueError(f"{name} ({dtype}) would start at byte {offset}, not a multiple of its "
                             f"element size: order the tensors by element size or align to {ALIGN}")
        nbytes = shape.numel() * dtype.itemsize
        entries.append(SimpleNamespace(name=name, shape=shape, dtype=dtype, start_idx=offset,
                                       end_idx=offset + nbytes, numel=nbytes))
        offset += -(-nbytes // align) * align
    return entries, offset


@dataclass
class FlatBucket:
    """``buffer`` (uint8, one dimension) holding the tensors that ``entries`` describe.

    Iterating gives ``(name, tensor)`` pairs, each tensor a view into ``buffer``, so a FlatBucket
    stands wherever a bucket of named tensors is read."""

    buffer: torch.Tensor
    entries: list[SimpleNamespace]

    @classmethod
    def empty(cls, specs: Iterable[tuple[str, Sequence[int], torch.dtype]], device: torch.device | str,
              align: int = ALIGN) -> FlatBucket:
        """An uninitialised buffer laid out for ``(name, shape, dtype)``: where a collective
        receives the bucket, or :meth:`fill` packs it."""
        entries, nbytes = layout(specs, align)
        return cls(torch.empty(nbytes, dtype=torch.uint8, device=device), entries)

    @classmethod
    def pack(cls, named: Sequence[tuple[str, torch.Tensor]], device: torch.device | str | None = None,
             align: int = ALIGN) -> FlatBucket:
        """The tensors copied once into a new buffer on ``device`` (theirs by default)."""
        flat = cls.empty([(name, t.shape, t.dtype) for name, t in named],
                         named[0][1].device if device is None else device, align)
        return flat.fill(t for _, t in named)

    def fill(self, tensors: Iterable[torch.Tensor]) -> FlatBucket:
        """Copy ``tensors`` (one per entry, in order; any strides, any device) into their byte
        ranges: a single copy each, straight from the source's memory."""
        tensors = list(tensors)
        if len(tensors) != len(self.entries):
            raise ValueError(f"{len(tensors)} tensors for a bucket of {len(self.entries)}")
        for entry, tensor in zip(self.entries, tensors):
            if tensor.dtype != entry.dtype or tensor.shape != entry.shape:
                raise ValueError(f"{entry.name}: got {tuple(tensor.shape)} {tensor.dtype}, the bucket holds "
                                 f"{tuple(entry.shape)} {entry.dtype}")  # copy_ would cast silently
            self.view(entry).copy_(tensor.detach())
        return self

    def view(self, entry: SimpleNamespace) -> torch.Tensor:
        """``entry``'s tensor: its byte range of the buffer, no copy."""
        return self.buffer[entry.start_idx:entry.end_idx].view(entry.dtype).view(entry.shape)

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(entry.name, self.view(entry)) for entry in self.entries]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.named())

    def __len__(self) -> int:
        return len(self.entries)
