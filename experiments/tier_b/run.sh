#!/usr/bin/env bash
# Tier B's main runs (README.md beside this file, pre-registered), in the order the primary contrasts need
# them: r3 at staleness 4, then bf16 (R3 off) at staleness 0, then r3 at staleness 0. Each call
# keeps the runs already complete in its --out, so this script continues where it stopped; each
# call's runs.csv is copied to experiments/tier_b/main/ when the call ends.
#   bash experiments/tier_b/run.sh            (from the repository root; about 1-2 minutes a run)
set -euo pipefail
cd "$(dirname "$0")/../.."
methods=bpo,grpo,bpo_eps1e3,grpo_dualclip,dppo_tv
seeds=1,2,3,4,5,6,7,8,9,10
mkdir -p experiments/tier_b/main
run() {  # run NAME [compare arguments...]
    local name=$1; shift
    .venv/bin/bpo-megatron compare experiments/tier_b/rl.yaml "$@" --losses "$methods" --seeds "$seeds" \
        --out "runs/tier_b/main_$name"
    cp "runs/tier_b/main_$name/runs.csv" "experiments/tier_b/main/runs_$name.csv"
}
run r3_k4 --condition r3 --staleness 4
run bf16_k0 rollout.hf.dtype=bf16 model.routing_replay=false --condition bf16 --staleness 0
run r3_k0 --condition r3 --staleness 0
.venv/bin/bpo-megatron compare --from-csv experiments/tier_b/main/runs_r3_k4.csv,experiments/tier_b/main/runs_bf16_k0.csv,experiments/tier_b/main/runs_r3_k0.csv \
    --primary grpo@r3/4,grpo@bf16/0,bpo_eps1e3@r3/4 --out experiments/tier_b/main
