#!/usr/bin/env bash
# On a GPU machine without a package registry: install the bundle's wheels brought along (.gpu-bundle, made
# by tools/gpu/build_bundle.sh; Ray not included: tools/gpu/round.sh joins and installs it) into a
# private directory and run the kit with the arguments given, writing report.json/report.md to
# OUT_DIR. A visit's main run is tools/gpu/round.sh; this is for a second look at some checks.
# Usage: bash tools/gpu/smoke.sh OUT_DIR [arguments of python -m bpo_megatron.gpu_smoke]
#   bash tools/gpu/smoke.sh OUT --checks trainer_step,driver_payloads --timeout 200
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:?usage: tools/gpu/smoke.sh OUT_DIR [args]}"
shift
BUNDLE="${BUNDLE:-.gpu-bundle}"
SITE="${SITE:-/tmp/bpo-gpu-site}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$BUNDLE"/*.whl
# the work tree first: the kit's checks (and any Ray worker) import the same code
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -m bpo_megatron.gpu_smoke --out "$OUT" "$@"
