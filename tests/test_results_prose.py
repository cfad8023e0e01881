"""The numbers in the prose of experiments/tier_b/README.md, experiments/multi_turn/README.md,
experiments/tier_c/README.md and experiments/tier_m/README.md (and their rows of docs/results.md)
are the committed CSVs' numbers.

Each is recomputed here with the csv module and closed-form statistics (Student t quantiles from
tables), not by ``compare``, and the text must state it as written below: a sentence that drifts
from its CSV, or a CSV that changes under it, fails here.
"""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIER_B = ROOT / "experiments" / "tier_b"
MULTI_TURN = ROOT / "experiments" / "multi_turn"
TIER_M = ROOT / "experiments" / "tier_m"
RESULTS = (TIER_B / "README.md").read_text() + "\n" + (MULTI_TURN / "README.md").read_text()
T_975 = {1: 12.706205, 2: 4.302653, 3: 3.182446, 4: 2.776445, 5: 2.570582, 6: 2.446912, 7: 2.364624, 8: 2.306004,
         9: 2.262157, 10: 2.228139, 11: 2.200985, 12: 2.178813, 13: 2.160369, 14: 2.144787, 15: 2.131450,
         16: 2.119905, 17: 2.109816, 18: 2.100922, 19: 2.093024}  # two-sided 95% Student t quantiles by df


def _runs(path: Path) -> dict[tuple, list[dict]]:
    """A run's rows by (method, seed), or by (method, seed, staleness) where a file holds several."""
    with path.open() as f:
        records = list(csv.DictReader(f))
    several = len({r["staleness"] for r in records}) > 1
    runs: dict[tuple, list[dict]] = {}
    for r in records:
        key = (r["method_id"], int(r["seed"])) + ((r["staleness"],) if several else ())
        runs.setdefault(key, []).append(r)
    return runs


def _accuracy(rows: list[dict]) -> dict[int, float]:
    return {int(r["step"]): 100 * float(r["accuracy"]) for r in rows}


def final_window(rows: list[dict]) -> float:
    at = _accuracy(rows)
    return statistics.fmean(at[s] for s in sorted(at)[-3:])


def start(rows: list[dict]) -> float:
    at = _accuracy(rows)
    return at[min(at)]


def step_mean(rows: list[dict], metric: str) -> float:
    """A run's mean of a training metric over its RL steps (each evaluation row holds the mean
    over the steps since the previous one)."""
    pairs = [(int(r["trained_steps"]), float(r[metric])) for r in rows if r[metric] and int(r["trained_steps"] or 0)]
    return sum(n * x for n, x in pairs) / sum(n for n, _ in pairs)


def interval(deltas: list[float]) -> tuple[float, float, float, float]:
    """mean, SD, and the 95% t-interval's ends."""
    mean, sd = statistics.fmean(deltas), statistics.stdev(deltas)
    half = T_975[len(deltas) - 1] * sd / math.sqrt(len(deltas))
    return mean, sd, mean - half, mean + half


def signed(x: float) -> str:
    return f"{x:+.1f}".replace("-", "−")


CONDITIONS = {name: _runs(TIER_B / "main" / f"runs_{file}.csv")
              for name, file in (("r3/4", "r3_k4"), ("bf16/0", "bf16_k0"), ("r3/0", "r3_k0"))}
SEEDS = range(1, 11)


def versus_bpo(condition: str, method: str) -> tuple[float, float, float, float]:
    runs = CONDITIONS[condition]
    return interval([final_window(runs[(method, s)]) - final_window(runs[("bpo", s)]) for s in SEEDS])


def test_the_primary_verdicts_their_power_and_the_synchronous_contrast():
    for condition, method, verdict in (("r3/4", "grpo", "1"), ("bf16/0", "grpo", "2"), ("r3/4", "bpo_eps1e3", "3")):
        mean, _, low, high = versus_bpo(condition, method)
        assert f"({signed(mean)} points [{signed(low)}, {signed(high)}]" in RESULTS, (verdict, mean, low, high)
    widths = [versus_bpo(c, m) for c, m in (("r3/4", "grpo"), ("bf16/0", "grpo"), ("r3/4", "bpo_eps1e3"))]
    sds = ", ".join(f"{w[1]:.1f}" for w in widths)
    assert sds == "4.9, 2.4, 7.0"
    assert ("The SD of the paired differences was 4.9 points for contrast 1, 2.4 for\ncontrast 2 and 7.0 for "
            "contrast 3") in RESULTS
    halves = ", ".join(f"±{(w[3] - w[2]) / 2:.1f}" for w in widths)
    assert halves == "±3.5, ±1.7, ±5.0" and "±3.5, ±1.7 and ±5.0 points wide" in RESULTS
    mean, _, low, high = versus_bpo("r3/0", "grpo")
    assert f"GRPO-ClipHigher − BPO = {signed(mean)} points [{signed(low)}, {signed(high)}] (BPO −\nGRPO-ClipHigher = " \
           f"{signed(-mean)} [{signed(-high)}, {signed(-low)}])" in RESULTS
    # the paper's effect scaled to this task: the share of GRPO-ClipHigher's error BPO removes
    # (the paper's 4B ε-ablation, ε = 0.1: 25.4 vs 20.5; its 30B main table: 50.5 vs 39.5)
    shares = [(25.4 - 20.5) / (100 - 20.5), (50.5 - 39.5) / (100 - 39.5)]
    assert [f"{100 * x:.1f}%" for x in shares] == ["6.2%", "18.2%"]
    grpo_r3_0 = statistics.fmean(final_window(CONDITIONS["r3/0"][("grpo", s)]) for s in SEEDS)
    scaled = [x * (100 - grpo_r3_0) for x in shares]
    assert f"GRPO-ClipHigher's {grpo_r3_0:.1f}% here that is {signed(scaled[0])} to {signed(scaled[1])} points" \
        in RESULTS.replace("\n", " ")
    assert -low < scaled[0], "the interval's upper end for BPO must lie below the scaled effect to exclude it"


