#!/usr/bin/env bash
# Tier B follow-ups (README.md beside this file, "Where the Tier B gap comes from", pre-registered as
# exploratory): at r3/4, BPO's mask with GRPO's weight and ω with GRPO's mask (mask or weight?),
# then BPO and GRPO-ClipHigher at lr 1e-4 (step size × staleness?). Same config and seeds as the
# main runs; each call keeps the runs already complete in its --out (the script continues where
# it stopped) and its runs.csv is copied to experiments/tier_b/followups/ when the call ends.
#   bash experiments/tier_b/run_followups.sh      (from the repository root; about 1-2 minutes a run)
set -euo pipefail
cd "$(dirname "$0")/../.."
seeds=1,2,3,4,5,6,7,8,9,10
mkdir -p experiments/tier_b/followups
.venv/bin/bpo-megatron compare experiments/tier_b/rl.yaml --condition r3 --staleness 4 \
    --losses bpo_mask_r_weight,omega_weight_grpo_mask --seeds "$seeds" --out runs/tier_b/followup_decomposition
cp runs/tier_b/followup_decomposition/runs.csv experiments/tier_b/followups/runs_decomposition_r3_k4.csv
.venv/bin/bpo-megatron compare experiments/tier_b/rl.yaml optimizer.lr=1.0e-4 --condition lr1e-4 --staleness 4 \
    --losses bpo,grpo --seeds "$seeds" --out runs/tier_b/followup_lr1e-4
cp runs/tier_b/followup_lr1e-4/runs.csv experiments/tier_b/followups/runs_lr1e-4_k4.csv
# the tables, from the committed CSVs alone (BPO's r3/4 runs first: the reference)
.venv/bin/bpo-megatron compare --from-csv experiments/tier_b/main/runs_r3_k4.csv,experiments/tier_b/followups/runs_decomposition_r3_k4.csv,experiments/tier_b/followups/runs_lr1e-4_k4.csv \
    --between r3/4,lr1e-4/4 --out experiments/tier_b/followups
