"""The asynchronous-throughput benchmark runs the demo at each staleness and tabulates it."""

import pytest

from bpo_megatron.bench.asynchronous import format_table, measure


@pytest.mark.slow  # CI time (≈ 50 s; a benchmark): run with -m slow
@pytest.mark.timeout(300)
def test_async_benchmark_measures_each_staleness(ray_session):
    small = ("train.prompts_per_step=4", "rollout.group_size=4")
    results = [measure(k, steps=3, overrides=small) for k in (0, 1)]
    assert [r.staleness for r in results] == [0, 1] and all(r.steps == 2 for r in results)
    for r in results:
        assert r.step_s > 0 and 16 <= r.tokens_per_step <= 16 * 4  # 16 responses of 1–4 tokens
        assert r.steps_per_minute == pytest.approx(60 / r.step_s)
    table = format_table(results)
    assert "| 0 |" in table and "| 1 |" in table and "1.00×" in table