def test_starts_gains_and_the_exploratory_contrasts():
    starts = [start(r) for runs in CONDITIONS.values() for r in runs.values()]
    assert f"Every run starts at {min(starts):.1f}–{max(starts):.1f}% (step 0)" in RESULTS
    gains = {c: [final_window(r) - start(r) for r in runs.values()] for c, runs in CONDITIONS.items()}
    assert f"by {min(gains['r3/4']):.1f} points at the least" in RESULTS
    synchronous = min(min(gains["r3/0"]), min(gains["bf16/0"]))
    assert f"by {math.floor(10 * synchronous) / 10:.1f} points or more in the synchronous conditions" in RESULTS
    for condition in ("r3/0", "bf16/0"):
        mean = versus_bpo(condition, "bpo_eps1e3")[0]
        assert f"{-mean:.1f}" in {"6.6", "4.0"}
    assert "(exploratory) 6.6\n  at r3/0 and 4.0 at bf16/0" in RESULTS


def test_the_cost_of_staleness_per_method():
    k0, k4 = CONDITIONS["r3/0"], CONDITIONS["r3/4"]

    def cost(method: str) -> list[float]:
        return [final_window(k0[(method, s)]) - final_window(k4[(method, s)]) for s in SEEDS]

    costs = {m: statistics.fmean(cost(m)) for m in ("bpo", "grpo", "grpo_dualclip", "dppo_tv", "bpo_eps1e3")}
    text = RESULTS.replace("\n  ", " ")
    assert (f"costs BPO {costs['bpo']:.1f} points (per-seed SD {statistics.stdev(cost('bpo')):.1f}), "
            f"GRPO-ClipHigher {costs['grpo']:.1f}, dual-clip {costs['grpo_dualclip']:.1f}, DPPO "
            f"{costs['dppo_tv']:.1f} and BPO ε=1e3 {costs['bpo_eps1e3']:.1f}") in text
    mean, _, low, high = interval([b - g for b, g in zip(cost("bpo"), cost("grpo"))])
    assert f"exceeds GRPO-ClipHigher's by {mean:.1f} points [{signed(low)}, {signed(high)}]" in text


def _diagnostic(condition: str, method: str, metric: str) -> float:
    runs = CONDITIONS[condition]
    return statistics.fmean(step_mean(runs[(method, s)], metric) for s in SEEDS)


def test_the_diagnostics_quoted_in_the_prose():
    text = RESULTS.replace("\n  ", " ")
    drift = {m: _diagnostic("r3/4", m, "abs_logp_diff_mean") for m in ("bpo", "grpo", "grpo_dualclip", "dppo_tv")}
    others = [drift[m] for m in ("grpo", "grpo_dualclip", "dppo_tv")]
    ratios = [drift["bpo"] / x for x in others]
    assert (f"{min(ratios):.1f}–{max(ratios):.1f} times as far (|log π − log μ| {drift['bpo']:.2f} against "
            f"{min(others):.2f}–{max(others):.2f})") in text
    agreement = {m: 100 * _diagnostic("r3/4", m, "routing_agreement") for m in drift}
    rest = [agreement[m] for m in ("grpo", "grpo_dualclip", "dppo_tv")]
    assert f"({agreement['bpo']:.1f}% agreement against {min(rest):.1f}–{max(rest):.1f}%)" in text
    masked = {(m, sign): 100 * _diagnostic("r3/4", m, f"clip_frac_{sign}") for m in ("bpo", "grpo")
              for sign in ("pos", "neg")}
    assert (f"BPO masks {masked[('bpo', 'pos')]:.1f}% of the tokens with Â > 0 against GRPO-ClipHigher's "
            f"{masked[('grpo', 'pos')]:.1f}% (and {masked[('bpo', 'neg')]:.1f}% against "
            f"{masked[('grpo', 'neg')]:.1f}% with Â < 0") in text


def test_the_pilots_masked_shares():
    runs = _runs(TIER_B / "pilot" / "runs_r3.csv")
    at_k4 = {m: 100 * statistics.fmean(step_mean(rows, "clip_frac") for (method, _, staleness), rows in runs.items()
                                       if method == m and staleness == "4") for m in ("grpo", "bpo")}
    assert f"{at_k4['grpo']:.1f}% (GRPO) and {at_k4['bpo']:.1f}% (BPO)\n  of tokens are masked" in RESULTS


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_multi_turn_rows(seed):
    runs = _runs(MULTI_TURN / "runs.csv")
    rows = runs[("namecalculator", seed)]
    at = _accuracy(rows)
    window = final_window(rows)
    row = (f"| calculator, seed {seed} | {start(rows):.1f} | {', '.join(f'{at[s]:.1f}' for s in sorted(at)[-3:])} "
           f"| {window:.1f} | {signed(window - start(rows)).replace('−', '-')} |")
    assert row in RESULTS


def test_the_multi_turn_contrasts():
    runs = _runs(MULTI_TURN / "runs.csv")
    tool = [runs[("namecalculator", s)] for s in (1, 2, 3)]
    none = [runs[("namenull", s)] for s in (1, 2, 3)]
    gains = [final_window(r) - start(r) for r in tool]
    assert f"their mean, {signed(statistics.fmean(gains))} ± {statistics.stdev(gains):.1f}, exceeds" in RESULTS
    mean, _, low, high = interval([final_window(n) - final_window(t) for n, t in zip(none, tool)])
    assert f"{signed(mean)} points [95% t-interval {signed(low)}, {signed(high)}]" in RESULTS.replace("\n", " ")
    mean, _, low, high = interval([(final_window(n) - start(n)) - g for n, g in zip(none, gains)])
    assert f"is {signed(mean)} [{signed(low)}, {signed(high)}]" in RESULTS


