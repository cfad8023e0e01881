"""Context-parallel core attention for the local spec (CPU, or GPUs without transformer-engine,
whose ``TEDotProductAttention`` runs its own CP attention from the same packed-sequence
parameters).

Under context parallelism each rank holds two chunks of every packed sample
(:mod:`bpo_megatron.parallel.context`), but its queries attend to the whole sample up to their own
position. Keys and values are all-gathered over the CP group (differentiably: a rank's keys get
the gradient of every rank's queries), each chunk's key prefix is read from them, and
:func:`~bpo_megatron.models.varlen_attention.varlen_causal_attention` attends each chunk to its
prefix with the causal mask aligned at the prefix's end (FlashAttention on CUDA in half precision,
SDPA under a dense mask elsewhere). The packed-sequence parameters carry the split as
:class:`ContextParallelSeqParams`: Megatron's own fields hold the whole row's bounds (what RoPE
and transformer-engine read), the split what this attention reads.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from bpo_megatron.models.varlen_attention import varlen_causal_attention
from bpo_megatron.parallel.context import ContextSplit, context_parallel_group, gather_rows


@dataclass
class ContextParallelSeqParams(PackedSeqParams):
    """Megatron's ``thd`` parameters of a whole packed row, with this CP rank's split of it."""

    split: ContextSplit | None = None


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               params: PackedSeqParams, *, scale: float) -> torch.Tensor:
    """Queries ``[t_local, heads, d]`` of this rank's chunks attending to their samples' keys and
    values (``[t_local, groups, d]`` on each rank) up to their own positions; ``[t_local, 1, heads × d]``."""
    split = getattr(params, "split", None)
    if split is None:
        raise ValueError("context-parallel attention needs the packed row's split (ContextParallelSeqParams, built "
                         "by the trainer's packing); Megatron's plain PackedSeqParams do not say which positions "
                         "this rank holds")
    if query.shape[0] != split.held.shape[0]:
        raise ValueError(f"this CP rank holds {split.held.shape[0]} positions of the packed row, but attention "
                         f"got {query.shape[0]} queries")
    group = context_parallel_group()
    keys = gather_rows(key, group, reduce_grad=True)[split.key_source]
    values = gather_rows(value, group, reduce_grad=True)[split.key_source]
    out = varlen_causal_attention(query, keys, values, split.query_bounds, split.key_bounds, split.max_query,
                                  split.max_key, scale=scale)
    return out.reshape(out.shape[0], 1, -1)


def without_context_parallelism(config):
    """``config`` as Megatron's local ``DotProductAttention`` accepts it (it refuses CP > 1, which only TE's
    attention computes): a shallow copy at CP 1 for the module's own reading; this module's CP
    attention takes the split from the packed-sequence parameters instead."""
    if config.context_parallel_size == 1:
        return config
    local = copy.copy(config)
    local.context_parallel_size = 1
    return local


def refuse_unpacked(context_parallel_size: int) -> None:
    """A local core attention under context parallelism given a padded batch: CP splits packed
    rows only (the trainer packs whenever ``parallel.cp > 1``; this guards direct use)."""
    if context_parallel_size > 1:
        raise ValueError("context parallelism splits packed rows only: set trainer.max_tokens_per_micro_batch")
