"""Tier C's learning-rate follow-up (README.md beside this file, "Follow-up: the learning rate"),
from the committed CSVs alone: the two registered contrasts (Δ₁ = BPO − GRPO-ClipHigher at lr 1e-4,
and the interaction I = Δ₁ − Δ₂ with the primary runs at 2e-4), Holm over the two, their readings,
and the registered descriptors (each method's change between the rates, the runs with a drop, the
μ-bin masked shares, the entropy proxy).

    python3 experiments/tier_c/lr_followup.py > experiments/tier_c/tables/lr1e-4/results.md

(run by tables.sh). Seeds are paired as the pre-registration says: a seed counts once both rates
have both methods' runs; the table states how many pairs it holds.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from bpo_megatron.commands.runs_csv import mean_over_steps
from bpo_megatron.commands.statistics import holm, paired_t

HERE = Path(__file__).resolve().parent
RATES = {"2e-4": HERE / "main", "1e-4": HERE / "lr1e-4"}  # the registered rates and their CSV folders
METHODS = {"bpo": "BPO", "grpo": "GRPO-ClipHigher"}
WINDOW = 3  # the final window: the last three evaluations (steps 80, 100, 120)
DROP = 5.0  # points between consecutive evaluations: the pilot rule's stability test
REFUTES_BELOW = 2.0  # Δ₁'s reading: the paper's effect scaled to this task, in points
ALPHA = 0.05  # the family's level (Holm over the two contrasts)
MU_BINS = ("low", "mid", "high")  # μ < 0.2, 0.2 ≤ μ < 0.9, μ ≥ 0.9 (losses/statistics.py)
ENTROPY_PROXY = "rollout/neg_log_mu_mean"


def read_runs(folder: Path) -> dict[tuple[str, int], list[dict]]:
    """Every run's evaluation rows by (method_id, seed), in step order: the seeds' files
    ``runs_s<seed>.csv`` only (not the exploratory ``runs_short_s<seed>.csv`` beside them)."""
    runs: dict[tuple[str, int], list[dict]] = {}
    for path in sorted(p for p in folder.glob("runs_s*.csv") if p.stem[len("runs_s"):].isdigit()):
        with path.open() as f:
            for row in csv.DictReader(f):
                runs.setdefault((row["method_id"], int(row["seed"])), []).append(row)
    return {key: sorted(rows, key=lambda r: int(r["step"])) for key, rows in runs.items()}


def curve(rows: list[dict]) -> list[float]:
    return [100 * float(r["accuracy"]) for r in rows]


def final_window(rows: list[dict]) -> float:
    return statistics.fmean(curve(rows)[-WINDOW:])


def largest_drop(rows: list[dict]) -> float:
    points = curve(rows)
    return max([0.0] + [a - b for a, b in zip(points, points[1:])])



def fmt(x: float, signed: bool = False) -> str:
    return (f"{x:+.1f}" if signed else f"{x:.1f}").replace("-", "−")


def interval(low: float, high: float) -> str:
    return f"[{fmt(low, True)}, {fmt(high, True)}]"


def p_text(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def main() -> None:
    runs = {rate: read_runs(folder) for rate, folder in RATES.items()}
    seeds = sorted(s for s in {seed for _, seed in runs["1e-4"]}
                   if all((m, s) in runs[rate] for rate in RATES for m in METHODS))
    fw = {(rate, m): [final_window(runs[rate][(m, s)]) for s in seeds] for rate in RATES for m in METHODS}
    delta_1 = {level: paired_t(fw["1e-4", "bpo"], fw["1e-4", "grpo"], level=level) for level in (0.95, 0.975)}
    delta_2 = [b - g for b, g in zip(fw["2e-4", "bpo"], fw["2e-4", "grpo"])]
    delta_1_seeds = [b - g for b, g in zip(fw["1e-4", "bpo"], fw["1e-4", "grpo"])]
    interaction = {level: paired_t(delta_1_seeds, delta_2, level=level) for level in (0.95, 0.975)}
    out = print
    out("# Tier C, learning-rate follow-up: lr 1e-4 against the primary runs at 2e-4\n")
    out(f"Pairs: {len(seeds)} seeds with both methods at both rates (seeds {', '.join(map(str, seeds))}). "
        f"Final window: each run's mean Avg@4 (%) over its last {WINDOW} evaluations (steps 80, 100, 120). "
        "Intervals: Student t over the seeds (n − 1 degrees of freedom); p: two-sided t-test of a zero mean; "
        "p (Holm): adjusted over the two registered contrasts.\n")
    if len(seeds) < 2:
        out("Fewer than two pairs: no interval yet.")
        return
    out("| method | lr | runs | final window (mean ± SD) | runs with a drop > 5 points |")
    out("|---|---|---:|---:|---:|")
    for m, name in METHODS.items():
        for rate in RATES:
            values = fw[rate, m]
            drops = sum(largest_drop(runs[rate][(m, s)]) > DROP for s in seeds)
            out(f"| {name} | {rate} | {len(values)} | {fmt(statistics.fmean(values))} ± "
                f"{fmt(statistics.stdev(values))} | {drops} of {len(seeds)} |")
    contrasts = {"Δ₁ = BPO − GRPO-ClipHigher at 1e-4": delta_1, "I = Δ₁ − Δ₂ (Δ₂: the same at 2e-4)": interaction}
    adjusted = holm([c[0.95].p for c in contrasts.values()])
    out("\n| contrast | mean (points) | 95% interval | 97.5% interval | SD | p | p (Holm) | reading |")
    out("|---|---:|---:|---:|---:|---:|---:|---|")
    for (label, c), p_holm in zip(contrasts.items(), adjusted):
        wide = c[0.975]
        sd = statistics.stdev(delta_1_seeds if c is delta_1 else
                              [a - b for a, b in zip(delta_1_seeds, delta_2)])
        if c is delta_1:
            reading = ("supports" if p_holm < ALPHA and c[0.95].mean > 0 else
                       "refutes the paper's effect scaled to this task" if wide.high < REFUTES_BELOW else "cannot tell")
        else:
            reading = ("the step size matters" if p_holm < ALPHA else "no dependence on the step size detected")
        out(f"| {label} | {fmt(c[0.95].mean, True)} | {interval(c[0.95].low, c[0.95].high)} | "
            f"{interval(wide.low, wide.high)} | {fmt(sd)} | {p_text(c[0.95].p)} | {p_text(p_holm)} | {reading} |")
    out(f"\nReadings as registered: Δ₁ *supports* if its Holm p < {ALPHA} and its mean is positive, *refutes the "
        f"paper's effect scaled to this task* if its 97.5% interval's upper bound is below +{REFUTES_BELOW:.0f} points, "
        f"otherwise *cannot tell*; I: *the step size matters* if its Holm p < {ALPHA}.\n")
    out("Descriptors (no verdicts). Each method's change from 2e-4 to 1e-4, paired by seed (final window, "
        "95% interval, unadjusted):\n")
    out("| method | 1e-4 − 2e-4 (points) | 95% interval |")
    out("|---|---:|---:|")
    for m, name in METHODS.items():
        change = paired_t(fw["1e-4", m], fw["2e-4", m])
        out(f"| {name} | {fmt(change.mean, True)} | {interval(change.low, change.high)} |")
    out("\nMasked share by the sign of the advantage and the rollout probability μ (each run's mean over its "
        "steps, then the mean over seeds; low μ < 0.2, mid 0.2 ≤ μ < 0.9, high μ ≥ 0.9), in %:\n")
    out("| method | lr | " + " | ".join(f"Â {s} μ {b}" for s in ("> 0", "< 0") for b in MU_BINS) + " |")
    out("|---|---|" + "---:|" * 6)
    for m, name in METHODS.items():
        for rate in RATES:
            cells = []
            for sign in ("pos", "neg"):
                for b in MU_BINS:
                    values = [v for s in seeds if (v := mean_over_steps(runs[rate][(m, s)], f"clip_frac_{sign}_mu_{b}"))
                              is not None]
                    cells.append(f"{100 * statistics.fmean(values):.1f}" if values else "—")
            out(f"| {name} | {rate} | " + " | ".join(cells) + " |")
    out("\nEntropy proxy, the mean −log μ of the sampled tokens (`rollout/neg_log_mu_mean`; logged from the "
        "follow-up on, so at 1e-4 only), each run's mean over its steps, mean ± SD over seeds:\n")
    out("| method | lr | −log μ (nats per token) |")
    out("|---|---|---:|")
    for m, name in METHODS.items():
        values = [mean_over_steps(runs["1e-4"][(m, s)], ENTROPY_PROXY) for s in seeds]
        out(f"| {name} | 1e-4 | {statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f} |")


if __name__ == "__main__":
    main()