def test_the_decomposition_of_the_tier_b_gap():
    bpo = CONDITIONS["r3/4"]
    parts = _runs(TIER_B / "followups" / "runs_decomposition_r3_k4.csv")
    for method, label in (("bpo_mask_r_weight", "BPO's mask, weight r (D1)"),
                          ("omega_weight_grpo_mask", "ω weight, GRPO's mask (D2)")):
        values = [final_window(parts[(method, s)]) for s in SEEDS]
        mean, _, low, high = interval([v - final_window(bpo[("bpo", s)]) for v, s in zip(values, SEEDS)])
        row = (f"| {label} | {statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f} | "
               f"{signed(mean).replace('−', '-')} [{signed(low).replace('−', '-')}, {signed(high).replace('−', '-')}] |")
        assert row in RESULTS, row
        assert low > 0  # the registered reading "both" needs both intervals above 0


def test_the_step_size_contrast():
    main = CONDITIONS["r3/4"]
    lr = _runs(TIER_B / "followups" / "runs_lr1e-4_k4.csv")
    cells = [f"{statistics.fmean(v):.1f} ± {statistics.stdev(v):.1f}"
             for v in ([final_window(lr[(m, s)]) for s in SEEDS] for m in ("bpo", "grpo"))]
    gap = [final_window(lr[("grpo", s)]) - final_window(lr[("bpo", s)]) for s in SEEDS]
    before = [final_window(main[("grpo", s)]) - final_window(main[("bpo", s)]) for s in SEEDS]
    mean, _, low, high = interval(gap)
    assert f"| lr 1e-4 | {cells[0]} | {cells[1]} | {signed(mean)} [{signed(low)}, {signed(high)}] |" in RESULTS
    mean, _, low, high = interval([a - b for a, b in zip(gap, before)])
    assert f"L = {signed(mean)} [{signed(low)}, {signed(high)}]" in RESULTS and high < 0  # "the step size matters"


# Tier M: four methods under the emulated FP8 engine, each against GRPO-CH + TIS (the reference)
TIER_M_RUNS = _runs(TIER_M / "main" / "runs.csv")
TIER_M_TEXT = (TIER_M / "README.md").read_text()
TIER_M_METHODS = (("bpo", "BPO"), ("grpo_sc", "GRPO-CH + SC"), ("bpo_sc", "BPO + SC"))


def _versus_tis(method: str, runs: dict[tuple, list[dict]] = TIER_M_RUNS, reference: str = "grpo_tis"):
    return [final_window(runs[(method, s)]) - final_window(runs[(reference, s)]) for s in SEEDS]


def test_the_tier_m_table_and_its_readings():
    values = {m: [final_window(TIER_M_RUNS[(m, s)]) for s in SEEDS] for m in ("grpo_tis", "bpo", "grpo_sc", "bpo_sc")}
    for seed in SEEDS:  # a seed's four runs share the step-0 evaluation
        assert len({start(TIER_M_RUNS[(m, seed)]) for m in values}) == 1
    starts = [start(rows) for rows in TIER_M_RUNS.values()]
    assert f"evaluation\n({min(starts):.1f}–{max(starts):.1f}% across seeds" in TIER_M_TEXT
    reference = values["grpo_tis"]
    assert f"| GRPO-CH + TIS | {statistics.fmean(reference):.1f} ± {statistics.stdev(reference):.1f} | reference |" \
        in TIER_M_TEXT
    sds = []
    for method, label in TIER_M_METHODS:
        deltas = _versus_tis(method)
        mean, sd, low, high = interval(deltas)
        sds.append(sd)
        row = (f"| {label} | {statistics.fmean(values[method]):.1f} ± {statistics.stdev(values[method]):.1f} | "
               f"{signed(mean)} [{signed(low)}, {signed(high)}] |")
        assert row in TIER_M_TEXT, row
        assert high < 0  # the reading "worse" needs the interval below 0 (the Holm p-values are compare's)
    behind = [sum(d < 0 for d in _versus_tis(m)) for m, _ in TIER_M_METHODS]
    assert behind == [8, 10, 10]
    assert "ends ahead of BPO (in 8 of 10 seeds),\nof GRPO-ClipHigher with score centering (in all 10)" in TIER_M_TEXT
    assert f"The observed paired SDs ({sds[0]:.1f}, {sds[1]:.1f} and {sds[2]:.1f} points)" in TIER_M_TEXT
    row = (ROOT / "docs" / "results.md").read_text()
    for method, label in TIER_M_METHODS:
        mean, _, low, high = interval(_versus_tis(method))
        assert f"{label} {signed(mean)} [{signed(low)}, {signed(high)}]" in row
    assert f"against GRPO-CH + TIS's {statistics.fmean(reference):.1f}%" in row


def test_the_tier_m_diagnostics_and_exploratory_contrasts():
    text = TIER_M_TEXT.replace("\n  ", " ")
    masked = {m: statistics.fmean(step_mean(TIER_M_RUNS[(m, s)], "clip_frac") for s in SEEDS)
              for m in ("grpo_tis", "grpo_sc", "bpo", "bpo_sc")}
    assert (f"GRPO-CH + TIS {masked['grpo_tis']:.3f}, GRPO-CH + SC {masked['grpo_sc']:.3f}, BPO {masked['bpo']:.3f}, "
            f"BPO + SC {masked['bpo_sc']:.3f}") in text
    assert masked["grpo_tis"] < masked["grpo_sc"] < masked["bpo"] < masked["bpo_sc"]
    mismatch = statistics.fmean(step_mean(TIER_M_RUNS[("grpo_tis", s)], "mismatch_abs_logp_diff_mean") for s in SEEDS)
    assert f"|log π_old − log μ| {mismatch:.3f} (measured by the GRPO-CH + TIS runs' recompute" in text
    for method, label in (("bpo_sc", "BPO + SC"), ("grpo_sc", "GRPO-CH + SC")):
        mean, _, low, high = interval(_versus_tis(method, reference="bpo"))
        assert f"{label} {'is ' if method == 'bpo_sc' else ''}{signed(mean)} [{signed(low)}, {signed(high)}]" in text


