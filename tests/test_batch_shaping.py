"""DAPO batch shaping: dynamic sampling keeps the batch's size with varied groups first; the soft
overlong punishment follows its formula."""

from __future__ import annotations

import pytest
import torch

from bpo_megatron.loop.batch_shaping import dynamic_batch, overlong_penalty, punish_overlong, varied_groups
from bpo_megatron.rollout import Sample

G = 2


def _sample(tag: str, length: int = 3) -> Sample:
    return Sample(request_id=tag, index=0, prompt_tokens=torch.tensor([1, 2]), response_tokens=torch.arange(length),
                  rollout_logprobs=torch.zeros(length), finish_reason="stop")


class Draws:
    """Hands out the given groups' rewards round by round, as many groups as asked for."""

    def __init__(self, rewards: list[list[float]]) -> None:
        self.rewards, self.asked = list(rewards), []

    def __call__(self, count: int, round_: int):
        self.asked.append((count, round_))
        groups, self.rewards = self.rewards[:count], self.rewards[count:]
        samples = [_sample(f"r{round_}g{g}s{i}") for g in range(len(groups)) for i in range(G)]
        return samples, torch.tensor([r for group in groups for r in group])


def test_varied_groups():
    assert varied_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), G).tolist() == [False, True, False]


def test_dynamic_sampling_draws_until_the_batch_holds_only_varied_groups():
    draws = Draws([[1, 1], [0, 1], [0, 0], [1, 0],  # round 0: 4 asked, 2 varied
                   [1, 1], [1, 0],  # round 1: 2 asked, 1 varied
                   [0, 1]])  # round 2: 1 asked, varied
    samples, rewards, metrics = dynamic_batch(draws, groups_wanted=4, group_size=G, max_rounds=4)
    assert draws.asked == [(4, 0), (2, 1), (1, 2)]
    assert len(samples) == 8 and rewards.tolist() == [0, 1, 1, 0, 1, 0, 0, 1]
    assert [s.request_id for s in samples[::G]] == ["r0g1s0", "r0g3s0", "r1g1s0", "r2g0s0"]
    assert bool(varied_groups(rewards, G).all())
    assert metrics == {"dynamic/rounds": 3.0, "dynamic/drawn_groups": 7.0, "dynamic/kept_frac": 4 / 7,
                       "dynamic/filled_groups": 0.0}


def test_dynamic_sampling_is_bounded_and_fills_the_batch_with_dropped_groups():
    draws = Draws([[1, 1], [0, 1], [0, 0]] + [[1, 1]] * 2)
    samples, rewards, metrics = dynamic_batch(draws, groups_wanted=3, group_size=G, max_rounds=2)
    assert draws.asked == [(3, 0), (2, 1)]  # then the rounds are spent
    assert len(samples) == 6  # the batch keeps its size
    assert rewards.tolist() == [0, 1, 1, 1, 0, 0]  # the varied group, then dropped ones in order
    assert metrics["dynamic/filled_groups"] == 2.0 and metrics["dynamic/kept_frac"] == pytest.approx(1 / 5)


def test_overlong_penalty_is_zero_then_linear_to_minus_the_factor():
    lengths = torch.tensor([10, 80, 81, 90, 100])
    # L = 100, L_c = 20: free up to 80 tokens, then ((100 − 20) − |y|) / 20
    assert overlong_penalty(lengths, 100, 20, 1.0).tolist() == pytest.approx([0.0, 0.0, -0.05, -0.5, -1.0])
    assert overlong_penalty(lengths, 100, 20, 0.5).tolist() == pytest.approx([0.0, 0.0, -0.025, -0.25, -0.5])
    samples = [_sample("a", 10), _sample("b", 90)]
    shaped, metrics = punish_overlong(samples, torch.tensor([1.0, 1.0]), 100, 20, 1.0)
    assert shaped.tolist() == pytest.approx([1.0, 0.5])
    assert metrics == {"overlong/penalty_mean": pytest.approx(-0.25), "overlong/penalized_frac": 0.5}


def test_batch_shaping_settings_are_checked():
    from bpo_megatron.config import ConfigError
    from bpo_megatron.experiment import load_experiment

    demo = "configs/tiny_moe_cpu.yaml"
    with pytest.raises(ValueError, match="train.dynamic_sampling_max_rounds must be >= 1"):
        load_experiment(demo, ["train.dynamic_sampling_max_rounds=0"], check_model=False)
    with pytest.raises(ConfigError, match=r"train.overlong_buffer=.* must be below rollout.max_new_tokens"):
        load_experiment(demo, ["train.overlong_buffer=10000"], check_model=False)
