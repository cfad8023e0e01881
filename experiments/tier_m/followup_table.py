"""Tier M's score-centering follow-up (README.md beside this file, "Follow-up: score centering as
now composed"), from the committed CSVs alone: the two registered contrasts with Holm over the two,
their readings, the check that the re-run reference did not move, and the registered secondaries.

    python3 experiments/tier_m/followup_table.py > experiments/tier_m/followup_sc/results.md

(run by tables.sh). Seeds are paired as registered: a contrast uses the seeds both of its arms
have; the table states them.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from bpo_megatron.commands.runs_csv import mean_over_steps
from bpo_megatron.commands.statistics import area_under_curve, holm, paired_t

HERE = Path(__file__).resolve().parent
FOLLOWUP, MAIN = HERE / "followup_sc" / "runs.csv", HERE / "main" / "runs.csv"
# BPO re-run at the follow-up's commit, added after the registered check failed (README: "Added after
# the check failed"); read as a check of contrast (2), unadjusted, outside the Holm family
BPO_RERUN = HERE / "followup_bpo" / "runs.csv"
NAMES = {"grpo_tis": "GRPO-CH + TIS", "grpo": "GRPO-CH", "grpo_sc": "GRPO-CH + SC", "bpo_sc": "BPO + SC",
         "bpo": "BPO"}
WINDOW = 3  # the final window: the evaluations at steps 20, 30 and 40
ALPHA = 0.05  # the primary family's level (Holm over the two contrasts)
# the registered primary family: (label, arm, its CSV, reference, its CSV)
PRIMARY = (("GRPO-CH + SC − GRPO-CH", "grpo_sc", "new", "grpo", "new"),
           ("BPO + SC − BPO", "bpo_sc", "new", "bpo", "main"))
ADDED = (("(2′) BPO + SC − BPO (re-run)", "bpo_sc", "new", "bpo", "rerun"),
         ("BPO, re-run − committed (how far the code change moved BPO)", "bpo", "rerun", "bpo", "main"))
SECONDARY = (("GRPO-CH + SC − GRPO-CH + TIS", "grpo_sc", "new", "grpo_tis", "new"),
             ("BPO + SC − GRPO-CH + TIS", "bpo_sc", "new", "grpo_tis", "new"),
             ("GRPO-CH + SC, new − old term", "grpo_sc", "new", "grpo_sc", "main"),
             ("BPO + SC, new − old term", "bpo_sc", "new", "bpo_sc", "main"),
             ("GRPO-CH − GRPO-CH + TIS (the anchor alone)", "grpo", "new", "grpo_tis", "new"),
             ("GRPO-CH + TIS, re-run − committed (how far the unchanged arm moved)", "grpo_tis", "new", "grpo_tis",
              "main"))
RHO = "score_centering_rho"


def read_runs(path: Path) -> dict[tuple[str, int], list[dict]]:
    """Every run's evaluation rows by (method_id, seed), in step order."""
    runs: dict[tuple[str, int], list[dict]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            runs.setdefault((row["method_id"], int(row["seed"])), []).append(row)
    return {key: sorted(rows, key=lambda r: int(r["step"])) for key, rows in runs.items()}


def curve(rows: list[dict]) -> list[tuple[int, float]]:
    return [(int(r["step"]), 100 * float(r["accuracy"])) for r in rows]


def final_window(rows: list[dict]) -> float:
    return statistics.fmean(value for _, value in curve(rows)[-WINDOW:])



def fmt(x: float, signed: bool = False) -> str:
    return (f"{x:+.1f}" if signed else f"{x:.1f}").replace("-", "−")


def p_text(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def contrast(runs: dict, arm: str, arm_csv: str, reference: str, reference_csv: str, statistic=final_window):
    """``arm − reference`` paired by the seeds both have (None with fewer than two)."""
    seeds = sorted(s for (m, s) in runs[arm_csv] if m == arm and (reference, s) in runs[reference_csv])
    if len(seeds) < 2:
        return seeds, None
    return seeds, paired_t([statistic(runs[arm_csv][arm, s]) for s in seeds],
                           [statistic(runs[reference_csv][reference, s]) for s in seeds])


def row(label: str, seeds: list[int], c) -> str:
    return (f"| {label} | {len(seeds)} | {fmt(c.mean, True)} | [{fmt(c.low, True)}, {fmt(c.high, True)}] | "
            f"{p_text(c.p)} |")


def contrast_table(runs: dict, contrasts, out) -> None:
    """An unadjusted table of ``contrasts`` ((label, arm, its CSV, reference, its CSV) each), those
    with two or more paired seeds."""
    out("| contrast | pairs | mean (points) | 95% interval | p |")
    out("|---|---:|---:|---:|---:|")
    for label, *arms in contrasts:
        seeds, c = contrast(runs, *arms)
        if c is not None:
            out(row(label, seeds, c))


def main(out=print) -> None:
    out("# Tier M follow-up: score centering as now composed (fp8/0, seeds 1–10 registered)\n")
    if not FOLLOWUP.exists():
        out(f"No runs yet: {FOLLOWUP.relative_to(HERE.parent.parent)} is written when the follow-up's compare call ends.")
        return
    runs = {"new": read_runs(FOLLOWUP), "main": read_runs(MAIN)}
    out("Final window: each run's mean Avg@4 (%) at steps 20, 30 and 40. Contrasts paired by seed; 95% Student t "
        "intervals (n − 1 degrees of freedom); p: two-sided paired t-test; p (Holm): adjusted over the two "
        "registered contrasts. BPO's rows are the main runs' (`main/runs.csv`), the rest the follow-up's.\n")
    out("| arm | runs | final window (mean ± SD) |")
    out("|---|---:|---:|")
    for method in ("grpo_tis", "grpo", "grpo_sc", "bpo_sc"):
        values = [final_window(rows) for (m, _), rows in sorted(runs["new"].items()) if m == method]
        spread = f" ± {fmt(statistics.stdev(values))}" if len(values) > 1 else ""
        out(f"| {NAMES[method]} | {len(values)} | {fmt(statistics.fmean(values)) if values else '—'}{spread} |")
    primary = [(label, *contrast(runs, *arms)) for label, *arms in PRIMARY]
    if any(c is None for _, _, c in primary):
        out("\nFewer than two paired seeds in a registered contrast: no interval yet.")
        return
    adjusted = holm([c.p for _, _, c in primary])
    out("\nPrimary family (registered):\n")
    out("| contrast | pairs | mean (points) | 95% interval | p | p (Holm) | reading |")
    out("|---|---:|---:|---:|---:|---:|---|")
    for (label, seeds, c), p_holm in zip(primary, adjusted):
        reading = ("better" if c.mean > 0 else "worse") if p_holm < ALPHA else "no difference detected"
        out(f"{row(label, seeds, c)} {p_text(p_holm)} | {reading} |")
    out(f"\nReadings as registered: *better* / *worse* at a Holm-adjusted p < {ALPHA}, otherwise *no difference "
        "detected* with the interval.\n")
    same = [s for (m, s), rows in sorted(runs["new"].items()) if m == "grpo_tis"
            and ("grpo_tis", s) in runs["main"] and curve(rows) == curve(runs["main"]["grpo_tis", s])]
    rerun = sorted(s for (m, s) in runs["new"] if m == "grpo_tis")
    out(f"The check that the commit did not move the unchanged arms: the re-run GRPO-CH + TIS curves equal the "
        f"committed ones for {len(same)} of {len(rerun)} seeds"
        + (f" (differing: {', '.join(str(s) for s in rerun if s not in same)})." if len(same) < len(rerun) else "."))
    if BPO_RERUN.exists():
        runs["rerun"] = read_runs(BPO_RERUN)
        same = [s for (m, s), rows in sorted(runs["rerun"].items()) if m == "bpo"
                and ("bpo", s) in runs["main"] and curve(rows) == curve(runs["main"]["bpo", s])]
        rerun = sorted(s for (m, s) in runs["rerun"] if m == "bpo")
        out("\nAdded after the check failed (not registered; a check of contrast (2), paired on one commit, "
            "unadjusted, outside the Holm family): BPO re-run at the follow-up's commit "
            "(`followup_bpo/runs.csv`).\n")
        contrast_table(runs, ADDED, out)
        out(f"\nThe re-run BPO curves equal the committed ones for {len(same)} of {len(rerun)} seeds.")
    out("\nSecondary (no verdicts, unadjusted):\n")
    contrast_table(runs, SECONDARY, out)
    out("\nArea under the evaluation curve (steps 0–40, trapezoids, divided by the steps), the primary contrasts:\n")
    out("| contrast | pairs | mean (points) | 95% interval | p |")
    out("|---|---:|---:|---:|---:|")
    for label, *arms in PRIMARY:
        seeds, c = contrast(runs, *arms, statistic=lambda rows: area_under_curve(curve(rows)))
        out(row(label, seeds, c))
    out(f"\nThe term's ρ (`{RHO}`), each run's mean over its steps, mean ± SD over seeds:\n")
    out("| arm | ρ |")
    out("|---|---:|")
    for method in ("grpo_sc", "bpo_sc"):
        values = [v for (m, _), rows in sorted(runs["new"].items()) if m == method
                  and (v := mean_over_steps(rows, RHO)) is not None]
        if len(values) > 1:
            out(f"| {NAMES[method]} | {statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f} |")


if __name__ == "__main__":
    main()