# Tier C: BPO against GRPO-ClipHigher on the scratchpad task, seeds 1-20 (one CSV per seed)
TIER_C = ROOT / "experiments" / "tier_c"


def _tier_c_runs() -> dict[tuple, list[dict]]:
    runs: dict[tuple, list[dict]] = {}
    for seed in range(1, 21):
        runs.update(_runs(TIER_C / "main" / f"runs_s{seed}.csv"))
    return runs


def test_the_tier_c_verdict_its_numbers_and_the_means_by_step():
    runs, seeds = _tier_c_runs(), range(1, 21)
    text = (TIER_C / "README.md").read_text()
    flat = " ".join(text.split())
    deltas = [final_window(runs[("bpo", s)]) - final_window(runs[("grpo", s)]) for s in seeds]
    mean, sd, low, high = interval(deltas)
    assert (f"Δ = BPO − GRPO-ClipHigher = {signed(mean)} points [{signed(low)}, {signed(high)}] (95% t-interval, "
            f"19 degrees of freedom; paired t-test p < 0.001), n = 20 pairs, achieved σ_d = {sd:.1f} points") in flat
    assert f"BPO ended ahead in {sum(d > 0 for d in deltas)} of the 20 seeds" in flat
    # the pre-registered reading: supports if low > 0, refutes the scaled effect if high < +2, else cannot tell
    reading = "supports" if low > 0 else "refutes the paper's effect scaled to this task" if high < 2 else "cannot tell"
    assert f"**Reading (pre-registered): *{reading}***" in text
    assert f"upper bound, {signed(high)}, is below +2 points" in flat
    for method, label in (("bpo", "BPO"), ("grpo", "GRPO-ClipHigher")):
        windows = [final_window(runs[(method, s)]) for s in seeds]
        by_step = ", ".join(f"{statistics.fmean(_accuracy(runs[(method, s)])[step] for s in seeds):.1f}"
                            for step in range(0, 121, 20))
        assert f"| {label} | {statistics.fmean(windows):.1f} ± {statistics.stdev(windows):.1f} | {by_step} |" in text
    starts = [start(rows) for rows in runs.values()]
    assert f"({min(starts):.1f}–{max(starts):.1f}% across seeds)" in flat
    row = (ROOT / "docs" / "results.md").read_text()
    assert f"BPO − GRPO-ClipHigher = {signed(mean)} points [{signed(low)}, {signed(high)}], n = 20, σ_d = {sd:.1f}" in row
    masked = {m: 100 * statistics.fmean(step_mean(runs[(m, s)], "clip_frac") for s in seeds) for m in ("bpo", "grpo")}
    assert f"BPO masked {masked['bpo']:.2f}% of the tokens and GRPO-ClipHigher {masked['grpo']:.2f}%" in flat


def _dropped(rows: list[dict]) -> bool:
    """The pilot rule's stability test fails: a drop of more than 5 points between consecutive evaluations."""
    curve = [a for _, a in sorted(_accuracy(rows).items())]
    return max(a - b for a, b in zip(curve, curve[1:])) > 5.0


def _lr_followup_table(capsys) -> tuple[str, list[int]]:
    """The follow-up's table as its script prints it, and the seeds it pairs (those with both
    methods at both rates)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lr_followup", TIER_C / "lr_followup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    table = capsys.readouterr().out
    seeds = [s for s in range(1, 21) if (TIER_C / "lr1e-4" / f"runs_s{s}.csv").exists()]
    return table, seeds


def test_the_lr_followup_table_is_the_hand_computation(capsys):
    """experiments/tier_c/lr_followup.py against the same statistics computed here from the CSVs:
    Δ₁ at 1e-4, the interaction with the primary runs' Δ₂, each method's change, the drops."""
    table, seeds = _lr_followup_table(capsys)
    if len(seeds) < 2:
        pytest.skip("fewer than two lr-1e-4 seeds committed")
    low_rate, high_rate = {}, _tier_c_runs()
    for seed in seeds:
        low_rate.update(_runs(TIER_C / "lr1e-4" / f"runs_s{seed}.csv"))
    assert f"Pairs: {len(seeds)} seeds with both methods at both rates" in table
    fw = {(rate, m, s): final_window(runs[(m, s)]) for rate, runs in (("1", low_rate), ("2", high_rate))
          for m in ("bpo", "grpo") for s in seeds}
    delta_1 = [fw["1", "bpo", s] - fw["1", "grpo", s] for s in seeds]
    delta_2 = [fw["2", "bpo", s] - fw["2", "grpo", s] for s in seeds]
    for label, values in (("Δ₁ = BPO − GRPO-ClipHigher at 1e-4", delta_1),
                          ("I = Δ₁ − Δ₂ (Δ₂: the same at 2e-4)", [a - b for a, b in zip(delta_1, delta_2)])):
        mean, sd = statistics.fmean(values), statistics.stdev(values)
        row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
        assert row.startswith(f"| {label} | {signed(mean)} | ") and f"| {sd:.1f} |" in row
        half = T_975[len(values) - 1] * sd / math.sqrt(len(values))
        assert f"| [{signed(mean - half)}, {signed(mean + half)}] |" in row
        if len(seeds) == 20:  # t(0.9875, 19): the 97.5% interval of the registered family
            half = 2.433440 * sd / math.sqrt(20)
            assert f"[{signed(mean - half)}, {signed(mean + half)}] | {sd:.1f} |" in row
    for method, name in (("bpo", "BPO"), ("grpo", "GRPO-ClipHigher")):
        change = statistics.fmean(fw["1", method, s] - fw["2", method, s] for s in seeds)
        assert f"| {name} | {signed(change)} | [" in table
        for rate, runs, key in (("1e-4", low_rate, "1"), ("2e-4", high_rate, "2")):
            drops = sum(_dropped(runs[(method, s)]) for s in seeds)
            values = [fw[key, method, s] for s in seeds]
            assert (f"| {name} | {rate} | {len(seeds)} | {statistics.fmean(values):.1f} ± "
                    f"{statistics.stdev(values):.1f} | {drops} of {len(seeds)} |") in table


def test_the_tier_b_learning_rate_pilots_accuracy():
    """Tier B's pilot (seed 101): the final windows at 3e-4 and 2e-4 and BPO's drop at 3e-4."""
    flat = " ".join((TIER_B / "README.md").read_text().split())
    pilot = {lr: _runs(TIER_B / "pilot" / f"runs_lr{lr}.csv") for lr in ("0.0002", "0.0003")}
    fw = {(lr, m): final_window(runs[(m, 101)]) for lr, runs in pilot.items() for m in ("bpo", "grpo")}
    curve = [a for _, a in sorted(_accuracy(pilot["0.0003"][("bpo", 101)]).items())]
    assert (f"BPO reached {fw['0.0003', 'bpo']:.1f}% at 3e-4 — falling {curve[-2] - curve[-1]:.1f} points between "
            f"steps 30 and 40 — against GRPO-ClipHigher's {fw['0.0003', 'grpo']:.1f}%, and "
            f"{fw['0.0002', 'bpo']:.1f}% against {fw['0.0002', 'grpo']:.1f}% at 2e-4") in flat


def test_the_fp8_engines_effect_on_bpo_across_experiments():
    """Tier M's BPO (FP8 engine) against Tier B's r3/0 BPO (fp32 engine; the same config, base,
    task and seeds), paired by seed: in Tier M's prose and its row of docs/results.md."""
    mean, _, low, high = interval([final_window(TIER_M_RUNS[("bpo", s)]) - final_window(CONDITIONS["r3/0"][("bpo", s)])
                                   for s in SEEDS])
    text = " ".join(TIER_M_TEXT.split())
    assert f"the FP8 engine moved BPO's final window by {signed(mean)} points [{signed(low)}, {signed(high)}]" in text
    row = (ROOT / "docs" / "results.md").read_text()
    assert f"the FP8 engine moved BPO by {signed(mean)} [{signed(low)}, {signed(high)}] against Tier B's fp32" in row


