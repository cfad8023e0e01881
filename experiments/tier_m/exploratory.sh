#!/usr/bin/env bash
# Tier M's exploratory tables (README.md beside this file; no verdicts, no multiplicity adjustment
# beyond what compare prints), from the committed CSV alone:
#   auc/      every method against GRPO + TIS in the area under the evaluation curve;
#   vs_bpo/   every method against BPO (the CSV's rows with BPO's first, so compare takes it as
#             the reference): BPO + SC − BPO is score centering added to BPO, paired by seed.
#   bash experiments/tier_m/exploratory.sh      (from the repository root; seconds)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/tier_m/exploratory
mkdir -p "$out/auc" "$out/vs_bpo"
.venv/bin/bpo-megatron compare --from-csv experiments/tier_m/main/runs.csv --stat auc --out "$out/auc"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python - experiments/tier_m/main/runs.csv "$tmp/runs.csv" <<'PY'
import csv, sys
with open(sys.argv[1], newline="") as f:
    reader = csv.DictReader(f)
    rows = list(reader)
rows.sort(key=lambda r: r["method_id"] != "bpo")  # stable: BPO's rows first, the rest as they were
with open(sys.argv[2], "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=reader.fieldnames)
    writer.writeheader()
    writer.writerows(rows)
PY
.venv/bin/bpo-megatron compare --from-csv "$tmp/runs.csv" --out "$out/vs_bpo"
