"""Buckets of the trainer's weights in host memory, copied from the GPU while the next weights are
still being gathered.

Each device tensor is copied as soon as it arrives, asynchronously on a side stream, into its
place in one pinned buffer the size of a bucket, which is reused bucket after bucket; a bucket is
handed over once its copies are complete. So the device→host copies of a bucket overlap the
gathers of the tensors after them, and host memory stays bounded by one bucket. A tensor larger
than a bucket is a bucket of its own, copied synchronously, as is a load group's tensor that does not
fit in the buffer after the group's first (:func:`~bpo_megatron.weights.buckets.buckets` cuts the same
way). Host tensors (a CPU trainer) pass through without a copy.

A bucket's tensors are valid until the next bucket is asked for (the buffer is then written
again): a consumer copies or sends them before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from bpo_megatron.weights.buckets import may_cut_between, tensor_bytes

_ALIGN = 256  # bytes: every tensor's place starts where any dtype's view may begin


class HostStaging:
    """Owns the pinned buffer and the copy stream; keep one per trainer rank and reuse it."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._stream = None

    def buckets(self, named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
                ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket: list[tuple[str, torch.Tensor]] = []
        offset = 0  # bytes of the bucket so far (its place in the buffer)
        for name, tensor in named_tensors:
            tensor = tensor.detach()
            nbytes = tensor_bytes(tensor)
            if bucket and offset + nbytes > max_bytes and may_cut_between(bucket[-1][0], name):
                self._wait()
                yield bucket
                bucket, offset = [], 0
            if tensor.device.type == "cpu":
                bucket.append((name, tensor))
            elif offset + nbytes > max_bytes:  # larger than a bucket, or past its end in a load group
                bucket.append((name, tensor.to("cpu")))
            else:
                bucket.append((name, self._copy(tensor, offset, max_bytes)))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        if bucket:
            self._wait()
            yield bucket

    def _copy(self, tensor: torch.Tensor, offset: int, max_bytes: int) -> torch.Tensor:
        """Start copying ``tensor`` into the buffer at ``offset``; the host view it will fill."""
        if self._buffer is None or self._buffer.numel() < max_bytes:
            self._wait()
            self._buffer = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True)
            self._stream = torch.cuda.Stream(device=tensor.device)
        place = self._buffer[offset:offset + tensor_bytes(tensor)].view(tensor.dtype).view(tensor.shape)
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is computed
        with torch.cuda.stream(self._stream):
            place.copy_(tensor, non_blocking=True)
        tensor.record_stream(self._stream)  # not reused by the allocator before the copy ran
        return place

    def _wait(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