def test_the_tier_c_conditions_instability_and_masked_shares():
    """Tier C's verdict is stated at its learning rate with the runs that fail the pilot rule's
    stability test, the step-20 gap, the stable runs' gap and the μ-bin masked shares."""
    runs, seeds = _tier_c_runs(), range(1, 21)
    flat = " ".join((TIER_C / "README.md").read_text().split())
    row = (ROOT / "docs" / "results.md").read_text()

    drops = {m: sum(_dropped(runs[(m, s)]) for s in seeds) for m in ("bpo", "grpo")}
    assert (f"{drops['bpo']} of the 20 BPO runs and {drops['grpo']} of the 20 GRPO-ClipHigher runs fail at 2e-4"
            in flat)
    assert f"unstable for BPO in {drops['bpo']} of 20 runs" in flat
    assert (f"{drops['bpo']} of its 20 runs ({drops['grpo']} of 20 "
            f"GRPO-ClipHigher runs) dropped more than 5 points" in row and "20 seeds, lr 2e-4" in row
            and "at lr 2e-4, *refutes the paper's effect scaled to this task*" in row)
    mean, _, low, high = interval([_accuracy(runs[("bpo", s)])[20] - _accuracy(runs[("grpo", s)])[20] for s in seeds])
    assert f"BPO was already behind at step 20, {signed(mean)} points [{signed(low)}, {signed(high)}]" in flat
    stable = [s for s in seeds if not _dropped(runs[("bpo", s)])]
    gap = statistics.fmean(final_window(runs[("grpo", s)]) - final_window(runs[("bpo", s)]) for s in stable)
    assert f"the {len(stable)} BPO runs without a drop ended {gap:.1f} points behind" in flat
    share = {(m, k): 100 * statistics.fmean(step_mean(runs[(m, s)], k) for s in seeds)
             for m in ("bpo", "grpo") for k in ("clip_frac_pos_mu_mid", "clip_frac_neg_mu_low")}
    assert (f"BPO masks {share['bpo', 'clip_frac_pos_mu_mid']:.1f}% of the positive-advantage tokens with 0.2 ≤ μ < 0.9 "
            f"against GRPO-ClipHigher's {share['grpo', 'clip_frac_pos_mu_mid']:.1f}%, and "
            f"{share['bpo', 'clip_frac_neg_mu_low']:.1f}% of the negative-advantage tokens with μ < 0.2 against "
            f"{share['grpo', 'clip_frac_neg_mu_low']:.1f}%") in flat


def _auc(rows: list[dict]) -> float:
    """The area under the accuracy-by-step curve (trapezoids) over the steps it spans."""
    points = sorted(_accuracy(rows).items())
    area = sum((s1 - s0) * (a0 + a1) / 2 for (s0, a0), (s1, a1) in zip(points, points[1:]))
    return area / (points[-1][0] - points[0][0])


def _heldout_peak(rows: list[dict]) -> float:
    """The accuracy on the odd-position questions at the step of the best even-position accuracy
    (the earlier step on ties)."""
    half = {int(r["step"]): (int(r["even_correct"]) / int(r["even_total"]), int(r["odd_correct"]) / int(r["odd_total"]))
            for r in rows}
    best = max(even for even, _ in half.values())
    return 100 * half[min(step for step, (even, _) in half.items() if even == best)][1]


