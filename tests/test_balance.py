"""Balancing packed work (single process): the cost model against a FLOP count by hand, the
equal-count rank shares and the micro-batch bins against brute-force optima on small instances,
the invariants every rank relies on (non-empty, within the budget, the same count everywhere,
results back in sample order), and a long-tailed length mix at the paper's scale, balanced against
the count split the padded path keeps."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from bpo_megatron.models import HFModelConfig
from bpo_megatron.trainer.balance import (
    CostModel,
    _spread,
    balanced_shares,
    data_parallel_shares,
    fewest_micro_batches,
    imbalance,
    in_sample_order,
    micro_batch_bins,
    packs_in_lockstep,
    split_to_count,
)
from bpo_megatron.trainer.samples import TrainSample, split
from bpo_megatron.testing import MODEL_CONFIGS

FIXTURES = MODEL_CONFIGS
QWEN3_30B_A3B = Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen3_30b_a3b"


def samples_of(positions: list[int]) -> list[TrainSample]:
    """Samples with these numbers of input positions (one prompt token, the rest response)."""
    return [TrainSample(tokens=torch.zeros(n + 1, dtype=torch.long), response_start=1,
                        rollout_logprobs=torch.full((n,), -1.0), advantage=1.0) for n in positions]


def graham(parts: int) -> float:
    """LPT's worst case over the optimum (Graham, 1969)."""
    return 4 / 3 - 1 / (3 * parts)


# ------------------------------------------------------------------------------ cost model
def test_the_cost_model_counts_matrix_products_and_causal_attention_by_hand():
    hf = HFModelConfig.load(FIXTURES / "tiny_qwen3_moe" / "config.json")
    # per layer: q 64×128 + k, v 64×64 each + o 128×64 = 24576, q/k norms 2×32, two RMSNorms 2×64,
    # router 4×64, two chosen experts 2 × 3×64×32 = 12288: 37312; two layers 74624, the output
    # layer 200×64 = 12800 and the final norm 64 (the input embedding is a lookup): 87488 weights.
    # Attention: heads × head_dim = 128 wide, 2 layers: span = 87488 / (2 · 128 · 2)
    cost = CostModel.of(hf)
    assert cost.attention_span == pytest.approx(87488 / 512, rel=1e-12)
    # Σ_{t=1..n} (1 + t / span): forward FLOPs 2 · 87488 · n + 4 · 128 · 2 · n(n+1)/2 over 2 · 87488
    for n in (1, 7, 100, 1000):
        flops = 2 * 87488 * n + 4 * 128 * 2 * n * (n + 1) / 2
        assert cost(n) == pytest.approx(flops / (2 * 87488), rel=1e-12)
    # the 30B-A3B model: attention overtakes the matrix products past ≈ 7.7k positions
    big = CostModel.of(HFModelConfig.load(QWEN3_30B_A3B / "config.json"))
    assert 7000 < big.attention_span < 8500
    assert big(16384) / 16384 == pytest.approx(1 + 16385 / (2 * big.attention_span))
    with pytest.raises(ValueError, match="attention_span must be a positive number"):
        CostModel(attention_span=0.0)


# ------------------------------------------------------------------------------ rank shares
def _best_split(costs: list[float], parts: int, *, equal_counts: bool) -> float:
    """The smallest largest-part total over every split of ``costs`` into ``parts`` (of equal
    count, or any): brute force, pruned by the best found so far."""
    size = len(costs) // parts if equal_counts else len(costs)
    best = math.inf

    def place(i: int, loads: list[float], counts: list[int]) -> None:
        nonlocal best
        if max(loads) >= best:
            return
        if i == len(costs):
            best = max(loads)
            return
        tried = set()
        for p in range(parts):
            if counts[p] < size and (loads[p], counts[p]) not in tried:  # alike parts: try one
                tried.add((loads[p], counts[p]))
                loads[p] += costs[i]
                counts[p] += 1
                place(i + 1, loads, counts)
                loads[p] -= costs[i]
                counts[p] -= 1

    place(0, [0.0] * parts, [0] * parts)
    return best


