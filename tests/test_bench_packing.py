"""The packing benchmark's own arithmetic: the length mix it claims and the useful fraction."""

from __future__ import annotations

import pytest

from bpo_megatron.bench.packing import Settings, paper_lengths, useful_fraction


def test_the_scaled_paper_mix_keeps_its_ranges_and_its_share_at_the_cap():
    settings = Settings(samples=4000, scale=1 / 32)
    pairs = paper_lengths(settings)
    prompts, responses = zip(*pairs)
    assert min(prompts) >= 2 and max(prompts) <= 10  # 50–300 / 32
    assert min(responses) >= 8 and max(responses) == 512  # 256–16384 / 32
    assert sum(r == 512 for r in responses) / len(responses) == pytest.approx(0.3, abs=0.03)
    assert settings.longest == 10 + 512 - 1 and settings.packed_budget == 2 * 522
    assert paper_lengths(settings) == pairs  # seeded


def test_every_rank_pays_the_largest_micro_batch_of_its_lockstep_group():
    # rank 0 runs micro-batches of 10 and 2 positions, rank 1 of 4 and 6: each pays 10 then 6
    assert useful_fraction([[10, 2], [4, 6]], useful=22) == pytest.approx(22 / ((10 + 6) * 2))
    # a rank with fewer micro-batches still waits for the others' (it pays nothing of its own)
    assert useful_fraction([[5, 5], [5]], useful=15) == pytest.approx(15 / 20)
    assert useful_fraction([[7, 7], [7, 7]], useful=28) == 1.0