def test_the_secondary_statistics_of_tier_c_and_tier_m():
    """Tier C's AUC and held-out-peak contrasts and Tier M's AUC differences and centering ρ, each
    recomputed from the CSVs."""
    runs, seeds = _tier_c_runs(), range(1, 21)
    flat = " ".join((TIER_C / "README.md").read_text().split())
    auc = interval([_auc(runs[("bpo", s)]) - _auc(runs[("grpo", s)]) for s in seeds])
    peak = interval([_heldout_peak(runs[("bpo", s)]) - _heldout_peak(runs[("grpo", s)]) for s in seeds])
    assert (f"in AUC Δ = {signed(auc[0])} [{signed(auc[2])}, {signed(auc[3])}]; in held-out peak Δ = "
            f"{signed(peak[0])} [{signed(peak[2])}, {signed(peak[3])}]") in flat
    text = " ".join(TIER_M_TEXT.split())
    differences = []
    for method, _ in TIER_M_METHODS:
        mean, _, low, high = interval([_auc(TIER_M_RUNS[(method, s)]) - _auc(TIER_M_RUNS[("grpo_tis", s)]) for s in SEEDS])
        assert high < 0, method
        differences.append(signed(mean))
    assert (f"the three differences from GRPO-CH + TIS are {differences[0]}, {differences[1]} and {differences[2]} "
            "points, each interval below zero") in text
    rho = {m: statistics.fmean(step_mean(TIER_M_RUNS[(m, s)], "score_centering_rho") for s in SEEDS)
           for m in ("grpo_sc", "bpo_sc")}
    assert f"({rho['grpo_sc']:.3f} with GRPO-CH, {rho['bpo_sc']:.3f} with BPO)" in text


def test_where_the_tier_c_base_first_goes_wrong():
    """The "Why" section's shares of the base's wrong responses by first departure are those of
    experiments/tier_c/base/first_error.md (recomputed from its counts), whose evaluation is the one
    the seed-1 runs recorded at step 0 (their CSV's correct and total responses)."""
    table = (TIER_C / "base" / "first_error.md").read_text()
    counts = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[1].isdigit():
            counts[cells[0]] = int(cells[1])
    wrong = counts.pop("all wrong")
    assert sum(counts.values()) == wrong
    share = {kind: f"{100 * n / wrong:.1f}%" for kind, n in counts.items()}
    for kind, n in counts.items():
        assert f"| {kind} | {n} | {share[kind]} |" in table
    step0 = next(r for r in _tier_c_runs()[("bpo", 1)] if r["step"] == "0")
    right, total = int(step0["correct"]), int(step0["total"])
    assert f"Avg@4 = {100 * right / total:.1f}% ({right} of {total} responses right" in table
    assert f"{total - right} of {total} responses scored wrong" in table
    flat = " ".join((TIER_C / "README.md").read_text().split())
    assert (f"(seed 1's: {total - right} of {total:,}, Avg@4 {100 * right / total:.1f}%), {share['operand digit']} "
            f"first depart from the correct scratchpad at a copied operand digit, {share['missing/extra column']} at "
            f"a missing or extra column, {share['column sum digit']} at a column's sum digit, "
            f"{share['final answer']} in the final answer after a correct scratchpad, {share['carry digit']} at a "
            f"carry digit and {share['structural']} at another `+`, `=`, `c` or `;`") in flat
    assert counts["carry-in"] == counts["truncated before departing"] == 0  # the classes the sentence leaves out


