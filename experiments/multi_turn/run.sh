#!/usr/bin/env bash
# The multi-turn experiment (README.md beside this file): the calculator and the no-tool control,
# seeds 1-3, by one compare call; its runs.csv is copied here and the tables and curves.png rebuilt from it.
#   bash experiments/multi_turn/run.sh        (from the repository root; the compare continues where it stopped)
set -euo pipefail
cd "$(dirname "$0")/../.."
.venv/bin/bpo-megatron compare configs/calculator_cpu.yaml --losses bpo --sweep rollout.agent.name=calculator,null \
    --seeds 1,2,3 --out runs/calculator
cp runs/calculator/runs.csv experiments/multi_turn/runs.csv
.venv/bin/bpo-megatron compare --summarise-only --from-csv experiments/multi_turn/runs.csv --out runs/calculator_tables
cp runs/calculator_tables/curves.png experiments/multi_turn/curves.png
