"""Grouping a stream of named tensors into size-bounded buckets for weight sync.

Each bucket reaches an engine in one load call. Tensors an engine fuses across names and writes only
when all of them arrive in one call (a load group, :func:`~bpo_megatron.weights.names.load_group`)
are consecutive in the export, and no bucket is cut between two of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

from bpo_megatron.weights.names import load_group

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
T = TypeVar("T")


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def may_cut_between(previous: str, name: str) -> bool:
    """Whether a bucket may end after the tensor ``previous`` and the next begin with ``name``: not
    when both belong to one load group."""
    group = load_group(name)
    return group is None or group != load_group(previous)


def buckets(named_tensors: Iterable[T], max_bytes: int = DEFAULT_BUCKET_BYTES,
            size: Callable[[T], int] = lambda item: tensor_bytes(item[1]),
            name: Callable[[T], str] = lambda item: item[0]) -> Iterator[list[T]]:
    """Consecutive groups of at most ``max_bytes`` (a single larger tensor is a bucket of its own),
    so at most one bucket of weights is held beyond what the iterator itself holds. A load group's
    tensors stay in one bucket, which may then exceed ``max_bytes`` by the group's later tensors.
    Items are ``(name, tensor)`` pairs unless ``size`` and ``name`` say how large another kind of
    item is and what it is called."""
    bucket: list[T] = []
    total = 0
    for item in named_tensors:
        nbytes = size(item)
        if bucket and total + nbytes > max_bytes and may_cut_between(name(bucket[-1]), name(item)):
            yield bucket
            bucket, total = [], 0
        bucket.append(item)
        total += nbytes
    if bucket:
        yield bucket
