#!/usr/bin/env bash
# Tier M's score-centering follow-up (README.md beside this file, "Follow-up: score centering as now
# composed", pre-registered): GRPO-CH + TIS, GRPO-CH, GRPO-CH + SC and BPO + SC x seeds 1-10 in one
# compare call, which keeps the runs already complete in its --out (the script continues where it
# stopped); its runs.csv is copied to experiments/tier_m/followup_sc/ when the call ends.
#   bash experiments/tier_m/run_followup.sh   (from the repository root; about 1.5 minutes a run alone)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p experiments/tier_m/followup_sc
.venv/bin/bpo-megatron compare experiments/tier_m/rl.yaml --condition fp8 --staleness 0 \
    --losses grpo_tis,grpo,grpo_sc,bpo_sc --seeds 1,2,3,4,5,6,7,8,9,10 --out runs/tier_m/followup_sc
cp runs/tier_m/followup_sc/runs.csv experiments/tier_m/followup_sc/runs.csv
.venv/bin/python experiments/tier_m/followup_table.py > experiments/tier_m/followup_sc/results.md