def _followup_sc_table(capsys, monkeypatch, tmp_path) -> tuple[str, Path]:
    """Tier M's follow-up table as its script prints it, from the committed follow-up CSV or, until
    it is committed, from one made of the main runs' rows (GRPO-CH + TIS as re-run unchanged, the
    centering arms as before, GRPO-CH as GRPO-CH + TIS shifted by a seed-dependent amount)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("followup_table", TIER_M / "followup_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    followup = module.FOLLOWUP
    if not followup.exists():
        with (TIER_M / "main" / "runs.csv").open(newline="") as f:
            reader = csv.DictReader(f)
            rows = [r for r in reader if r["method_id"] != "bpo"]
            fields = reader.fieldnames
        shifted = [dict(r, method_id="grpo", method="GRPO-ClipHigher",
                        accuracy=str(float(r["accuracy"]) + (0.001 * (int(r["seed"]) % 4) if int(r["step"]) else 0.0)))
                   for r in rows if r["method_id"] == "grpo_tis"]
        followup = tmp_path / "runs.csv"
        with followup.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows + shifted)
        monkeypatch.setattr(module, "FOLLOWUP", followup)
    module.main()
    return capsys.readouterr().out, followup


def test_the_tier_m_followup_table_is_the_hand_computation(capsys, monkeypatch, tmp_path):
    """experiments/tier_m/followup_table.py against the registered statistics computed here: the two
    primary contrasts (95% t-intervals, Holm over the two), the re-run check, a secondary."""
    table, followup = _followup_sc_table(capsys, monkeypatch, tmp_path)
    new, main = _runs(followup), _runs(TIER_M / "main" / "runs.csv")

    def window(rows):
        return statistics.fmean(100 * float(r["accuracy"]) for r in rows if int(r["step"]) in (20, 30, 40))

    p_values, rows = [], []
    for label, arm, arm_runs, reference, reference_runs in (
            ("GRPO-CH + SC − GRPO-CH", "grpo_sc", new, "grpo", new),
            ("BPO + SC − BPO", "bpo_sc", new, "bpo", main)):
        seeds = sorted(s for m, s in arm_runs if m == arm and (reference, s) in reference_runs)
        deltas = [window(arm_runs[arm, s]) - window(reference_runs[reference, s]) for s in seeds]
        mean, sd = statistics.fmean(deltas), statistics.stdev(deltas)
        half = T_975[len(deltas) - 1] * sd / math.sqrt(len(deltas))
        row = next(line for line in table.splitlines() if line.startswith(f"| {label} | {len(seeds)} |"))
        assert f"| {signed(mean)} | [{signed(mean - half)}, {signed(mean + half)}] |" in row
        t = abs(mean) / (sd / math.sqrt(len(deltas)))
        p_values.append(t)
        rows.append(row)
    # Holm over two: the smaller p is doubled; a contrast reads "no difference detected" unless its
    # adjusted p is below 0.05, which for 9 df needs |t| above t(0.9875, 9) = 2.685 (the larger |t|)
    # and above t(0.975, 9) = 2.262 for the other once the first is rejected
    strongest = max(range(2), key=lambda i: p_values[i])
    for i, row in enumerate(rows):
        bound = 2.685011 if i == strongest else (2.262157 if p_values[strongest] > 2.685011 else math.inf)
        assert ("no difference detected" in row) == (p_values[i] <= bound), row
    rerun = sorted(s for m, s in new if m == "grpo_tis")
    same = [s for s in rerun if [r["accuracy"] for r in new["grpo_tis", s]] == [r["accuracy"] for r in main["grpo_tis", s]]]
    assert f"equal the committed ones for {len(same)} of {len(rerun)} seeds" in table
    seeds = sorted(s for m, s in new if m == "grpo" and ("grpo_tis", s) in new)
    anchor = statistics.fmean(window(new["grpo", s]) - window(new["grpo_tis", s]) for s in seeds)
    assert f"| GRPO-CH − GRPO-CH + TIS (the anchor alone) | {len(seeds)} | {signed(anchor)} |" in table
    rerun_csv = TIER_M / "followup_bpo" / "runs.csv"
    if rerun_csv.exists():  # BPO re-run at the follow-up's commit, added after the check failed
        bpo = _runs(rerun_csv)
        for label, arm, arm_runs, reference_runs in (("(2′) BPO + SC − BPO (re-run)", "bpo_sc", new, bpo),
                                                     ("BPO, re-run − committed", "bpo", bpo, main)):
            seeds = sorted(s for m, s in arm_runs if m == arm and ("bpo", s) in reference_runs)
            deltas = [window(arm_runs[arm, s]) - window(reference_runs["bpo", s]) for s in seeds]
            mean, sd = statistics.fmean(deltas), statistics.stdev(deltas)
            half = T_975[len(deltas) - 1] * sd / math.sqrt(len(deltas))
            assert (f"| {label}" in table and f"| {len(seeds)} | {signed(mean)} | "
                    f"[{signed(mean - half)}, {signed(mean + half)}] |" in table), label


def test_the_tier_m_followup_readings_quote_their_table(capsys, monkeypatch, tmp_path):
    """The follow-up's readings in experiments/tier_m/README.md quote the registered script's rows: each
    contrast's mean and interval (and the primary ones' Holm p, the added check's p) as the table has them."""
    table, _ = _followup_sc_table(capsys, monkeypatch, tmp_path)
    readings = TIER_M_TEXT.split("**Readings** (every number from `followup_sc/results.md`")
    if len(readings) < 2:
        pytest.skip("the follow-up's readings are not written yet")
    text = " ".join(readings[1].split())

    def cells(label: str) -> list[str]:
        row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
        return [cell.strip() for cell in row.strip("|").split("|")]

    for label, quoted in (("GRPO-CH + SC − GRPO-CH", "(1) GRPO-CH + SC − GRPO-CH: worse**, {mean} {interval} points "
                                                     "(Holm p {holm})"),
                          ("BPO + SC − BPO", "(2) BPO + SC − BPO: worse as registered**, {mean} {interval} points "
                                             "(Holm p {holm})"),
                          ("(2′) BPO + SC − BPO (re-run)", "(2′) {mean} {interval} points (p {p}, unadjusted)"),
                          ("BPO, re-run − committed (how far the code change moved BPO)",
                           "committed BPO is {mean} {interval}"),
                          ("GRPO-CH + SC − GRPO-CH + TIS", "GRPO-CH + SC is {mean} {interval}"),
                          ("BPO + SC − GRPO-CH + TIS", "BPO + SC {mean} {interval}. As in the main runs"),
                          ("GRPO-CH − GRPO-CH + TIS (the anchor alone)", "GRPO-CH + TIS) is {mean} {interval}"),
                          ("GRPO-CH + SC, new − old term", "GRPO-CH + SC {mean} {interval}, BPO"),
                          ("BPO + SC, new − old term", "BPO + SC {mean} {interval}. The")):
        c = cells(label)
        fields = {"mean": c[2], "interval": c[3], "p": c[4], "holm": c[5] if len(c) > 6 else ""}
        assert quoted.format(**fields) in text, (label, quoted.format(**fields))
    assert "(0 of 10)" in text and "The re-run BPO curves equal the committed ones for 0 of 10 seeds." in table
    assert "(1.006 ± 0.010)" in text and "| GRPO-CH + SC | 1.006 ± 0.010 |" in table
    anchor = float(cells("GRPO-CH − GRPO-CH + TIS (the anchor alone)")[2].replace("−", "-"))
    gap = float(cells("GRPO-CH + SC − GRPO-CH + TIS")[2].replace("−", "-"))
    assert round(anchor / gap, 1) == 0.4 and "about\n  two fifths" in TIER_M_TEXT


def test_the_results_page_quotes_the_tier_m_followup(capsys, monkeypatch, tmp_path):
    """docs/results.md's Tier M row quotes the follow-up's table: the contrasts it names, as tabled."""
    table, _ = _followup_sc_table(capsys, monkeypatch, tmp_path)
    page = (ROOT / "docs" / "results.md").read_text()
    if "pre-registered follow-up (GRPO-CH + SC" not in page:
        pytest.skip("the results page does not quote the follow-up yet")

    def numbers(label: str) -> str:
        row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        return f"{cells[2]} {cells[3]}"

    assert f"GRPO-CH + SC {numbers('GRPO-CH + SC − GRPO-CH + TIS')} against GRPO-CH + TIS" in page
    assert (f"{numbers('GRPO-CH + SC, new − old term')} and {numbers('BPO + SC, new − old term')}") in page
    assert f"made GRPO-CH worse, {numbers('GRPO-CH + SC − GRPO-CH')} (Holm p 0.018" in page
    assert "| GRPO-CH + SC − GRPO-CH | 10 | −1.5 | [−2.7, −0.3] | 0.017 | 0.018 | worse |" in table
    assert f"re-run on the follow-up's commit it is {numbers('(2′) BPO + SC − BPO (re-run)')}" in page


