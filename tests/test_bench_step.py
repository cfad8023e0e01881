"""The step benchmark runs the demo for a few steps and splits each step into parts that add up."""

import pytest

from bpo_megatron.bench.step import PARTS, format_table, measure


@pytest.mark.timeout(300)
def test_step_split_adds_up_and_the_driver_writes_each_batch_once(ray_session):
    split = measure(steps=3, overrides=("train.prompts_per_step=4", "rollout.group_size=4"))
    assert split.steps == 2
    assert all(split.seconds[part] >= 0 for part, _ in PARTS)
    assert sum(split.seconds.values()) == pytest.approx(split.step_s, rel=1e-9)
    # 16 samples of ≤ 4 + 16 tokens with routing: kilobytes, written once for both ranks
    assert 0 < split.to_trainer_mb < 0.5
    assert "| driver |" in format_table(split)
