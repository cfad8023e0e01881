#!/usr/bin/env bash
# Tier C's learning-rate follow-up (README.md beside this file, "Follow-up: the learning rate",
# pre-registered): BPO and GRPO-ClipHigher at lr 1e-4 for seeds 1-20, seed by seed (each seed's
# runs.csv copied to experiments/tier_c/lr1e-4/ when its call ends), then the exploratory runs the
# primary pre-registration placed after its runs (CISPO and the short-answer protocol, at 2e-4).
# Each call keeps the runs already complete in its --out (the script continues where it stopped).
#   bash experiments/tier_c/run_lr.sh      (from the repository root; ≈ 6 minutes a run on 2 idle cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p experiments/tier_c/lr1e-4
for seed in $(seq 1 20); do
    .venv/bin/bpo-megatron compare experiments/tier_c/rl.yaml "optimizer.lr=1.0e-4" --condition lr1e-4 \
        --losses bpo,grpo --seeds "$seed" --out "runs/tier_c/lr1e-4/s$seed"
    cp "runs/tier_c/lr1e-4/s$seed/runs.csv" "experiments/tier_c/lr1e-4/runs_s$seed.csv"
done
PARTS="cispo short" LR=2.0e-4 bash experiments/tier_c/run.sh