def test_the_lr_followup_readings_quote_their_table(capsys):
    """Tier C's follow-up readings (experiments/tier_c/README.md) and its docs/results.md row quote
    tables/lr1e-4/results.md as the script prints it: Δ₁ and I with both intervals and Holm p, each
    method's change, the drops, the μ-bin shares and the entropy proxy."""
    table, seeds = _lr_followup_table(capsys)
    if len(seeds) < 20:
        pytest.skip("the follow-up's 20 seeds are not all committed")
    tier_c_text = (TIER_C / "README.md").read_text()
    text = " ".join(tier_c_text.split("### Follow-up results (lr 1e-4, seeds 1–20)")[1].split())
    page = (ROOT / "docs" / "results.md").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in table.splitlines() if line.startswith("| ")}
    for label, name in (("Δ₁ = BPO − GRPO-ClipHigher at 1e-4", "Δ₁ = BPO − GRPO-ClipHigher at 1e-4"),
                        ("I = Δ₁ − Δ₂ (Δ₂: the same at 2e-4)", "I = Δ₁ − Δ₂")):
        c = rows[label]
        assert f"**{name} = {c[1]} points {c[2]}** (95% t-interval; 97.5% {c[3]}; Holm p {c[6]})" in text or \
            f"**{name} = {c[1]} points {c[2]}** (97.5% {c[3]}; Holm p {c[6]})" in text, label
        assert f"*{c[7]}*" in text
    d1, inter = rows["Δ₁ = BPO − GRPO-ClipHigher at 1e-4"], rows["I = Δ₁ − Δ₂ (Δ₂: the same at 2e-4)"]
    assert f"BPO − GRPO-ClipHigher = {d1[1]} {d1[2]} (97.5% {d1[3]};" in page
    assert f"the interaction with 2e-4 is {inter[1]} {inter[2]} (Holm p {inter[6]}," in page
    assert f"upper bound, {d1[3].split(', ')[1].rstrip(']')}, is below +2 points" in text
    for method in ("BPO", "GRPO-ClipHigher"):
        lines = [line for line in table.splitlines() if line.startswith(f"| {method} | ")]
        by_rate = {line.split("|")[2].strip(): [c.strip() for c in line.strip("|").split("|")] for line in lines
                   if line.split("|")[2].strip() in ("2e-4", "1e-4") and len(line.split("|")) == 7}
        drops = {rate: cells[4].split(" of ")[0] for rate, cells in by_rate.items()}
        assert (f"| {method} | {by_rate['2e-4'][3]} | {by_rate['1e-4'][3]} | {drops['2e-4']} → {drops['1e-4']} of 20 |"
                in tier_c_text), method
        change = next(line for line in lines if len(line.split("|")) == 5)
        cells = [c.strip() for c in change.strip("|").split("|")]
        assert f"{method} gained {cells[1]} {cells[2]} points" in text or f"{method} {cells[1]} {cells[2]}" in text
    shares = {(c[0], c[1]): c for c in (
        [x.strip() for x in line.strip("|").split("|")] for line in table.splitlines()
        if line.startswith("| ") and len(line.split("|")) == 10) if c[1] in ("1e-4", "2e-4")}
    assert (f"({shares['BPO', '1e-4'][3]}% against {shares['GRPO-ClipHigher', '1e-4'][3]}%; at 2e-4 "
            f"{shares['BPO', '2e-4'][3]}% against {shares['GRPO-ClipHigher', '2e-4'][3]}%)") in text
    assert f"({shares['BPO', '1e-4'][5]}% against {shares['GRPO-ClipHigher', '1e-4'][5]}%)" in text
    entropy = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in table.splitlines()
               if line.startswith("| ") and "nats" not in line and len(line.split("|")) == 5 and "±" in line}
    assert f"is {entropy['BPO']} nats for BPO and {entropy['GRPO-ClipHigher']} for GRPO-ClipHigher" in text


def test_the_exploratory_cispo_runs_of_tier_c():
    """CISPO at lr 2e-4 (exploratory, registered with the primary runs): its row of the means by
    step, CISPO − BPO and CISPO − GRPO-ClipHigher, its runs that fail the pilot rule's stability
    test, in experiments/tier_c/README.md and its docs/results.md row."""
    runs, seeds = _tier_c_runs(), range(1, 21)
    for seed in seeds:
        runs.update(_runs(TIER_C / "main" / f"runs_cispo_s{seed}.csv"))
    text = (TIER_C / "README.md").read_text()
    flat = " ".join(text.split())
    row = (ROOT / "docs" / "results.md").read_text()
    windows = [final_window(runs[("cispo", s)]) for s in seeds]
    by_step = ", ".join(f"{statistics.fmean(_accuracy(runs[('cispo', s)])[step] for s in seeds):.1f}"
                        for step in range(0, 121, 20))
    assert f"| CISPO (exploratory) | {statistics.fmean(windows):.1f} ± {statistics.stdev(windows):.1f} | {by_step} |" in text
    versus = {}
    for method, label in (("bpo", "BPO"), ("grpo", "GRPO-ClipHigher")):
        deltas = [final_window(runs[("cispo", s)]) - final_window(runs[(method, s)]) for s in seeds]
        mean, sd, low, high = versus[method] = interval(deltas)
        assert (f"CISPO − {label} = {signed(mean)} points [{signed(low)}, {signed(high)}] (95% t-interval, 19 degrees "
                f"of freedom, unadjusted), σ_d = {sd:.1f}, CISPO ahead in {sum(d > 0 for d in deltas)} of 20 seeds") in flat
    drops = sum(_dropped(runs[("cispo", s)]) for s in seeds)
    assert f"{drops} of the 20 CISPO runs fail the stability test at 2e-4" in flat
    mean, _, low, high = versus["bpo"]
    assert f"CISPO − BPO at lr 2e-4 (exploratory) = {signed(mean)} [{signed(low)}, {signed(high)}]" in row
