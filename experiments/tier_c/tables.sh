#!/usr/bin/env bash
# Tier C's tables (README.md beside this file), from the committed CSVs of the primary runs alone:
#   tables/final-window   the pre-registered primary contrast (GRPO-ClipHigher − BPO, the reverse of Δ;
#                         written grpo@main/0 in the pre-registration: these runs record no staleness,
#                         so compare names the contrast grpo@main)
#   tables/auc, tables/heldout-peak   the same contrast in the secondary statistics (exploratory)
#   tables/lr1e-4         the learning-rate follow-up's contrasts and descriptors (lr_followup.py),
#                         from the primary CSVs and lr1e-4/runs_s*.csv
#   tables/cispo          CISPO − BPO at lr 2e-4 (exploratory), from the primary CSVs and
#                         main/runs_cispo_s*.csv (the primary contrast declared as above, so the
#                         CISPO row carries no adjusted p-value)
#   bash experiments/tier_c/tables.sh         (from the repository root; seconds)
set -euo pipefail
cd "$(dirname "$0")/../.."
csvs=$(printf 'experiments/tier_c/main/runs_s%d.csv,' $(seq 1 20))
csvs=${csvs%,}
for stat in final-window auc heldout-peak; do
    mkdir -p "experiments/tier_c/tables/$stat"
    .venv/bin/bpo-megatron compare --from-csv "$csvs" --primary grpo@main --stat "$stat" \
        --out "experiments/tier_c/tables/$stat"
done
cispo=$(printf 'experiments/tier_c/main/runs_cispo_s%d.csv,' $(seq 1 20))
mkdir -p experiments/tier_c/tables/cispo
.venv/bin/bpo-megatron compare --from-csv "$csvs,${cispo%,}" --primary grpo@main --stat final-window \
    --out experiments/tier_c/tables/cispo
mkdir -p experiments/tier_c/tables/lr1e-4
.venv/bin/python experiments/tier_c/lr_followup.py > experiments/tier_c/tables/lr1e-4/results.md
