"""Tier C's learning-rate rule (README.md beside this file), applied to the pilot's CSVs: for each
learning rate, each method's largest drop between consecutive evaluations and GRPO-ClipHigher's
mean clip fraction over its steps; the chosen rate is the largest at which neither method drops by
more than 5 points and GRPO-ClipHigher's clip fraction is at most 2%.

    python3 experiments/tier_c/pilot_rule.py experiments/tier_c/pilot/runs_lr*.csv
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

MAX_DROP = 5.0  # points of Avg@4 between consecutive evaluations
MAX_CLIP = 0.02  # GRPO-ClipHigher's mean clip fraction


def read(path: Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            runs.setdefault(row["method_id"], []).append(row)
    return runs


def largest_drop(rows: list[dict]) -> float:
    curve = [100 * float(r["accuracy"]) for r in sorted(rows, key=lambda r: int(r["step"]))]
    return max([0.0] + [a - b for a, b in zip(curve, curve[1:])])


def mean_over_steps(rows: list[dict], metric: str) -> float:
    pairs = [(int(r["trained_steps"]), float(r[metric])) for r in rows if r[metric] and int(r["trained_steps"] or 0)]
    return sum(n * x for n, x in pairs) / sum(n for n, _ in pairs)


def main(paths: list[str]) -> int:
    passing = []
    print("| lr | method | Avg@4 by step (%) | largest drop (points) | mean clip fraction |")
    print("|---|---|---|---:|---:|")
    for path in sorted(map(Path, paths), key=lambda p: float(p.stem.removeprefix("runs_lr"))):
        lr = path.stem.removeprefix("runs_lr")
        runs = read(path)
        ok = True
        for method in ("bpo", "grpo"):
            rows = sorted(runs[method], key=lambda r: int(r["step"]))
            drop, clip = largest_drop(rows), mean_over_steps(rows, "clip_frac")
            curve = ", ".join(f"{100 * float(r['accuracy']):.1f}" for r in rows)
            print(f"| {lr} | {method} | {curve} | {drop:.1f} | {100 * clip:.2f}% |")
            ok &= drop <= MAX_DROP and (method != "grpo" or clip <= MAX_CLIP)
        if ok:
            passing.append(lr)
    chosen = max(passing, key=float) if passing else None
    print(f"rule: largest drop ≤ {MAX_DROP} points for both, GRPO-ClipHigher's clip fraction ≤ {100 * MAX_CLIP:.0f}%;"
          f" passing: {', '.join(passing) or 'none'}; chosen: {chosen or 'none (the design says what then)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
