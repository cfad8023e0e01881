"""Balancing packed work over the data-parallel ranks and their micro-batches.

Under ``trainer.max_tokens_per_micro_batch`` the ranks of a step run in lockstep: DDP reduces the
gradients once every rank is done, pipeline stages pass micro-batch after micro-batch, and ranks
sharing an expert-parallel group meet in an all-to-all at every MoE layer of every micro-batch.
A step therefore takes as long as its costliest rank, and RL's response lengths are long-tailed:
splitting a minibatch by count (equal numbers of samples, as the padded path does) leaves some
ranks with several samples at the length cap while others wait. Here a minibatch is split by
estimated cost instead (:func:`data_parallel_shares`). Balancing over all data-parallel ranks
balances the ranks of each expert-parallel group too: they are a subset of them.

* Cost (:class:`CostModel`): a sample's matrix products grow with its n input positions, its
  causal attention with n²; the model's shape says where the second overtakes the first.
* Shares (:func:`balanced_shares`): every rank takes the same number of samples, and the
  largest rank cost is kept small by longest-processing-time-first (LPT). Equal counts make
  every rank non-empty and able to fill as many micro-batches as any other (see below) by
  construction. Karmarkar–Karp's largest differencing balances as well when counts are free
  (the same imbalance to four decimals on 30 %-at-the-cap length mixes), but it can leave a
  rank fewer samples than the others need micro-batches; its equal-count form (one item per
  part from each run of ``parts`` sorted items) balanced worse than LPT with a count cap (mean
  max/mean 1.057 against 1.032 over 20 draws of 64 samples on 8 ranks), and LPT is the simpler
  to read.
* Micro-batches (:func:`packs_in_lockstep`): each rank spreads its share over M bins of at most
  the budget's positions, costliest sample first into the cheapest bin with room, and every rank
  uses the same M: the largest of the ranks' fewest counts, agreed in one collective. That is
  the count a search over the whole minibatch finds too (the greedy serves no M below a rank's
  fewest, and every rank serves any M from its fewest up to its number of samples, see
  :func:`micro_batch_bins`), so the count is common by construction. Bins run costliest first,
  so the micro-batches the ranks run side by side are alike.

Everything is deterministic (ties broken by sample index) and computed from the samples alone:
the driver, which sends each rank its share, and every rank given the whole batch compute the
same shares, and map results back to sample order alike (:func:`in_sample_order`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from bpo_megatron import platform
from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.trainer.packing import BUDGET_SETTING, check_fits, input_positions
from bpo_megatron.trainer.samples import TrainSample, split
from bpo_megatron.weights.names import parameter_counts

T = TypeVar("T")


@dataclass(frozen=True)
class CostModel:
    """A sample's estimated compute, in units of one position's matrix products.

    Position t of a sample (counting from 1) attends to t positions: 4 · width · t FLOPs per
    layer (QKᵀ and AV), against 2 FLOPs per weight of the matrix products every position runs
    through. ``attention_span`` is the t at which the two are equal, so a sample of n input
    positions costs Σ (1 + t / span) = n + n (n + 1) / (2 · span). The backward pass scales both
    terms alike, so one model serves training steps and forward-only scoring. It counts FLOPs,
    not time (attention kernels and grouped expert GEMMs reach different shares of the peak),
    which is accurate enough to order and balance samples.
    """

    attention_span: float

    def __post_init__(self) -> None:
        if not (self.attention_span > 0 and math.isfinite(self.attention_span)):
            raise ValueError(f"attention_span must be a positive number, got {self.attention_span}")

    @classmethod
    def of(cls, hf: HFModelConfig) -> CostModel:
        """The span of ``hf``: its active weights used in matrix products per token (every
        layer's attention projections, the chosen experts, the output layer; not the input
        embedding, which is a lookup), over the attention's products per query-key pair · layers (the
        scores over the query/key head dims, the weighted values over the value head dims: 2 · attention
        width when they are equal; latent attention's differ)."""
        _, active = parameter_counts(hf)
        matmul = active - (0 if hf.tie_word_embeddings else hf.vocab_size * hf.hidden_size)
        per_pair = hf.num_attention_heads * (hf.query_key_head_dim + hf.value_head_dim)
        return cls(attention_span=matmul / (per_pair * hf.num_hidden_layers))

    def __call__(self, positions: int) -> float:
        return positions + positions * (positions + 1) / (2 * self.attention_span)


