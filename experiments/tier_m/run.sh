#!/usr/bin/env bash
# Tier M's main runs (README.md beside this file, pre-registered): four methods x seeds 1-10 in one
# compare call, which keeps the runs already complete in its --out (the script continues where it
# stopped); its runs.csv is copied to experiments/tier_m/main/ when the call ends, then the tables.
#   bash experiments/tier_m/run.sh            (from the repository root; about 1.5 minutes a run)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p experiments/tier_m/main
.venv/bin/bpo-megatron compare experiments/tier_m/rl.yaml --condition fp8 --staleness 0 \
    --losses grpo_tis,bpo,grpo_sc,bpo_sc --seeds 1,2,3,4,5,6,7,8,9,10 --out runs/tier_m/main
cp runs/tier_m/main/runs.csv experiments/tier_m/main/runs.csv
.venv/bin/bpo-megatron compare --from-csv experiments/tier_m/main/runs.csv \
    --primary bpo@fp8/0,grpo_sc@fp8/0,bpo_sc@fp8/0 --out experiments/tier_m/main
