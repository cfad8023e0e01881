"""Loss aggregation modes: how per-token losses become one scalar.

Each mode is a sum of per-token losses divided by denominators of the *whole* batch. When a batch
is split into micro-batches or over data-parallel ranks, pass the whole batch's token and sequence
counts (:class:`BatchTotals`) so that summing the parts reproduces the single-call value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class BatchTotals:
    """Denominators of the full batch: loss tokens, and sequences with at least one loss token."""

    tokens: float
    sequences: float

    @staticmethod
    def of(loss_mask: torch.Tensor) -> "BatchTotals":
        per_seq = loss_mask.sum(dim=-1)
        return BatchTotals(tokens=float(per_seq.sum()), sequences=float((per_seq > 0).sum()))


# (token_losses [B,T] already zero off the mask, mask as float [B,T], totals, norm_length) -> scalar
Aggregation = Callable[[torch.Tensor, torch.Tensor, BatchTotals, int], torch.Tensor]


def _token_mean(losses, mask, totals, norm_length):
    return losses.sum() / max(totals.tokens, 1.0)


def _token_sum(losses, mask, totals, norm_length):
    return losses.sum()


def _seq_mean_token_mean(losses, mask, totals, norm_length):
    per_seq = losses.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    return per_seq.sum() / max(totals.sequences, 1.0)


def _seq_mean_token_sum(losses, mask, totals, norm_length):
    return losses.sum() / max(totals.sequences, 1.0)


def _seq_mean_token_sum_norm(losses, mask, totals, norm_length):
    # Dr. GRPO: a constant length divisor, so long and short responses weigh tokens equally.
    return losses.sum() / (max(totals.sequences, 1.0) * norm_length)


AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": _token_mean,
    "token-sum": _token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
