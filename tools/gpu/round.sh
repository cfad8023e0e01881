#!/usr/bin/env bash
# On the GPU machine: one device call of a GPU session (#26). Installs the carried bundle once,
# runs the CUDA-only tests (the fused log-prob kernels, the embedded engine's decode path) and then
# the kit's checks, everything written under OUT_DIR (cuda_tests.txt, kit/report.{json,md}). Two
# calls cover the kit within the device tool's 10 minutes a call:
#   run(command="bash tools/gpu/round.sh $OUT/a new", carry=[".gpu-bundle"], timeout_s=590)
#   run(command="bash tools/gpu/round.sh $OUT/b rest", carry=[".gpu-bundle"], timeout_s=590)
# "new": the CUDA tests, then the checks of what has never run on a GPU; "rest": the other checks.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:?usage: tools/gpu/round.sh OUT_DIR new|rest}"
PART="${2:?usage: tools/gpu/round.sh OUT_DIR new|rest}"
BUNDLE="${BUNDLE:-.gpu-bundle}"
SITE="${SITE:-/tmp/bpo-gpu-site}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$BUNDLE"/*.whl
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
case "$PART" in
  new)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_fused_logprobs.py \
        tests/test_hf_decode_path.py > "$OUT/cuda_tests.txt" 2>&1
    echo "cuda tests: exit $? (tail of $OUT/cuda_tests.txt)"; tail -15 "$OUT/cuda_tests.txt"
    python3 -m bpo_megatron.gpu_smoke --out "$OUT/kit" --timeout 200 \
        --checks logprobs_kernel,rollout_decode,engine_replay ;;
  rest)
    python3 -m bpo_megatron.gpu_smoke --out "$OUT/kit" --timeout 240 \
        --checks trainer_step,ipc_weights,trainer_offload,driver_payloads,rl_throughput ;;
  *) echo "round.sh: part must be new or rest, got $PART" >&2; exit 2 ;;
esac
