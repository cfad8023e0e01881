#!/usr/bin/env bash
# Tier C's learning-rate pilot (README.md beside this file), before the pre-registration: BPO and
# GRPO-ClipHigher at each of 5e-5, 1e-4 and 2e-4, one seed (101, not a main seed). Each call keeps
# the runs already complete in its --out (the script continues where it stopped); its runs.csv is
# copied to experiments/tier_c/pilot/ when the call ends.
#   bash experiments/tier_c/pilot.sh       (from the repository root; about 15 minutes a run on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p experiments/tier_c/pilot
for lr in 2e-4 1e-4 5e-5; do
    value=$(python3 -c "print(f'{float(\"$lr\"):.1e}')")   # YAML reads 1.0e-4 as a number, 1e-4 as a string
    .venv/bin/bpo-megatron compare experiments/tier_c/rl.yaml "optimizer.lr=$value" --condition "lr$lr" \
        --losses bpo,grpo --seeds 101 --out "runs/tier_c/pilot_lr$lr"
    cp "runs/tier_c/pilot_lr$lr/runs.csv" "experiments/tier_c/pilot/runs_lr$lr.csv"
done
