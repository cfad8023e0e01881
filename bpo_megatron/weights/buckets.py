"""Grouping a stream of named tensors into size-bounded buckets for weight sync."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
T = TypeVar("T")


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def buckets(named_tensors: Iterable[T], max_bytes: int = DEFAULT_BUCKET_BYTES,
            size: Callable[[T], int] = lambda item: tensor_bytes(item[1])) -> Iterator[list[T]]:
    """Consecutive groups of at most ``max_bytes`` (a single larger tensor is a bucket of its own),
    so at most one bucket of weights is held beyond what the iterator itself holds. Items are
    ``(name, tensor)`` pairs unless ``size`` says how large another kind of item is."""
    bucket: list[T] = []
    total = 0
    for item in named_tensors:
        nbytes = size(item)
        if bucket and total + nbytes > max_bytes:
            yield bucket
            bucket, total = [], 0
        bucket.append(item)
        total += nbytes
    if bucket:
        yield bucket
