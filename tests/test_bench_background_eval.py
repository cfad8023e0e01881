"""The background-evaluation benchmark's table: wall times per run and mode, ratios to inline, and
whether the evaluations of every run agree (the runs themselves: test_background_eval.py)."""

from bpo_megatron.bench.background_eval import Timing, format_table, overrides_for

EVALS = {0: {"eval/mean_avg@4": 0.25, "eval/add_correct_even": 8.0}, 2: {"eval/mean_avg@4": 0.5,
                                                                          "eval/add_correct_even": 16.0}}


def test_the_table_gives_each_run_the_means_and_the_ratio_to_inline():
    timings = [Timing("inline", 0, 100.0, 80.0, EVALS), Timing("background", 0, 90.0, 70.0, EVALS),
               Timing("inline", 1, 110.0, 90.0, EVALS), Timing("background", 1, 95.0, 75.0, EVALS)]
    table = format_table(timings, steps=2, every=2)
    assert "| 2 | background | 95.0 | 75.0 |" in table
    assert "| inline | 105.0 | 1.00× | 85.0 | 1.00× |" in table
    assert "| background | 92.5 | 0.88× | 72.5 | 0.85× |" in table
    assert "evaluations identical in every run: yes (mean Avg@k by step: 0: 0.250, 2: 0.500)" in table
    other = {**EVALS, 2: {**EVALS[2], "eval/add_correct_even": 15.0}}
    assert "identical in every run: NO" in format_table([*timings[:3], Timing("background", 1, 95.0, 75.0, other)],
                                                        steps=2, every=2)


def test_both_modes_run_the_same_schedule():
    inline, background = overrides_for("inline", 8, 2, 16), overrides_for("background", 8, 2, 16)
    assert [o for o in inline if not o.startswith("eval.mode")] == [o for o in background
                                                                    if not o.startswith("eval.mode")]
    assert "eval.every=2" in inline and "eval.k=16" in inline and "eval.mode=background" in background
