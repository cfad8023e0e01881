#!/usr/bin/env bash
# On the GPU machine: install the carried bundle (no package registry there) into a private
# directory and run the smoke checks, writing report.json/report.md to OUT_DIR.
# Usage: bash tools/gpu/smoke.sh OUT_DIR [extra arguments of python -m bpo_megatron.gpu_smoke]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:?usage: tools/gpu/smoke.sh OUT_DIR [args]}"
shift
BUNDLE="${BUNDLE:-.gpu-bundle}"
SITE="${SITE:-/tmp/bpo-gpu-site}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$BUNDLE"/*.whl
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -m bpo_megatron.gpu_smoke --out "$OUT" "$@"
