#!/usr/bin/env bash
# Tier A, the exact mechanism test (README.md beside this file): every condition and method, 200
# seeds, about 7 minutes on 2 cores; writes the CSVs, tables.md and curves.png into this folder.
# With --summarise-only it rebuilds tables.md and curves.png from the committed CSVs alone.
#   bash experiments/tier_a/run.sh [--summarise-only]      (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/python experiments/tier_a/mechanism.py --out-dir experiments/tier_a "$@"