def test_rank_shares_on_known_instances():
    # a perfect split exists and is found: 34 in two shares of three, {8, 5, 4} and {7, 6, 4}
    costs = [4.0, 5.0, 6.0, 7.0, 8.0, 4.0]
    assert balanced_shares(costs, 2) == [[0, 1, 4], [2, 3, 5]]
    # pairs: the largest goes with the smallest, the best there is
    assert balanced_shares([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], 4) == [[0, 7], [1, 6], [2, 5], [3, 4]]
    # greedy's worst case for two shares, 7/6: the 8 and a 4 take 12 before the cap forces the
    # last 2 onto it (14); the best is {8, 2, 2} and {4, 4, 4}, 12 each
    costs = [8.0, 2.0, 4.0, 2.0, 4.0, 4.0]
    shares = balanced_shares(costs, 2)
    assert [sum(costs[i] for i in s) for s in shares] == [14.0, 10.0]
    assert _best_split(costs, 2, equal_counts=True) == 12.0 and 14.0 / 12.0 == pytest.approx(graham(2))


def test_rank_shares_are_within_grahams_bound_of_the_best_equal_split_by_brute_force():
    rng = random.Random(3)
    ratios = []
    for _ in range(400):
        parts = rng.choice([2, 3, 4])
        count = parts * rng.choice([2, 3])
        costs = [float(rng.choice([rng.randint(1, 10), rng.randint(1, 100)])) for _ in range(count)]
        shares = balanced_shares(costs, parts)
        got = max(sum(costs[i] for i in s) for s in shares)
        best = _best_split(costs, parts, equal_counts=True)
        assert got <= graham(parts) * best + 1e-9, (costs, parts, shares, got, best)
        ratios.append(got / best)
    optimal = sum(r == 1.0 for r in ratios) / len(ratios)
    print(f"\nequal-count LPT over brute-force optimum: worst {max(ratios):.4f}, optimal in {optimal:.0%} of 400")
    assert optimal > 0.5


def test_rank_shares_are_deterministic_equal_in_count_and_cover_every_sample():
    rng = random.Random(5)
    costs = [float(rng.randint(1, 50)) for _ in range(24)] + [7.0] * 8  # ties among the 7s
    shares = balanced_shares(costs, 8)
    assert shares == balanced_shares(list(costs), 8)
    assert all(len(s) == 4 and s == sorted(s) for s in shares)
    assert sorted(i for s in shares for i in s) == list(range(32))
    with pytest.raises(ValueError, match="cannot be shared equally by 3 parts"):
        balanced_shares(costs, 3)


def test_results_come_back_in_sample_order_through_the_inverse_map():
    samples = samples_of([5, 1, 9, 3, 3, 8, 2, 7])
    shares = data_parallel_shares(samples, 2, budget=16, cost=CostModel(attention_span=10.0))
    assert shares != split(list(range(8)), 2)  # not the count split: the map matters
    per_share = [[f"result of {i}" for i in share] for share in shares]  # as ranks return them
    assert in_sample_order(per_share, shares) == [f"result of {i}" for i in range(8)]


