"""Context parallelism over packed rows: which positions of each sample a CP rank holds, and the
differentiable gather that puts a split row back together (keys and values for attention, log-probs
for the loss).

Causal attention costs a sample's late positions more than its early ones, so a sample is not cut
into ``cp`` consecutive pieces: it is padded to a multiple of ``2·cp``, viewed as ``2·cp`` equal
chunks, and rank ``r`` keeps chunk ``r`` and chunk ``2·cp − 1 − r`` (the split Megatron's ``thd``
path and transformer-engine's partition index use). Every rank then holds ``L / cp`` positions of
each sample of length ``L``, one chunk from each end, and an equal share of the attention work. The
split is applied sample by sample, one packed row after another, to every per-position tensor of a
micro-batch (tokens, targets, routing ids, …) with one index, :func:`zigzag_index`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist


def zigzag_index(bounds: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions of a packed row that CP rank ``cp_rank`` holds, in the order it holds them.

    ``bounds`` are the segment bounds of the whole row (0, …, total), every segment a multiple of
    ``2·cp_size`` long. For each segment of length ``L`` (chunk ``c = L / (2·cp_size)``): rows
    ``[start + r·c, start + (r+1)·c)`` then ``[start + (2cp−1−r)·c, start + (2cp−r)·c)``.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must lie in [0, {cp_size})")
    parts = []
    for start, end in zip(bounds, bounds[1:]):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(f"segment [{start}, {end}) of {length} positions is not a multiple of 2 × CP = "
                             f"{2 * cp_size}: pad each sample before splitting it")
        c = length // (2 * cp_size)
        parts.append(torch.arange(start + cp_rank * c, start + (cp_rank + 1) * c))
        parts.append(torch.arange(start + (2 * cp_size - 1 - cp_rank) * c, start + (2 * cp_size - cp_rank) * c))
    return torch.cat(parts)


def unzigzag_index(bounds: list[int], cp_size: int) -> torch.Tensor:
    """For each position of the row, its place in the CP ranks' rows concatenated rank by rank
    (what :func:`gather_rows` returns): ``gathered[unzigzag_index(...)]`` is the row in order."""
    held = torch.cat([zigzag_index(bounds, cp_size, rank) for rank in range(cp_size)])
    return torch.argsort(held)


class _GatherRows(torch.autograd.Function):
    """All-gather ``[t, …]`` over ``group`` into ``[size·t, …]`` (rank by rank). Backward: the
    gradient of this rank's rows, summed over every rank (``reduce=True``: each rank's downstream
    computation differs, as attention over gathered keys does), or this rank's own gradient of its
    rows (``reduce=False``: every rank computes the same function of the gathered rows, as the loss
    does, so summing would count it once per rank)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, group: dist.ProcessGroup, reduce: bool) -> torch.Tensor:
        ctx.group, ctx.reduce = group, reduce
        ctx.rank, ctx.rows = dist.get_rank(group), rows.shape[0]
        parts = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, rows.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if ctx.reduce:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None, None


def gather_rows(rows: torch.Tensor, group: dist.ProcessGroup, *, reduce_grad: bool) -> torch.Tensor:
    """Every CP rank's ``rows`` concatenated rank by rank, differentiably (see :class:`_GatherRows`)."""
    return _GatherRows.apply(rows, group, reduce_grad)


def context_parallel_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


@dataclass
class ContextSplit:
    """One packed row split over the CP group, as rank ``rank`` sees it: which positions it holds
    and, for attention over the whole samples, where its queries' keys are. Built on the host from
    the row's segment bounds, once per micro-batch (:meth:`of`); moved to the device with it.

    Each of the rank's chunks attends, causally, to its sample's positions up to the chunk's end:
    the chunk is a query segment of :attr:`query_bounds` and that prefix a key segment of
    :attr:`key_bounds` (FlashAttention's bottom-right aligned causal mask over a segment with fewer
    queries than keys is exactly causality on the sample's own positions). The prefixes are read
    from the CP ranks' gathered keys and values at :attr:`key_source`.
    """

    size: int
    rank: int
    held: torch.Tensor  # [t_local] long: the row positions this rank holds (zigzag_index)
    unzigzag: torch.Tensor  # [t] long: each row position's place among the ranks' gathered rows
    key_source: torch.Tensor  # [keys] long: gathered row of each key of each query chunk's prefix
    query_bounds: torch.Tensor  # [2·segments + 1] int32: this rank's chunks, in the order it holds them
    key_bounds: torch.Tensor  # [2·segments + 1] int32: each chunk's key prefix
    max_query: int  # the longest chunk
    max_key: int  # the longest prefix

    @classmethod
    def of(cls, bounds: list[int], size: int, rank: int) -> ContextSplit:
        held = zigzag_index(bounds, size, rank)
        unzigzag = unzigzag_index(bounds, size)
        chunks, prefixes = [], []
        for start, end in zip(bounds, bounds[1:]):
            c = (end - start) // (2 * size)
            for chunk in (rank, 2 * size - 1 - rank):
                chunks.append(c)
                prefixes.append(torch.arange(start, start + (chunk + 1) * c))
        keys = torch.cat(prefixes)
        return cls(size=size, rank=rank, held=held, unzigzag=unzigzag, key_source=unzigzag[keys],
                   query_bounds=_bounds(chunks), key_bounds=_bounds([p.numel() for p in prefixes]),
                   max_query=max(chunks), max_key=max(p.numel() for p in prefixes))

    def gather(self, values: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """``[t_local, …]`` values of this rank's positions → ``[t, …]`` of the whole row, in row
        order, on every rank. For what every CP rank computes alike from the whole row (the loss,
        returned log-probs): the backward keeps each rank's own gradient (no sum over ranks)."""
        return gather_rows(values, group, reduce_grad=False)[self.unzigzag]

    def to(self, device: torch.device) -> ContextSplit:
        return ContextSplit(**{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in vars(self).items()})


def _bounds(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
