#!/usr/bin/env bash
# Tier M's mismatch probe (README.md beside this file, "The achieved mismatch"), run before the
# pre-registration: 10 BPO steps of rl.yaml (seed 101, not a main seed) with the engine in fp32, in
# bf16 and in emulated block FP8, each logging the engine/trainer mismatch of the responses it
# trains on (the trainer recomputes log pi_old with the weights that sampled them); then the table of their means (probe/mismatch.md, from probe/runs_*.jsonl).
#   bash experiments/tier_m/probe.sh            (from the repository root; about 2 minutes a run)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p experiments/tier_m/probe
for engine in fp32 bf16 fp8; do
    case $engine in
        fp32) settings=(rollout.hf.quantization=none rollout.hf.dtype=fp32) ;;
        bf16) settings=(rollout.hf.quantization=none rollout.hf.dtype=bf16) ;;
        fp8) settings=(rollout.hf.quantization=fp8 rollout.hf.dtype=fp32) ;;
    esac
    out="runs/tier_m/probe_$engine"
    rm -rf "$out"
    .venv/bin/bpo-megatron train experiments/tier_m/rl.yaml "${settings[@]}" train.recompute_old_logprobs=true \
        train.steps=10 eval.every=0 \
        checkpoint.every=0 rollout.seed=101 "logging.run_dir=$out" logging.progress=false > /dev/null
    cp "$out/metrics.jsonl" "experiments/tier_m/probe/runs_$engine.jsonl"
done
python3 experiments/tier_m/probe_table.py experiments/tier_m/probe > experiments/tier_m/probe/mismatch.md
cat experiments/tier_m/probe/mismatch.md
