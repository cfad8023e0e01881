"""compare's statistics, with numbers worked out by hand: Student t quantiles and p-values, the
paired t-interval, Holm's adjustment, the numbers a run reduces to (final-window, auc, peak,
held-out peak), and runs.csv, from which the tables are rebuilt exactly."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from bpo_megatron.cli import main
from bpo_megatron.commands.compare import evaluation_panels, summary
from bpo_megatron.commands.runs_csv import read_csv, run_rows, write_csv
from bpo_megatron.commands.statistics import (area_under_curve, final_window, gain, heldout_peak, holm, paired_t, peak,
                                              regularized_incomplete_beta, t_cdf, t_quantile, t_two_sided_p)
from bpo_megatron.observability.metrics import read_metrics

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_moe_cpu.yaml")


# ------------------------------------------------------------------------------ Student t
@pytest.mark.parametrize("probability, df, quantile", [
    (0.975, 4, 2.776445), (0.975, 9, 2.262157), (0.975, 1, 12.706205), (0.975, 2, 4.302653),
    (0.95, 5, 2.015048), (0.995, 4, 4.604095), (0.975, 30, 2.042272), (0.975, 10**7, 1.959964)])
def test_t_quantiles_match_the_tables(probability, df, quantile):
    assert t_quantile(probability, df) == pytest.approx(quantile, abs=1e-6)
    assert t_quantile(1 - probability, df) == pytest.approx(-quantile, abs=1e-6)


def test_t_distribution_matches_its_closed_forms():
    # one degree of freedom (Cauchy): P(|T| ≥ t) = 1 − 2·atan(t)/π; two: 1 − t/√(2 + t²)
    for t in (0.1, 1.0, 2.5, 30.0):
        assert t_two_sided_p(t, 1) == pytest.approx(1 - 2 * math.atan(t) / math.pi, rel=1e-12)
        assert t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-12)
        assert t_cdf(-t, 2) == pytest.approx((1 - t / math.sqrt(2 + t * t)) / 2, rel=1e-12)
    assert t_cdf(0.0, 7) == 0.5 and t_two_sided_p(0.0, 7) == 1.0
    # I_0.3(2, 3) = Σ_{j=2..4} C(4, j) 0.3^j 0.7^(4−j) = 0.2646 + 0.0756 + 0.0081
    assert regularized_incomplete_beta(0.3, 2, 3) == pytest.approx(0.3483, rel=1e-12)
    with pytest.raises(ValueError, match="must lie in"):
        t_quantile(1.0, 4)


# ------------------------------------------------------------------------------ contrasts
def test_paired_t_interval_of_a_hand_computed_case():
    # differences 1..5: mean 3, sd √2.5, standard error √0.5; t(0.975, 4) = 2.776445 -> ±1.963243;
    # t = 3/√0.5 = 4.2426 on 4 degrees of freedom
    d = paired_t([2, 4, 6, 8, 10], [1, 2, 3, 4, 5])
    assert (d.n, d.mean) == (5, 3.0)
    assert (d.low, d.high) == (pytest.approx(1.036757, abs=1e-6), pytest.approx(4.963243, abs=1e-6))
    assert d.p == pytest.approx(t_two_sided_p(3 / math.sqrt(0.5), 4)) and 0.013 < d.p < 0.014
    # ten pairs: t(0.975, 9) = 2.262157
    d = paired_t([float(i % 2) for i in range(10)], [0.0] * 10)  # mean 0.5, sd √(5/18)
    assert d.high - d.mean == pytest.approx(2.262157 * math.sqrt(5 / 18) / math.sqrt(10), abs=1e-6)


def test_paired_t_without_spread_or_with_one_pair():
    same = paired_t([0.3, 0.5, 0.7], [0.3, 0.5, 0.7])
    assert (same.mean, same.low, same.high, same.p) == (0.0, 0.0, 0.0, 1.0)
    one = paired_t([0.4], [0.3])
    assert one.n == 1 and one.mean == pytest.approx(0.1) and (one.low, one.high, one.p) == (None, None, None)
    with pytest.raises(ValueError, match="as many values"):
        paired_t([0.1, 0.2], [0.1])


def test_holm_adjustment_of_a_hand_computed_example():
    # sorted: 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 -> raised to 0.06 (monotone)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == [1.0, 1.0]  # capped at 1
    assert holm([0.02]) == [0.02] and holm([]) == []


# ------------------------------------------------------------------------------ one number per run
CURVE = [(0, 0.1), (20, 0.3), (40, 0.2), (60, 0.4)]


def test_final_window_auc_and_peak_of_a_curve():
    assert final_window(CURVE, 3) == pytest.approx(0.3)  # (0.3 + 0.2 + 0.4) / 3
    assert final_window(CURVE, 1) == 0.4
    with pytest.raises(ValueError, match="fewer than the window of 5"):
        final_window(CURVE, 5)
    # trapezoids: 20·0.2 + 20·0.25 + 20·0.3 = 15 over 60 steps
    assert area_under_curve(CURVE) == pytest.approx(0.25)
    assert area_under_curve([(0, 0.1), (10, 0.1), (40, 0.5)]) == pytest.approx((10 * 0.1 + 30 * 0.3) / 40)
    assert area_under_curve([(7, 0.6)]) == 0.6
    assert peak(CURVE) == 0.4
    assert gain(CURVE, 3) == pytest.approx(0.3 - 0.1) and gain(CURVE, 1) == pytest.approx(0.4 - 0.1)


def test_heldout_peak_selects_on_one_curve_and_reports_the_other():
    selection = [(0, 0.1), (20, 0.5), (40, 0.5), (60, 0.2)]
    report = [(0, 0.0), (20, 0.3), (40, 0.9), (60, 0.1)]
    assert heldout_peak(selection, report) == (20, 0.3)  # the earlier of the tied steps, whatever 40 reports


# ------------------------------------------------------------------------------ runs, runs.csv, tables
def _write_run(directory: Path, accuracy: list[tuple[int, int]], *, clip: float, datasets=("procedural:max",)):
    """A run of 6 RL steps evaluated at steps 0, 3 and 6 on 20 questions × 4 responses per dataset;
    ``accuracy``: (correct at even, correct at odd questions) of each evaluation, out of 40 each."""
    from bpo_megatron.observability.metrics import MetricsWriter

    writer = MetricsWriter(directory, tensorboard=False)
    writer.write(0, {"sft/nll": 1.0})  # the warm start's last step
    evaluations = dict(zip((0, 3, 6), accuracy))

    def eval_metrics(step: int) -> dict:
        even, odd = evaluations[step]
        out = {}
        for index, name in enumerate(datasets):
            out[f"eval/{name}_avg@4"] = (even + odd + index) / 80
            out[f"eval/{name}_correct_even"], out[f"eval/{name}_responses_even"] = even + index, 40
            out[f"eval/{name}_correct_odd"], out[f"eval/{name}_responses_odd"] = odd, 40
        out["eval/mean_avg@4"] = sum(out[f"eval/{n}_avg@4"] for n in datasets) / len(datasets)
        return out

    writer.write(0, eval_metrics(0))
    for step in range(1, 7):
        metrics = {"reward_mean": 0.1 * step, "clip_frac": clip * step, "abs_logp_diff_mean": 0.01}
        if step in evaluations:
            metrics.update(eval_metrics(step))
        writer.write(step, metrics)
    writer.close()


# (method, staleness, seed) -> (even, odd) correct at steps 0, 3, 6
RUNS = {
    ("bpo", 0, 1): [(4, 4), (8, 6), (10, 8)], ("bpo", 0, 2): [(4, 5), (9, 9), (8, 12)],
    ("grpo", 0, 1): [(4, 4), (6, 6), (9, 7)], ("grpo", 0, 2): [(4, 5), (7, 9), (8, 8)],
    ("bpo", 2, 1): [(4, 4), (7, 7), (9, 9)], ("bpo", 2, 2): [(4, 5), (10, 6), (8, 10)],
    ("grpo", 2, 1): [(4, 4), (5, 8), (6, 6)], ("grpo", 2, 2): [(4, 5), (9, 8), (7, 9)],
}


@pytest.fixture
def runs_dir(tmp_path):
    for (loss, k, seed), accuracy in RUNS.items():
        _write_run(tmp_path / f"{loss}-k{k}-s{seed}", accuracy, clip=0.01 if loss == "bpo" else 0.02)
    return tmp_path


def _compare(runs_dir: Path, *extra: str) -> int:
    return main(["compare", DEMO, "--losses", "bpo,grpo", "--staleness", "0,2", "--seeds", "1,2",
                 "--out", str(runs_dir), "--summarise-only", *extra])


def test_runs_csv_holds_a_row_per_run_and_evaluation_with_its_counts_and_training_metrics(runs_dir, capsys):
    assert _compare(runs_dir) == 0
    with (runs_dir / "runs.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 * 3  # 8 runs × 3 evaluations × 1 dataset
    first, second = rows[1], rows[2]  # BPO, k = 0, seed 1, at steps 3 and 6
    assert (first["run"], first["method"], first["method_id"], first["staleness"], first["seed"], first["step"]) == (
        "bpo-k0-s1", "BPO", "bpo", "0", "1", "3")
    assert (first["dataset"], first["eval_k"], first["correct"], first["total"]) == ("procedural:max", "4", "14", "80")
    halves = (first["even_correct"], first["even_total"], first["odd_correct"], first["odd_total"])
    assert halves == ("8", "40", "6", "40")
    assert float(first["accuracy"]) == 14 / 80 and first["recompute_old_logprobs"] == "false"
    # training metrics: means over the steps since the previous evaluation (1–3, then 4–6)
    assert first["trained_steps"] == "3" and float(first["clip_frac"]) == pytest.approx(0.02)
    assert second["trained_steps"] == "3" and float(second["clip_frac"]) == pytest.approx(0.05)
    assert rows[0]["trained_steps"] == "0" and rows[0]["clip_frac"] == "" and "sft/nll" not in rows[0]


def test_every_table_is_rebuilt_from_runs_csv_alone(runs_dir, tmp_path_factory, capsys):
    """runs → runs.csv → the tables equal the tables of the runs, for every statistic."""
    elsewhere = tmp_path_factory.mktemp("from_csv")
    for stat in ("final-window", "auc", "peak", "heldout-peak", "gain"):
        assert _compare(runs_dir, "--stat", stat, "--window", "2") == 0
        direct = (runs_dir / "results.md").read_text()
        assert main(["compare", "--summarise-only", "--from-csv", str(runs_dir / "runs.csv"), "--stat", stat,
                     "--window", "2", "--out", str(elsewhere)]) == 0
        assert (elsewhere / "results.md").read_text() == direct, stat
    # no runs.csv written where one was read; the curves drawn from the CSV's evaluations
    assert not (elsewhere / "runs.csv").exists() and (elsewhere / "curves.png").stat().st_size > 0


def test_tables_of_each_statistic_from_hand_computed_run_values(runs_dir, capsys):
    assert _compare(runs_dir, "--stat", "final-window", "--window", "2") == 0
    table = (runs_dir / "results.md").read_text()
    # BPO k=0: seed 1 (14 + 18)/2 = 16 of 80 = 20.0%, seed 2 (18 + 20)/2 = 19 -> 23.75%; mean 21.875, sd 2.652
    assert "final-window = the mean of each run's last 2 evaluations (steps 3, 6)" in table
    assert "| BPO | 2 | 21.9 ± 2.7 | reference | | | |" in table
    # GRPO k=0: (12 + 16)/2 = 14 -> 17.5%, (16 + 16)/2 = 16 -> 20%; differences -2.5, -3.75 points:
    # mean -3.125, sd 0.884, t(0.975, 1) = 12.706 -> ±7.94
    assert "| GRPO-ClipHigher | 2 | 18.8 ± 1.8 | -3.1 [-11.1, +4.8] | 2 |" in table

    assert _compare(runs_dir, "--stat", "heldout-peak") == 0
    table = (runs_dir / "results.md").read_text()
    assert ("heldout-peak = each run's accuracy on the questions at odd positions of procedural:max at the step of "
            "its best accuracy on those at even positions") in table
    # BPO k=2: seed 1 even best at step 6 (9) -> odd 9/40 = 22.5%; seed 2 even best at step 3 (10) -> 6/40 = 15%
    assert "| BPO | 2 | 18.8 ± 5.3 | reference |" in table

    assert _compare(runs_dir, "--stat", "auc") == 0
    table = (runs_dir / "results.md").read_text()
    # BPO k=0 seed 1: (3·(8 + 14)/2 + 3·(14 + 18)/2)/6 = 13.5 of 80; seed 2: (3·27/2 + 3·38/2)/6 = 16.25 -> 18.59%
    assert "| BPO | 2 | 18.6 ± 2.4 | reference |" in table


def test_holm_over_the_table_or_over_the_declared_primary_contrasts(runs_dir, capsys):
    assert _compare(runs_dir, "--stat", "peak") == 0
    rows = read_csv(runs_dir / "runs.csv")
    table = summary(rows, stat="peak")
    assert "Holm's method over the 2 contrasts of these tables" in table
    declared = summary(rows, stat="peak", primary="grpo@2")
    assert "over the 1 contrast declared primary (GRPO-ClipHigher at staleness 2)" in declared
    # the undeclared contrast (k = 0) keeps its p-value but has no adjusted one
    k0 = declared.split("### train.async.max_staleness = 0")[1].split("###")[0]
    assert k0.rstrip().splitlines()[-1].endswith("| — |")
    assert _compare(runs_dir, "--stat", "peak", "--primary", "grpo@1") == 2
    refusal = capsys.readouterr().err
    assert "--primary 'grpo@1' is not a contrast of this comparison; choose among grpo@0, grpo@2" in refusal
    assert _compare(runs_dir, "--primary", "bpo@0") == 2
    assert "bpo is the reference" in capsys.readouterr().err


def test_training_diagnostics_per_method_and_staleness(runs_dir, capsys):
    assert _compare(runs_dir) == 0
    table = (runs_dir / "results.md").read_text()
    # clip_frac of BPO's steps 1–6: 0.01·step, mean 0.035; GRPO's 0.07
    assert "| 0 | BPO | 0.01 | 0.035 |" in table and "| 2 | GRPO-ClipHigher | 0.01 | 0.07 |" in table


def test_compare_refusals_name_the_flag_and_the_fix(runs_dir, tmp_path_factory, capsys):
    assert _compare(runs_dir, "--window", "4") == 2
    assert "--window 4: run bpo-k0-s1 has 3 evaluations (steps 0, 3, 6); lower --window" in capsys.readouterr().err
    assert _compare(runs_dir, "--window", "0") == 2
    assert "--window 0 must be >= 1" in capsys.readouterr().err
    assert main(["compare", DEMO, "--from-csv", str(runs_dir / "runs.csv")]) == 2
    assert "--from-csv rebuilds the tables from the CSV alone: drop CONFIG" in capsys.readouterr().err
    assert main(["compare"]) == 2
    assert "name the experiment CONFIG (or rebuild the tables from a runs.csv with --from-csv PATH)" in (
        capsys.readouterr().err)
    bad = tmp_path_factory.mktemp("bad") / "runs.csv"
    bad.write_text("run,method\nx,y\n")
    assert main(["compare", "--from-csv", str(bad)]) == 2
    assert "is not a compare runs.csv: it lacks the columns method_id" in capsys.readouterr().err


def test_runs_that_would_evaluate_too_rarely_are_refused_before_any_starts(tmp_path, capsys):
    out = tmp_path / "compare"
    assert main(["compare", DEMO, "train.steps=4", "eval.every=2", "--losses", "bpo", "--seeds", "1",
                 "--out", str(out), "--window", "4"]) == 2
    assert ("--window 4: bpo-s1 will evaluate 3 times (eval.at_start=True, then every eval.every=2 of "
            "train.steps=4 steps); lower --window or evaluate more often") in capsys.readouterr().err
    assert main(["compare", DEMO, "eval.every=0", "--losses", "bpo", "--seeds", "1", "--out", str(out)]) == 2
    assert "bpo-s1: eval.every=0 never evaluates" in capsys.readouterr().err
    assert not out.exists()


def test_heldout_peak_with_two_datasets_selects_on_the_first(tmp_path):
    _write_run(tmp_path / "bpo-s1", [(4, 4), (9, 3), (6, 8)], clip=0.0, datasets=("a", "b"))
    rows = run_rows(read_metrics(tmp_path / "bpo-s1"), run="bpo-s1", method="BPO", method_id="bpo", staleness=None,
                    seed=1, recompute_old_logprobs=False)
    assert [(r.step, r.dataset) for r in rows] == [(0, "a"), (0, "b"), (3, "a"), (3, "b"), (6, "a"), (6, "b")]
    # a: (even + odd)/80 -> 8, 12, 14 (best at 6); b at step 6: (6 + 8 + 1)/80
    table = summary(rows, stat="heldout-peak")
    assert "mean accuracy on b at the step of its best accuracy on a" in table
    assert f"| BPO | 1 | {100 * 15 / 80:.1f} | reference | | | |" in table
    path = tmp_path / "runs.csv"
    write_csv(rows, path)
    assert read_csv(path) == rows


def test_conditions_of_separate_calls_are_summarised_together_with_primary_contrasts_across_them(
        runs_dir, tmp_path_factory, capsys):
    """Two compare calls with their own --condition (and overrides): one table per condition and
    staleness from the two runs.csv files, Holm over contrasts declared across them."""
    other = tmp_path_factory.mktemp("bf16")
    for (loss, k, seed), accuracy in RUNS.items():
        if k == 0:  # the bf16 condition's runs: GRPO's seed 2 one response better at every evaluation
            better = [(even + 1, odd) for even, odd in accuracy] if (loss, seed) == ("grpo", 2) else accuracy
            _write_run(other / f"{loss}-bf16-k0-s{seed}", better, clip=0.03)
    assert _compare(runs_dir, "--stat", "peak") == 0
    assert main(["compare", DEMO, "rollout.hf.dtype=bf16", "--condition", "bf16", "--losses", "bpo,grpo",
                 "--staleness", "0", "--seeds", "1,2", "--out", str(other), "--summarise-only", "--stat", "peak"]) == 0
    rows = read_csv(other / "runs.csv")
    assert {row.condition for row in rows} == {"bf16"} and {row.run for row in rows} >= {"grpo-bf16-k0-s2"}
    out = tmp_path_factory.mktemp("both")
    both = f"{runs_dir / 'runs.csv'},{other / 'runs.csv'}"
    assert main(["compare", "--from-csv", both, "--stat", "peak", "--primary", "grpo@2,grpo@bf16/0",
                 "--out", str(out)]) == 0
    table = (out / "results.md").read_text()
    assert ("over the 2 contrasts declared primary (GRPO-ClipHigher at staleness 2, GRPO-ClipHigher at condition "
            "bf16, staleness 0)") in table
    assert "### condition bf16, train.async.max_staleness = 0" in table
    # peaks (bf16): BPO 18/80 = 22.5% and 20/80 = 25%; GRPO 16/80 = 20% and, one better, 17/80 = 21.25%
    bf16 = table.split("### condition bf16")[1].split("Training diagnostics")[0]
    assert "| BPO | 2 | 23.8 ± 1.8 | reference |" in bf16
    assert "| GRPO-ClipHigher | 2 | 20.6 ± 0.9 | -3.1 [-11.1, +4.8] | 2 |" in bf16
    # a staleness-only table keeps its heading; the diagnostics name each setting
    assert "### train.async.max_staleness = 2" in table and "| bf16/0 | GRPO-ClipHigher | 0.01 | 0.105 |" in table
    # the curves come from the CSVs alone: a panel per setting, each seed's evaluations in points
    assert (out / "curves.png").stat().st_size > 0
    panels = evaluation_panels(read_csv(runs_dir / "runs.csv") + rows, rows[0].dataset)
    assert list(panels) == ["train.async.max_staleness = 0", "train.async.max_staleness = 2",
                            "condition bf16, train.async.max_staleness = 0"]
    # GRPO at bf16: seed 1 (4+4, 6+6, 9+7)/80, seed 2 one response better than RUNS: (5+5, 8+9, 9+8)/80
    grpo_bf16 = panels["condition bf16, train.async.max_staleness = 0"]["GRPO-ClipHigher"]
    assert grpo_bf16 == [{0: 10.0, 3: 15.0, 6: 20.0}, {0: 12.5, 3: 21.25, 6: 21.25}]
    assert main(["compare", "--from-csv", both, "--primary", "grpo@bf16", "--out", str(out)]) == 2
    assert "choose among grpo@0, grpo@2, grpo@bf16/0" in capsys.readouterr().err


def test_a_runs_csv_written_before_conditions_reads_as_no_condition(runs_dir, tmp_path):
    assert _compare(runs_dir) == 0
    with (runs_dir / "runs.csv").open() as f:
        records = list(csv.DictReader(f))
    old = tmp_path / "old.csv"
    with old.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[c for c in records[0] if c != "condition"])
        writer.writeheader()
        writer.writerows({k: v for k, v in r.items() if k != "condition"} for r in records)
    assert summary(read_csv(old)) == summary(read_csv(runs_dir / "runs.csv"))
    assert {row.condition for row in read_csv(old)} == {""}


def test_a_bad_condition_name_is_refused(runs_dir, capsys):
    assert _compare(runs_dir, "--condition", "bf16 r3") == 2
    assert "--condition 'bf16 r3': use letters, digits, '-' and '_'" in capsys.readouterr().err


TIER_B = Path(__file__).resolve().parents[1] / "experiments" / "tier_b" / "main"


def _final_windows(path: Path) -> dict[tuple[str, int], float]:
    """Each run's mean accuracy over its last 3 evaluations, read with the csv module alone."""
    evaluations: dict[tuple[str, int], dict[int, float]] = {}
    with path.open() as f:
        for record in csv.DictReader(f):
            evaluations.setdefault((record["method_id"], int(record["seed"])), {})[int(record["step"])] = \
                float(record["accuracy"])
    return {key: sum(at[s] for s in sorted(at)[-3:]) / 3 for key, at in evaluations.items()}


