"""Grouping a stream of named tensors into size-bounded buckets for weight sync."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def on_host(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors detached on the CPU, converted to ``dtype`` (the engines' precision) if given."""
    for name, tensor in named_tensors:
        yield name, tensor.detach().to("cpu", dtype)


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int = DEFAULT_BUCKET_BYTES
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``max_bytes`` (a single larger tensor is a bucket of its own),
    so at most one bucket of weights is held beyond what the iterator itself holds."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
