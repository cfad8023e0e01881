#!/usr/bin/env bash
# Tier C's main runs (README.md beside this file, pre-registered), seed by seed so that each pair
# of the primary contrast is complete before the next starts: BPO and GRPO-ClipHigher for seeds
# 1-20, then the exploratory CISPO runs and the short-answer protocol for the same seeds. Each call keeps the runs already
# complete in its --out (the script continues where it stopped); each seed's runs.csv is copied to
# experiments/tier_c/main/ when its call ends.
#   LR=<the pilot's rate> bash experiments/tier_c/run.sh      (from the repository root; ≈ 6 minutes a run)
# PARTS (default "main cispo short") names the parts to run, in that order.
set -euo pipefail
cd "$(dirname "$0")/../.."
LR="${LR:?set LR to the learning rate the pre-registration fixed, e.g. LR=1.0e-4}"
PARTS="${PARTS:-main cispo short}"
mkdir -p experiments/tier_c/main
for seed in $(seq 1 20); do
    [[ " $PARTS " == *" main "* ]] || break
    .venv/bin/bpo-megatron compare experiments/tier_c/rl.yaml "optimizer.lr=$LR" --condition main \
        --losses bpo,grpo --seeds "$seed" --out "runs/tier_c/main/s$seed"
    cp "runs/tier_c/main/s$seed/runs.csv" "experiments/tier_c/main/runs_s$seed.csv"
done
for seed in $(seq 1 20); do
    [[ " $PARTS " == *" cispo "* ]] || break
    .venv/bin/bpo-megatron compare experiments/tier_c/rl.yaml "optimizer.lr=$LR" --condition main \
        --losses cispo --seeds "$seed" --out "runs/tier_c/cispo/s$seed"
    cp "runs/tier_c/cispo/s$seed/runs.csv" "experiments/tier_c/main/runs_cispo_s$seed.csv"
done
# the short-answer protocol (exploratory): Tier B's base and task, run as above
for seed in $(seq 1 20); do
    [[ " $PARTS " == *" short "* ]] || break
    .venv/bin/bpo-megatron compare experiments/tier_c/short.yaml "optimizer.lr=$LR" --condition short \
        --losses bpo,grpo --seeds "$seed" --out "runs/tier_c/short/s$seed"
    cp "runs/tier_c/short/s$seed/runs.csv" "experiments/tier_c/main/runs_short_s$seed.csv"
done