def test_between_two_settings_each_methods_change_and_its_difference_from_the_references(tmp_path):
    """``--between r3/0,r3/4`` on the committed Tier B runs: the cost of staleness per method and
    against BPO's, recomputed here from the CSVs by hand (t quantile of 9 degrees of freedom)."""
    k0, k4 = _final_windows(TIER_B / "runs_r3_k0.csv"), _final_windows(TIER_B / "runs_r3_k4.csv")
    seeds = range(1, 11)

    def change(method: str) -> list[float]:
        return [100 * (k4[(method, s)] - k0[(method, s)]) for s in seeds]

    def interval(deltas: list[float]) -> str:
        mean = sum(deltas) / len(deltas)
        sd = math.sqrt(sum((d - mean) ** 2 for d in deltas) / (len(deltas) - 1))
        half = 2.262157 * sd / math.sqrt(len(deltas))
        return f"{mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}] | {sd:.1f}"

    out = tmp_path / "between"
    csvs = ",".join(str(TIER_B / f"runs_{name}.csv") for name in ("r3_k4", "bf16_k0", "r3_k0"))
    assert main(["compare", "--from-csv", csvs, "--between", "r3/0,r3/4", "--out", str(out)]) == 0
    table = (out / "results.md").read_text().split("From r3/0 to r3/4")[1].split("Training diagnostics")[0]
    bpo = change("bpo")
    assert f"| BPO | 10 | {interval(bpo)} | reference |  |" in table
    for method, label in (("grpo", "GRPO-ClipHigher"), ("dppo_tv", "DPPO"), ("bpo_eps1e3", "BPO ε=1e3")):
        versus = [c - b for c, b in zip(change(method), bpo)]
        own, rest = interval(change(method)), interval(versus).split(" | ")[0]
        assert f"| {label} | 10 | {own} | {rest} |" in table
    assert "| BPO | 10 | -11.3 [-13.6, -9.0] | 3.2 |" in table  # what experiments/tier_b/README.md quotes
    assert "| GRPO-ClipHigher | 10 | -5.7 [-7.2, -4.2] | 2.1 | +5.6 [+2.9, +8.3] | 0.001 |" in table
    assert main(["compare", "--from-csv", csvs, "--between", "r3/0,r3/9", "--out", str(out)]) == 2


