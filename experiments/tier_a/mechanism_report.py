"""The mechanism experiment's numbers: per-seed CSVs, t-intervals, markdown tables and curves.

Everything here reads plain numbers, so the tables and the plot can be recomputed from the
committed CSVs alone (``experiments/tier_a/mechanism.py --summarise-only``); Student's t is the
package's one implementation (``bpo_megatron.commands.statistics``).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bpo_megatron.commands.statistics import t_quantile

if TYPE_CHECKING:  # the trajectories come from mechanism.py, which imports this module
    from mechanism import Trajectory

CONFIDENCE = 0.95
PER_SEED = ("initial_J", "final_J", "auc", "final_entropy")
RUN_METRICS = ("clip_frac", "clip_frac_pos", "clip_frac_neg", "weight_mean", "abs_logp_diff_mean", "seconds")
REFERENCE = "bpo"  # paired differences are taken against this method


def t_interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width) of the two-sided 95% Student-t interval of the mean."""
    n = len(values)
    if n < 2:
        raise ValueError(f"an interval needs at least 2 values, got {n}")
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t_quantile(0.5 + CONFIDENCE / 2, n - 1) * sd / math.sqrt(n)


@dataclass
class Results:
    """Keyed by (condition, method): per-seed values, pooled run metrics and mean J curves."""

    labels: dict[str, str] = field(default_factory=dict)  # method -> label
    per_seed: dict[tuple[str, str], dict[str, list[float]]] = field(default_factory=dict)
    runs: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    curves: dict[tuple[str, str], list[tuple[float, float]]] = field(default_factory=dict)  # (mean, half) per step

    @property
    def conditions(self) -> list[str]:
        return list(dict.fromkeys(condition for condition, _ in self.per_seed))

    @property
    def methods(self) -> list[str]:
        return list(dict.fromkeys(method for _, method in self.per_seed))


def results_from_trajectories(trajectories: dict[tuple[str, str], "Trajectory"], labels: dict[str, str]) -> Results:
    results = Results(labels=dict(labels))
    for key, trajectory in trajectories.items():
        returns = trajectory.returns.double()
        results.per_seed[key] = {
            "initial_J": returns[0].tolist(),
            "final_J": returns[-1].tolist(),
            "auc": returns[1:].mean(0).tolist(),  # mean exact J over the evaluations after each step
            "final_entropy": trajectory.entropies[-1].double().tolist(),
        }
        results.runs[key] = {**{name: trajectory.metrics[name] for name in RUN_METRICS[:-1]},
                             "seconds": trajectory.seconds}
        results.curves[key] = [t_interval(step.tolist()) for step in returns]
    return results


def write_results(directory: Path, results: Results) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "per_seed.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["condition", "method", "seed", *PER_SEED])
        for (condition, method), values in results.per_seed.items():
            for seed, row in enumerate(zip(*(values[name] for name in PER_SEED))):
                out.writerow([condition, method, seed, *(f"{v:.7g}" for v in row)])
    with open(directory / "runs.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["condition", "method", "label", *RUN_METRICS])
        for (condition, method), metrics in results.runs.items():
            out.writerow([condition, method, results.labels[method], *(f"{metrics[n]:.6g}" for n in RUN_METRICS)])
    with open(directory / "curves.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["condition", "method", "step", "J_mean", "J_half_width"])
        for (condition, method), curve in results.curves.items():
            for step, (mean, half) in enumerate(curve):
                out.writerow([condition, method, step, f"{mean:.8g}", f"{half:.6g}"])


def read_results(directory: Path) -> Results:
    results = Results()
    with open(directory / "per_seed.csv", newline="") as f:
        for row in csv.DictReader(f):
            values = results.per_seed.setdefault((row["condition"], row["method"]), {name: [] for name in PER_SEED})
            for name in PER_SEED:
                values[name].append(float(row[name]))
    with open(directory / "runs.csv", newline="") as f:
        for row in csv.DictReader(f):
            results.labels[row["method"]] = row["label"]
            results.runs[row["condition"], row["method"]] = {name: float(row[name]) for name in RUN_METRICS}
    with open(directory / "curves.csv", newline="") as f:
        for row in csv.DictReader(f):
            results.curves.setdefault((row["condition"], row["method"]), []).append(
                (float(row["J_mean"]), float(row["J_half_width"])))
    return results


def _table(results: Results, title: str, cell) -> str:
    conditions = results.conditions
    lines = [f"**{title}**", "", "| method | " + " | ".join(conditions) + " |",
             "|---|" + "---|" * len(conditions)]
    for method in results.methods:
        cells = [cell(condition, method) if (condition, method) in results.per_seed else "" for condition in conditions]
        lines.append(f"| {results.labels[method]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown_tables(results: Results) -> str:
    def interval(name: str, digits: int):
        def cell(condition: str, method: str) -> str:
            mean, half = t_interval(results.per_seed[condition, method][name])
            return f"{mean:.{digits}f} ± {half:.{digits}f}"
        return cell

    def paired(condition: str, method: str) -> str:
        if method == REFERENCE or (condition, REFERENCE) not in results.per_seed:
            return "—"
        mine, theirs = (results.per_seed[condition, m]["final_J"] for m in (method, REFERENCE))
        mean, half = t_interval([a - b for a, b in zip(mine, theirs)])
        return f"{mean:+.4f} ± {half:.4f}"

    def masked(condition: str, method: str) -> str:
        run = results.runs[condition, method]
        return f"{100 * run['clip_frac']:.2f}% / {run['abs_logp_diff_mean']:.3f}"

    first = results.per_seed[results.conditions[0], results.methods[0]]
    n = len(first["final_J"])
    start = {c: t_interval(results.per_seed[c, results.methods[0]]["initial_J"])[0] for c in results.conditions}
    parts = [
        f"{n} seeds per cell; mean ± half-width of the two-sided {CONFIDENCE:.0%} Student-t interval over seeds "
        f"(t quantile {t_quantile(0.5 + CONFIDENCE / 2, n - 1):.4f}), one interval per cell, no multiplicity "
        "adjustment. J at the start (the same for every method): "
        + ", ".join(f"{c} {j:.4f}" for c, j in start.items()) + ".\n",
        _table(results, "Final J (exact expected reward after the last step)", interval("final_J", 4)),
        _table(results, "AUC (mean exact J over the steps)", interval("auc", 4)),
        _table(results, "Final entropy (nats per response, mean over prompts)", interval("final_entropy", 3)),
    ]
    if REFERENCE in results.methods:
        parts.append(_table(results, f"Final J minus {results.labels[REFERENCE]}'s, paired by seed", paired))
    parts.append(_table(results, "Tokens masked by the loss / mean |log π − log μ| (pooled over updates and seeds)",
                        masked))
    return "\n".join(parts)


def plot_curves(results: Results, path: Path) -> bool:
    """Mean exact J against the step, one panel per condition, 95% bands; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    conditions = results.conditions
    columns = min(3, len(conditions))
    rows = math.ceil(len(conditions) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False, sharex=True)
    for ax, condition in zip(axes.flat, conditions):
        for method in results.methods:
            curve = results.curves.get((condition, method))
            if not curve:
                continue
            mean = [m for m, _ in curve]
            half = [h for _, h in curve]
            steps = range(len(curve))
            line, = ax.plot(steps, mean, label=results.labels[method], linewidth=1.2)
            ax.fill_between(steps, [m - h for m, h in zip(mean, half)], [m + h for m, h in zip(mean, half)],
                            color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set_title(condition)
        ax.set_xlabel("step")
        ax.set_ylabel("exact J")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(conditions):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
