#!/usr/bin/env bash
# One GPU visit's main run: install the bundle brought along once, then run, ordered by value and each
# part time-boxed, everything the GPU validation has: the CUDA-only tests, then every check of the
# kit (python -m bpo_megatron.gpu_smoke) with its own budget, all within ROUND_S seconds (default
# 465: one run of at most 8 minutes). A part cut short keeps what it wrote; a part with no time
# left is reported as not run. The report to commit: OUT/<device>-<date>.md and .json (e.g.
# OUT/h100-2026-12-01.md), ready to copy to docs/gpu-validation/; beside them OUT/traces/ and
# OUT/round-raw.tar.gz (the parts' own outputs the report was built from).
#
# A visit to a GPU machine without a package registry is two runs there, one right after the other
# (the bundle built here first: bash tools/gpu/build_bundle.sh):
#   1. bash tools/gpu/stage.sh        with .gpu-bundle-stage brought along (seconds)
#   2. bash tools/gpu/round.sh OUT    with .gpu-bundle brought along (at most 8 minutes)
# Without the first run (Ray's head not under /tmp) it says so and runs everything else; rl_loop then
# reports "not run: Ray not staged".
#
# --device cpu: a dry run on a CPU machine: the same steps, the kit's CPU profile, the CUDA tests
# run with CUDA hidden (so reported as skipped); the bundle is installed when .gpu-bundle exists.
# Usage: bash tools/gpu/round.sh OUT_DIR [--device cpu]
set -uo pipefail
OUT="${1:?usage: tools/gpu/round.sh OUT_DIR [--device cpu]}"
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
shift
cd "$(dirname "$0")/../.."
DEVICE=cuda
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="${2:?--device needs cuda or cpu}"; shift 2 ;;
    *) echo "usage: tools/gpu/round.sh OUT_DIR [--device cpu]" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "round.sh: --device must be cuda or cpu, got $DEVICE" >&2; exit 2 ;; esac

ROUND_S="${ROUND_S:-465}"
BUNDLE="${BUNDLE:-.gpu-bundle}"
STAGE_DIR="${STAGE_DIR:-/tmp/bpo-gpu-stage}"
SITE="${SITE:-/tmp/bpo-gpu-site}"
WORK="${WORK:-/tmp/bpo-round-work}"   # checkpoints and scratch: never under OUT (it comes back)
PY="${PYTHON:-python3}"   # the GPU image's; on a CPU machine with .venv (a dry run), .venv's
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
# Order: what has not yet passed on a GPU first, then what changed most. Budgets (seconds, caps) from the last run
# (docs/gpu-validation/h200-2026-11-28.md); expected times in docs/gpu-validation.md ("The next GPU visit").
INSTALL_S=60
CUDA_TESTS_S=75
KIT_ORDER=${KIT_ORDER:-rollout_decode,fp8_rollout,rl_loop,driver_payloads,trainer_offload,ipc_weights,train_fast_paths,rl_throughput,engine_replay,trainer_step,logprobs_kernel}
KIT_BUDGETS=rollout_decode=75,fp8_rollout=60,rl_loop=220,driver_payloads=40,trainer_offload=20,ipc_weights=30,train_fast_paths=45,rl_throughput=55,engine_replay=25,trainer_step=25,logprobs_kernel=20

T0=$(date +%s)
left() { echo $((ROUND_S - ($(date +%s) - T0))); }
cap() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }
rm -rf "$OUT/kit" "$WORK"
mkdir -p "$OUT" "$WORK"
PARTS="$OUT/parts.tsv"
printf 'part\tlimit_s\tseconds\tstatus\tnote\n' > "$PARTS"
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$PARTS"; }
if [ "$DEVICE" = cpu ]; then export CUDA_VISIBLE_DEVICES=""; fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
else
  echo "no nvidia-smi" > "$OUT/gpu.txt"
fi
echo "[round] $DEVICE, ${ROUND_S} s; $(head -1 "$OUT/gpu.txt")"

# ---- 1. install: the bundle's wheels and Ray (its head staged by the first run, its tail brought along to this one)
start=$(date +%s)
wheels=()
note=""
pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [ ! -d "$BUNDLE" ]; then
  note="no $BUNDLE: this interpreter's own packages"
elif [ "$pyver" != 3.12 ]; then
  note="$BUNDLE holds Python 3.12 wheels, $PY is $pyver: its own packages"
