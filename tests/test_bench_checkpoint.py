"""The checkpoint benchmark: its table's arithmetic, and both modes run end to end on a tiny model
(the same training saved both ways holds the same bytes; the numbers are not timed here)."""

from __future__ import annotations

import pytest

from bpo_megatron.bench.checkpoint import MODES, Run, Settings, format_table, run_rounds

SHARDS = {"__0_0.distcp": "ab", "__0_1.distcp": "cd"}


def _run(mode: str, waits: list[float], wall: float, shards=SHARDS) -> Run:
    return Run(mode=mode, round=0, waits_s=waits, previous_s=0.0 if mode == "blocking" else 0.25, final_s=0.5,
               step_s=1.25, wall_s=wall, checkpoint_mib=12.0, shards=shards)


def test_the_table_gives_median_and_maximum_waits_and_the_ratios_to_blocking():
    runs = [_run("blocking", [2.0, 4.0, 3.0], 40.0), _run("background", [0.1, 0.5, 0.2], 30.0)]
    table = format_table(runs, Settings(steps=9, every=3))
    assert "| 1 | blocking | 3 | 3000 | 4000 | 0 | 500 | 1.25 | 40.0 |" in table
    assert "| 1 | background | 3 | 200 | 500 | 250 | 500 | 1.25 | 30.0 |" in table
    assert "| blocking | 3000 | 1.00× | 40.0 | 1.00× |" in table
    assert "| background | 200 | 0.07× | 30.0 | 0.75× |" in table
    assert "same bytes in every run: yes (2 shard files" in table
    differing = [runs[0], _run("background", [0.1], 30.0, shards={**SHARDS, "__0_1.distcp": "ef"})]
    assert "same bytes in every run: NO" in format_table(differing, Settings(steps=9, every=3))


@pytest.mark.ci  # both modes trained and saved (CI time): the table's arithmetic is above, a background save
# resuming as a blocking one in test_checkpoint_background
@pytest.mark.timeout(400)
def test_both_modes_save_the_same_checkpoints_on_a_tiny_model():
    settings = Settings(steps=2, every=1, ranks=2, rounds=1, hidden_size=64, layers=2, experts=4, vocab_size=256)
    runs = run_rounds(settings)
    assert [r.mode for r in runs] == list(MODES)
    for run in runs:
        assert len(run.waits_s) == 2 and min(run.waits_s) > 0 and run.wall_s > 0 and run.checkpoint_mib > 0
    assert runs[0].previous_s == 0.0 and runs[0].final_s < 1.0  # blocking: nothing left to finish
    assert runs[0].shards and runs[0].shards == runs[1].shards
    table = format_table(runs, settings)
    assert "| 1 | background | 2 |" in table and "same bytes in every run: yes" in table