def test_the_committed_tier_m_tables_rebuild_from_their_csv(tmp_path):
    """experiments/tier_m/main/results.md is what the pre-registered command writes from the committed
    runs.csv alone, byte for byte."""
    tier_m = TIER_B.parents[1] / "tier_m" / "main"
    argv = ["compare", "--from-csv", str(tier_m / "runs.csv"), "--primary", "bpo@fp8/0,grpo_sc@fp8/0,bpo_sc@fp8/0",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    assert (tmp_path / "results.md").read_text() == (tier_m / "results.md").read_text()


@pytest.mark.parametrize("stat", ["final-window", "auc", "heldout-peak"])
def test_the_committed_tier_c_tables_rebuild_from_their_csvs(stat, tmp_path):
    """experiments/tier_c/tables/<stat>/results.md is what experiments/tier_c/tables.sh's command
    writes from the 20 committed CSVs alone, byte for byte."""
    tier_c = TIER_B.parents[1] / "tier_c"
    csvs = ",".join(str(tier_c / "main" / f"runs_s{seed}.csv") for seed in range(1, 21))
    assert main(["compare", "--from-csv", csvs, "--primary", "grpo@main", "--stat", stat, "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").read_text() == (tier_c / "tables" / stat / "results.md").read_text()


def test_the_committed_tier_c_cispo_table_rebuilds_from_its_csvs(tmp_path):
    """experiments/tier_c/tables/cispo/results.md (CISPO − BPO at lr 2e-4, exploratory) is what
    experiments/tier_c/tables.sh's command writes from the 40 primary and 20 CISPO CSVs, byte for byte."""
    tier_c = TIER_B.parents[1] / "tier_c"
    csvs = ",".join([str(tier_c / "main" / f"runs_s{seed}.csv") for seed in range(1, 21)]
                    + [str(tier_c / "main" / f"runs_cispo_s{seed}.csv") for seed in range(1, 21)])
    assert main(["compare", "--from-csv", csvs, "--primary", "grpo@main", "--stat", "final-window", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").read_text() == (tier_c / "tables" / "cispo" / "results.md").read_text()
