"""Group-relative advantages (paper eq. 2)."""

import math

import pytest
import torch

from bpo_megatron.algo import group_advantages


def test_matches_the_formula_per_group():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 1.0])
    adv, metrics = group_advantages(rewards, group_size=4)
    for g in range(3):
        r = rewards[4 * g : 4 * g + 4].tolist()
        mean = sum(r) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / 3)  # unbiased, as torch.std
        want = [0.0] * 4 if std == 0 else [(x - mean) / std for x in r]
        assert adv[4 * g : 4 * g + 4].tolist() == pytest.approx(want, abs=1e-6)
    assert metrics["zero_std_groups"] == 1.0
    assert metrics["zero_std_frac"] == pytest.approx(1 / 3)
    assert metrics["num_groups"] == 3.0
    assert metrics["reward_mean"] == pytest.approx(rewards.mean().item())


def test_zero_std_groups_are_exactly_zero_even_with_rounding():
    rewards = torch.tensor([0.1] * 16 + [0.3] * 16, dtype=torch.float64)
    adv, metrics = group_advantages(rewards, group_size=16)
    assert torch.equal(adv, torch.zeros(32, dtype=torch.float64))
    assert metrics["zero_std_groups"] == 2.0


def test_without_std_normalisation_only_the_mean_is_removed():
    adv, _ = group_advantages(torch.tensor([3.0, 1.0, 2.0, 2.0]), group_size=2, normalize_std=False)
    assert adv.tolist() == [1.0, -1.0, 0.0, 0.0]


def test_integer_rewards_give_float_advantages():
    adv, _ = group_advantages(torch.tensor([1, 0, 0, 0]), group_size=4)
    assert adv.dtype == torch.float32
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(
    "rewards, group_size, match",
    [
        (torch.ones(2, 2), 2, "rewards must be 1-D"),
        (torch.ones(6), 4, "not a positive multiple of group_size=4"),
        (torch.ones(4), 0, "group_size must be >= 1"),
        (torch.tensor([1.0, float("nan")]), 2, "non-finite"),
    ],
)
def test_bad_input(rewards, group_size, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size)
