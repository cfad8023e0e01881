#!/usr/bin/env bash
# The changed share of bf16 weights per sync (README.md beside this file, pre-registered): every run
# of measure.py's RUNS (Tier B's recipe across the learning-rate sweep, Tier C's recipe at its two
# learning rates, the CPU demo configs/tiny_moe_cpu.yaml across the sweep), 6 RL steps each (5
# measured syncs). Rows go to experiments/changed_share/runs.csv; runs already there are skipped,
# so the script continues where it stopped. Then the table, from the CSV alone.
#   bash experiments/changed_share/run.sh     (from the repository root; ≈ 1-3 minutes a run on 2 idle cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHONPATH=$PWD nice -n 10 .venv/bin/python experiments/changed_share/measure.py --out experiments/changed_share/runs.csv
PYTHONPATH=$PWD .venv/bin/python experiments/changed_share/table.py experiments/changed_share/runs.csv
