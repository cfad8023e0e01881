"""The vocabulary split over tensor-parallel ranks, shared by the chunked and the fused log-prob
ops: which columns of a shard are real tokens, and how each rank's per-row softmax statistics
combine into log-probs and entropies over the whole vocabulary (two small collectives of [rows]
vectors; the vocabulary itself is never gathered)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


def valid_columns(vocab_size: int | None, rank: int, vocab_shard: int) -> int:
    """How many leading columns of this rank's shard are real tokens. Padding can leave a rank
    none at all (128 tokens padded to 128·TP at TP=2): that rank then contributes nothing to the
    softmax, but still joins every collective."""
    if vocab_size is None:
        return vocab_shard
    return max(0, min(vocab_shard, vocab_size - rank * vocab_shard))


def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class Combined(NamedTuple):
    """Per-row results once every rank's shard is accounted for (fp32, ``[rows]``)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    lse: torch.Tensor  # log Σ_v exp(z_v) over the whole vocabulary
    scale: torch.Tensor  # exp(m − M): this rank's sums measured against the global max
    total_exp: torch.Tensor  # Σ_v exp(z_v − M) over the whole vocabulary


def combine_shards(local_max, sum_exp, target_logit, owned, exp_dot, group) -> Combined:
    """Combine one rank's row statistics with the other ranks' (every rank calls it at once).

    ``local_max`` m, ``sum_exp`` Σ exp(z − m) and ``exp_dot`` Σ exp(z − m)(z − m) (None: no
    entropy) over this rank's columns, ``target_logit`` z_y where ``owned`` says this rank holds
    the target. A MAX all-reduce gives the global max M, one SUM all-reduce the rest, rescaled by
    exp(m − M). A rank with no columns passes m = −inf and zero sums.
    """
    _, world = group_rank_size(group)
    global_max = local_max
    if world > 1:
        global_max = local_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    scale = torch.exp(local_max - global_max)
    parts = [sum_exp * scale, torch.where(owned, target_logit, 0.0)]
    if exp_dot is not None:
        shift = torch.where(sum_exp > 0, local_max - global_max, 0.0)  # 0, not −inf · 0, for no mass
        parts.append(scale * (exp_dot + shift * sum_exp))
    reduced = torch.stack(parts)
    if world > 1:
        dist.all_reduce(reduced, group=group)
    total_exp = reduced[0]
    log_total = torch.log(total_exp)
    lse = global_max + log_total
    entropy = None if exp_dot is None else log_total - reduced[2] / total_exp
    return Combined(reduced[1] - lse, entropy, lse, scale, total_exp)