def test_without_the_budget_shares_are_the_contiguous_count_split_as_before():
    samples = samples_of([50, 1, 1, 1, 40, 2, 2, 2, 9, 9])
    assert data_parallel_shares(samples, 2, budget=0, cost=CostModel(attention_span=10.0)) == [
        [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


# ------------------------------------------------------------------------------ micro-batches
def test_micro_batch_bins_are_within_grahams_bound_when_the_budget_leaves_room():
    rng = random.Random(11)
    for _ in range(200):
        lengths = [rng.randint(1, 30) for _ in range(rng.randint(2, 7))]
        costs = [n + n * (n + 1) / 20 for n in lengths]
        count = rng.randint(1, len(lengths))
        bins = micro_batch_bins(lengths, costs, sum(lengths), count)
        got = max(sum(costs[i] for i in b) for b in bins)
        assert got <= graham(count) * _best_split(costs, count, equal_counts=False) + 1e-9, (lengths, count, bins)


def test_micro_batch_bins_fill_exactly_the_count_within_the_budget_costliest_first():
    rng = random.Random(13)
    for _ in range(500):
        budget = rng.randint(5, 40)
        lengths = [rng.randint(1, budget) for _ in range(rng.randint(1, 12))]
        costs = [n + n * n / 25 for n in lengths]
        fewest = fewest_micro_batches(lengths, costs, budget)
        assert -(-sum(lengths) // budget) <= fewest <= len(lengths)
        for count in range(fewest, len(lengths) + 1):  # every count a rank may be asked for serves
            bins = micro_batch_bins(lengths, costs, budget, count)
            assert len(bins) == count and all(bins), (lengths, budget, count, bins)
            assert all(sum(lengths[i] for i in b) <= budget for b in bins), (lengths, budget, count, bins)
            assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
            loads = [sum(costs[i] for i in b) for b in bins]
            assert loads == sorted(loads, reverse=True) and all(b == sorted(b) for b in bins)
    with pytest.raises(ValueError, match="cannot spread 2 samples over 3 micro-batches"):
        micro_batch_bins([1, 1], [1.0, 1.0], 10, 3)


def test_a_count_the_greedy_cannot_spread_is_reached_by_cutting_the_fewest_bins():
    # costs out of step with lengths (the cost model never is, and 200,000 random instances with
    # its costs found no such case; the guarantee must not rest on that): 2 bins of 11 positions
    # hold these, but 3 bins filled cheapest first leave the 9 no room
    lengths, costs, budget = [5, 4, 2, 1, 9, 1], [9.0, 3.0, 2.0, 6.0, 2.0, 7.0], 11
    assert fewest_micro_batches(lengths, costs, budget) == 2
    assert _spread(lengths, costs, 3, budget) is None
    bins = micro_batch_bins(lengths, costs, budget, 3)
    assert len(bins) == 3 and all(bins) and sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)
    # the cutting rule: the bin with the most positions, where its two parts are most even
    assert split_to_count([[0, 1, 2, 3], [4]], [3, 3, 3, 1, 5], 3) == [[0, 1], [2, 3], [4]]
    assert split_to_count([[0, 1, 2, 3], [4]], [3, 3, 3, 1, 5], 5) == [[0], [1], [2], [3], [4]]
    with pytest.raises(ValueError, match="cannot fill 6 micro-batches"):
        split_to_count([[0, 1, 2, 3], [4]], [3, 3, 3, 1, 5], 6)


def test_packs_on_one_rank_and_its_refusals():
    cost = CostModel(attention_span=100.0)
    bins = packs_in_lockstep(samples_of([6, 6, 6, 4]), 10, cost, group=None)
    assert len(bins) == 3 and sorted(i for b in bins for i in b) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"sample 1 has 11 input positions .*max_tokens_per_micro_batch=10"):
        packs_in_lockstep(samples_of([3, 11]), 10, cost, group=None)


# ------------------------------------------------------------------------------ at scale
def _long_tailed(count: int, cap: int, rng: random.Random) -> list[int]:
    """RL's response lengths: 30 % cut off at the cap, the rest log-uniform between 64 and it."""
    return [cap if rng.random() < 0.3 else int(math.exp(rng.uniform(math.log(64), math.log(cap))))
            for _ in range(count)]


@pytest.mark.parametrize("count,dp,budget", [(512, 8, 36864), (128, 8, 36864), (64, 4, 18432)])
def test_a_long_tailed_mix_is_balanced_where_the_count_split_is_not(count, dp, budget):
    # the paper's model and lengths: prompts ≤ 2048 and responses ≤ 16384 tokens, so at most 18431
    # input positions; minibatches of 512 over 8 data-parallel ranks, a budget of twice the cap
    cost = CostModel.of(HFModelConfig.load(QWEN3_30B_A3B / "config.json"))
    rng = random.Random(count + dp)
    worst, worst_count_split = 0.0, 0.0
    for _ in range(5):
        positions = _long_tailed(count, 18431, rng)
        samples = samples_of(positions)
        shares = data_parallel_shares(samples, dp, budget=budget, cost=cost)
        worst = max(worst, imbalance(samples, shares, cost))
        worst_count_split = max(worst_count_split, imbalance(samples, split(list(range(count)), dp), cost))
        # every rank reaches the same count, every micro-batch non-empty and within the budget
        fewest = [fewest_micro_batches([positions[i] for i in s], [cost(positions[i]) for i in s], budget)
                  for s in shares]
        lower_bound = max(-(-sum(positions[i] for i in s) // budget) for s in shares)
        for share in shares:
            bins = micro_batch_bins([positions[i] for i in share], [cost(positions[i]) for i in share], budget,
                                    max(fewest))
            assert len(bins) == max(fewest) and all(bins)
            assert all(sum(positions[share[i]] for i in b) <= budget for b in bins)
    print(f"\n{count} samples over {dp} ranks: max/mean rank cost {worst:.4f} balanced, "
          f"{worst_count_split:.4f} split by count; {max(fewest)} micro-batches a rank "
          f"(positions' lower bound {lower_bound})")
    assert worst <= 1.05 and worst_count_split > 1.2