else
  wheels=("$BUNDLE"/*.whl)
fi
if "$PY" -c "import ray" 2>/dev/null; then
  note="$note${note:+; }Ray $("$PY" -c 'import ray; print(ray.__version__)') already installed"
elif [ ${#wheels[@]} -gt 0 ] && [ -f "$BUNDLE/ray-wheel.manifest" ]; then
  RAY_WHEEL=$(sed -n 's/^wheel [0-9a-f]* //p' "$BUNDLE/ray-wheel.manifest")
  want=$(sed -n 's/^wheel \([0-9a-f]*\) .*/\1/p' "$BUNDLE/ray-wheel.manifest")
  parts=()
  missing=""
  while read -r kind sum name folder; do
    [ "$kind" = part ] || continue
    if [ -f "$BUNDLE/$name" ]; then parts+=("$BUNDLE/$name")
    elif [ -f "$STAGE_DIR/$name" ] && [ "$(sha256sum "$STAGE_DIR/$name" | cut -d' ' -f1)" = "$sum" ]; then
      parts+=("$STAGE_DIR/$name")
    else missing="$missing $name"; fi
  done < "$BUNDLE/ray-wheel.manifest"
  if [ -n "$missing" ]; then
    export BPO_RAY_STAGE=missing
    note="$note${note:+; }Ray not staged (missing under $STAGE_DIR:$missing): the first run, bash tools/gpu/stage.sh with .gpu-bundle-stage brought along, did not run on this machine; rl_loop will not run"
    echo "[round] Ray not staged: $STAGE_DIR lacks$missing (first run: bash tools/gpu/stage.sh, with .gpu-bundle-stage brought along); running everything else" >&2
  else
    mkdir -p "$STAGE_DIR"
    cat "${parts[@]}" > "$STAGE_DIR/$RAY_WHEEL"
    if [ "$(sha256sum "$STAGE_DIR/$RAY_WHEEL" | cut -d' ' -f1)" = "$want" ]; then
      wheels+=("$STAGE_DIR/$RAY_WHEEL")
      note="$note${note:+; }$RAY_WHEEL joined from ${#parts[@]} parts, sha256 verified"
    else
      export BPO_RAY_STAGE=missing
      note="$note${note:+; }Ray's joined wheel does not match its sha256 (stale parts under $STAGE_DIR?): not installed"
      echo "[round] Ray's joined wheel does not match its sha256; not installed" >&2
    fi
  fi
else
  export BPO_RAY_STAGE=missing
  note="$note${note:+; }no Ray: not installed here and no $BUNDLE/ray-wheel.manifest"
fi
status=0
if [ ${#wheels[@]} -gt 0 ]; then
  limit=$(cap $INSTALL_S)
  timeout "$limit" "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" > "$OUT/install.txt" 2>&1
  status=$?
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# this work tree first (the driver, the kit's checks and Ray's workers import the same code)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
imports=$("$PY" -c "import importlib.metadata as m
for p in ('megatron-core', 'transformers', 'ray', 'jsonschema', 'math-verify'):
    try: print(p, m.version(p), end='; ')
    except m.PackageNotFoundError: print(p, 'missing', end='; ')" 2>&1 | sed 's/; $//')
record install "$INSTALL_S" $(($(date +%s) - start)) "$status" "${#wheels[@]} wheels into $SITE; $note; $imports"
echo "[round] install: exit $status in $(($(date +%s) - start)) s; $note; $imports"

# ---- 2. the CUDA-only tests: the test files with a CUDA skip, the tests named for CUDA
start=$(date +%s)
files=$(grep -l "skipif(not torch.cuda.is_available()" tests/test_*.py | tr '\n' ' ')
limit=$(cap $CUDA_TESTS_S)
timeout "$limit" "$PY" -m pytest -q -p no:cacheprovider -rs -k cuda $files > "$OUT/cuda_tests.txt" 2>&1
status=$?
[ $status = 124 ] && echo "[round] the CUDA tests did not finish within ${limit} s" >> "$OUT/cuda_tests.txt"
record cuda_tests "$CUDA_TESTS_S" $(($(date +%s) - start)) "$status" "pytest -k cuda $files"
echo "[round] cuda tests: exit $status in $(($(date +%s) - start)) s: $(tail -1 "$OUT/cuda_tests.txt")"

# ---- 3. the kit: every check, in KIT_ORDER, each within its budget and the round's time left
start=$(date +%s)
limit=$(left)
timeout $((limit + 15)) "$PY" -m bpo_megatron.gpu_smoke --out "$OUT/kit" --workdir "$WORK/kit" --device "$DEVICE" \
    --checks "$KIT_ORDER" --budgets "$KIT_BUDGETS" --total "$limit" 2>&1 | tee "$OUT/kit.txt" | grep "^\[gpu-smoke\]"
status=${PIPESTATUS[0]}
record kit "$limit" $(($(date +%s) - start)) "$status" "$KIT_BUDGETS"
# the profiler traces the checks wrote (train_fast_paths: one micro-batch's step), to commit beside the report
if [ -d "$WORK/kit/traces" ]; then mkdir -p "$OUT/traces" && cp "$WORK/kit/traces/"* "$OUT/traces/"; fi

# ---- 4. the report to commit
"$PY" -m bpo_megatron.gpu_smoke.round_report "$OUT" --device "$DEVICE"
# what the report was built from, in one archive: the report, its JSON, the archive and the traces are
# then the few files to take home (a machine's way back may bound how many files a run returns)
raw=(parts.tsv gpu.txt install.txt cuda_tests.txt kit.txt kit)
present=()
for name in "${raw[@]}"; do [ -e "$OUT/$name" ] && present+=("$name"); done
if [ ${#present[@]} -gt 0 ] && tar -czf "$OUT/round-raw.tar.gz" -C "$OUT" "${present[@]}"; then
  (cd "$OUT" && rm -rf "${present[@]}")
fi
rm -rf "$WORK"
echo "[round] done in $(($(date +%s) - T0)) s"
