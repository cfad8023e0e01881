"""The changed-share table from the committed CSV alone (measure.py writes it).

``python experiments/changed_share/table.py experiments/changed_share/runs.csv`` prints, per run:
its recipe and learning rate, the optimizer updates between two syncs, the syncs measured, the
share of all bf16 elements changed per sync (mean over the syncs, and their range), the same per
tensor kind (mean), and what a delta sync of those tensors sends against a full one (one bucket per
kind, bpo_megatron/weight_sync/delta_estimate.py).
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict

from bpo_megatron.weight_sync.delta_estimate import KINDS

KIND_ORDER = [kind for kind, _ in KINDS] + ["other"]


def table(rows: list[dict]) -> str:
    runs: dict[str, dict] = {}
    for row in rows:
        run = runs.setdefault(row["run"], {"config": row["config"], "lr": float(row["lr"]),
                                           "updates": int(row["updates_per_step"]), "steps": defaultdict(lambda: [0, 0]),
                                           "kinds": defaultdict(lambda: [0, 0]), "dense": 0, "delta": 0})
        elements, changed = int(row["elements"]), int(row["changed"])
        for bucket in (run["steps"][int(row["step"])], run["kinds"][row["kind"]]):
            bucket[0] += elements
            bucket[1] += changed
        run["dense"] += int(row["dense_bytes"])
        run["delta"] += int(row["delta_bytes"])
    kinds = [kind for kind in KIND_ORDER if any(kind in run["kinds"] for run in runs.values())]
    head = ["run", "recipe", "lr", "updates a sync", "syncs", "changed, all weights: mean [min-max]",
            *kinds, "delta / full bytes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, run in runs.items():
        shares = [changed / elements for elements, changed in run["steps"].values()]
        per_kind = [f"{run['kinds'][k][1] / run['kinds'][k][0]:.2%}" if k in run["kinds"] else "—" for k in kinds]
        lines.append("| " + " | ".join([
            name, run["config"], f"{run['lr']:.0e}", str(run["updates"]), str(len(shares)),
            f"{sum(shares) / len(shares):.2%} [{min(shares):.2%}-{max(shares):.2%}]", *per_kind,
            f"{run['delta'] / run['dense']:.2f}"]) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: table.py RUNS_CSV", file=sys.stderr)
        return 2
    with open(argv[0], newline="") as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        print(f"table.py: {argv[0]} holds no rows", file=sys.stderr)
        return 2
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