def balanced_shares(costs: list[float], parts: int) -> list[list[int]]:
    """Indices of ``costs`` in ``parts`` shares of ``len(costs) / parts`` each, the largest
    share's total kept small: longest processing time first, every item (costliest first) going
    to the cheapest share that still takes items. Without the count cap LPT is within
    (4/3 − 1/(3 · parts)) of the optimum (Graham, 1969); the tests check the capped form against
    the best equal-count split found by brute force. Ties go to the lower index; each share is
    in ascending order."""
    if parts < 1 or len(costs) % parts:
        raise ValueError(f"{len(costs)} items cannot be shared equally by {parts} parts")
    room = len(costs) // parts
    loads = [0.0] * parts
    shares: list[list[int]] = [[] for _ in range(parts)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        part = min((p for p in range(parts) if len(shares[p]) < room), key=lambda p: (loads[p], p))
        shares[part].append(index)
        loads[part] += costs[index]
    return [sorted(share) for share in shares]


def data_parallel_shares(samples: list[TrainSample], dp_size: int, *, budget: int, cost: CostModel, cp: int = 1
                         ) -> list[list[int]]:
    """Which samples (indices, ascending) each data-parallel rank takes. With a token ``budget``:
    equal counts balanced by ``cost`` (:func:`balanced_shares`); without (padded micro-batches):
    contiguous slices of nearly equal counts, as always. The driver and the actor's whole-batch
    calls both use this, so both put results back in sample order alike. Under context parallelism
    (``cp``) a sample costs each rank of its CP group its share of positions."""
    if not budget:
        return split(list(range(len(samples))), dp_size)
    return balanced_shares([cost(input_positions(s, cp)) for s in samples], dp_size)


def in_sample_order(per_share: list[list[T]], shares: list[list[int]]) -> list[T]:
    """Results given share by share (each in its share's order) back in sample order."""
    ordered: list = [None] * sum(map(len, shares))
    for share, results in zip(shares, per_share, strict=True):
        for index, result in zip(share, results, strict=True):
            ordered[index] = result
    return ordered


def imbalance(samples: list[TrainSample], shares: list[list[int]], cost: CostModel) -> float:
    """The costliest share's cost over the mean share's: 1.0 is perfect balance, and the step
    runs at about 1 / this of the speed a perfect split would give."""
    totals = [sum(cost(input_positions(samples[i])) for i in share) for share in shares]
    return max(totals) / (sum(totals) / len(totals))


# ------------------------------------------------------------------------------ micro-batches
def _spread(lengths: list[int], costs: list[float], count: int, budget: int) -> list[list[int]] | None:
    """``count`` bins of at most ``budget`` positions, every item (costliest first) in the
    cheapest bin it fits; None if one fits nowhere. With ``count`` ≤ items no bin stays empty:
    the first ``count`` items each open one (an empty bin is the cheapest and fits any item)."""
    loads = [0.0] * count
    room = [budget] * count
    bins: list[list[int]] = [[] for _ in range(count)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        fits = [b for b in range(count) if lengths[index] <= room[b]]
        if not fits:
            return None
        chosen = min(fits, key=lambda b: (loads[b], b))
        bins[chosen].append(index)
        loads[chosen] += costs[index]
        room[chosen] -= lengths[index]
    return bins


def fewest_micro_batches(lengths: list[int], costs: list[float], budget: int) -> int:
    """The fewest bins :func:`_spread` puts these items in: searched up from the positions'
    lower bound; one item a bin always fits (every item is within the budget)."""
    count = max(1, -(-sum(lengths) // budget))
    while _spread(lengths, costs, count, budget) is None:
        count += 1
    return count


def split_to_count(bins: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """``bins`` cut until there are ``count`` of them: the bin with the most positions among
    those holding two or more items is cut where its two parts are closest in positions (the
    parts keep the item order and take the bin's place). Cutting never breaks a budget the bins
    kept, so this reaches any count up to the number of items."""
    bins = [list(b) for b in bins]
    if count < len(bins):
        raise ValueError(f"cannot cut {len(bins)} bins into fewer ({count})")
    while len(bins) < count:
        splittable = [i for i, b in enumerate(bins) if len(b) > 1]
        if not splittable:
            raise ValueError(f"{sum(map(len, bins))} samples cannot fill {count} micro-batches")
        largest = max(splittable, key=lambda i: sum(lengths[j] for j in bins[i]))
        items = bins[largest]
        total, before, best, cut = sum(lengths[j] for j in items), 0, None, 1
        for k in range(1, len(items)):
            before += lengths[items[k - 1]]
            gap = abs(total - 2 * before)
            if best is None or gap < best:
                best, cut = gap, k
        bins[largest : largest + 1] = [items[:cut], items[cut:]]
    return bins


def micro_batch_bins(lengths: list[int], costs: list[float], budget: int, count: int) -> list[list[int]]:
    """Exactly ``count`` non-empty bins of at most ``budget`` positions (indices, ascending in
    each), costliest bin first. ``count`` lies between :func:`fewest_micro_batches` and the
    number of items: spread over ``count`` bins, or, should the greedy find no room there, the
    fewest bins cut (:func:`split_to_count`) until there are
    ``count``, which always succeeds, so any such count serves."""
    if not 1 <= count <= len(lengths):
        raise ValueError(f"cannot spread {len(lengths)} samples over {count} micro-batches")
    bins = _spread(lengths, costs, count, budget)
    if bins is None:
        fewest = fewest_micro_batches(lengths, costs, budget)
        if count < fewest:
            raise ValueError(f"{len(lengths)} samples need at least {fewest} micro-batches of {budget} positions")
        bins = split_to_count(_spread(lengths, costs, fewest, budget), lengths, count)
    bins = [sorted(b) for b in bins]
    return sorted(bins, key=lambda b: (-sum(costs[i] for i in b), b[0]))


def packs_in_lockstep(samples: list[TrainSample], budget: int, cost: CostModel, *,
                      group: dist.ProcessGroup | None, cp: int = 1) -> list[list[int]]:
    """This rank's ``samples`` (indices) in micro-batches of at most ``budget`` input positions,
    as many as on every rank of the data-parallel ``group`` (None: this rank alone): pipeline
    schedules, MoE all-to-alls and DDP's gradient reduction run micro-batch by micro-batch in
    lockstep. One collective agrees on the count (the largest of the ranks' fewest), on every
    sample fitting the budget and on every rank holding enough samples: a rank never refuses
    alone and leaves the others waiting. Under context parallelism (``cp``) a sample takes each
    rank of its CP group its share of positions (the ranks of a CP group hold the same samples and
    pack them alike)."""
    lengths = [input_positions(s, cp) for s in samples]
    costs = [cost(n) for n in lengths]
    fewest = fewest_micro_batches(lengths, costs, budget) if max(lengths) <= budget else 0
    # maxima over the ranks: the fewest micro-batches, the longest sample, and (negated) the fewest samples
    agreed = torch.tensor([fewest, max(lengths), -len(samples)], device=platform.device())
    if group is not None:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    count, longest, negated_least = agreed.tolist()  # one read of all three
    least = -negated_least
    if longest > budget:
        check_fits(samples, budget, cp)  # the rank holding the sample names it
        raise ValueError(f"a sample of {longest} input positions on another data-parallel rank exceeds "
                         f"{BUDGET_SETTING}={budget}: raise the budget to at least the longest sample")
    if count > least:
        # equal shares (data_parallel_shares) never get here: a share's fewest is at most its size
        raise ValueError(f"a data-parallel rank packed its share into {count} micro-batches but another holds only "
                         f"{least} samples: every rank must run as many micro-batches; give every rank as many "
                         f"samples (at least {count}) or raise {BUDGET_SETTING}")
    return micro_batch_bins(lengths, costs, budget, count)
