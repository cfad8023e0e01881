#!/usr/bin/env bash
# One GPU visit's main run, on a GPU machine without a package registry: install the bundle brought
# along once, then, ordered by value and each part time-boxed, measure what the goals of the work in
# hand are judged by, then check the rest, all within ROUND_S seconds (default 465: one run of at
# most 8 minutes). A part cut short keeps what it wrote; a part with no time left is reported as not
# run. The report (tools' round_report) states which goals hold, or by how much each misses.
#
#   1. install      the bundle's wheels and Ray (its head staged by tools/gpu/stage.sh)
#   2. kit (goals)  KIT_GOALS: rl_loop (4 steps: steady-state step, tokens/s per GPU, the push),
#                   train_fast_paths (MFU at 32,768-position micro-batches, the 30B slice's layer MFU),
#                   rollout_decode (HBM share at RL-shaped contexts, top-p's cost)
#   3. cuda_tests   the CUDA-only tests (the test files with a CUDA skip, the tests named for CUDA)
#   4. kit (rest)   KIT_REST: every other check of the kit, most changed first
#
# The trainer's layer spec: the kit trains the local spec (model.layer_spec: local, the supported path);
# trainer_step trains transformer-engine's beside it where transformer-engine is installed here, and
# the round prints and reports which specs it trained ("[round] layer specs trained: ...").
#
# Budgets (seconds, caps) from the last run (docs/gpu-validation/h200-2026-11-28*.md; the table in
# docs/gpu-validation.md, "The next GPU visit"). Compile caches (TORCHINDUCTOR_CACHE_DIR,
# TRITON_CACHE_DIR) live under OUT/compile-cache while the round runs, so every check's process and
# Ray's workers share them; a cache brought along (COMPILE_CACHE_IN, default .gpu-compile-cache.tar.gz)
# is unpacked there first, and the round leaves OUT/compile-cache.tar.gz to bring next time (when it
# packs to ≤ 16 MiB and OUT holds no more than MAX_FILES files with it).
#
# What comes back, flat in OUT (at most MAX_FILES = 8 files, what a device run returns): <stem>.md and
# .json (the report, <stem> = <device>-<date>, e.g. h200-2026-12-01), <stem>-raw.tar.gz (the parts'
# own outputs and the kit's reports), <stem>-<trace>.json.gz (each profiler trace the checks wrote),
# compile-cache.tar.gz. The .md goes to docs/gpu-validation/, the rest to tools/gpu/records/
# (the cache to the repository root as .gpu-compile-cache.tar.gz, never committed).
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
#   KIT_GOALS=a,b KIT_REST=c CUDA_TESTS=0 ROUND_S=300 bash tools/gpu/round.sh OUT   (a later visit's leftovers)
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
COMPILE_CACHE_IN="${COMPILE_CACHE_IN:-.gpu-compile-cache.tar.gz}"
MAX_FILES=8
CACHE_MAX_MIB=16
PY="${PYTHON:-python3}"   # the GPU image's; on a CPU machine with .venv (a dry run), .venv's
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
INSTALL_S=30                           # measured 3–4 s
CUDA_TESTS_S=75                        # measured 23–35 s (14 tests); the fused sampler's triton compiles add ≈ 20 s
CUDA_TESTS="${CUDA_TESTS:-1}"
KIT_GOALS=${KIT_GOALS-rl_loop,train_fast_paths,rollout_decode}
KIT_REST=${KIT_REST-trainer_offload,ipc_weights,driver_payloads,trainer_step,engine_replay,fp8_rollout,rl_throughput,logprobs_kernel}
# each check's cap: measured on 2026-11-28 (H200) plus what this round adds, with room (a slow CPU's dry
# run may pass larger ones: KIT_BUDGETS=rl_loop=600,...); trainer_step's covers a second actor, transformer-
# engine's layer spec, where transformer-engine is installed
KIT_BUDGETS=${KIT_BUDGETS:-rl_loop=240,train_fast_paths=95,rollout_decode=100,trainer_offload=30,ipc_weights=30,driver_payloads=40,trainer_step=45,engine_replay=25,fp8_rollout=30,rl_throughput=55,logprobs_kernel=20}

T0=$(date +%s)
left() { echo $((ROUND_S - ($(date +%s) - T0))); }
cap() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }
rm -rf "$OUT/kit" "$OUT/kit-rest" "$OUT/compile-cache" "$WORK"   # what an earlier round left there
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

# compile caches: one place for every process of the round (checks, Ray's workers), warm if brought along
CACHE="$OUT/compile-cache"
mkdir -p "$CACHE/inductor" "$CACHE/triton"
export TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor" TRITON_CACHE_DIR="$CACHE/triton"
cache_note="compile caches under OUT/compile-cache, cold"
if [ -f "$COMPILE_CACHE_IN" ] && tar -xzf "$COMPILE_CACHE_IN" -C "$CACHE" 2>/dev/null; then
  cache_note="compile caches under OUT/compile-cache, warmed from $COMPILE_CACHE_IN ($(du -sh "$CACHE" | cut -f1))"
fi

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
for p in ('megatron-core', 'transformer-engine', 'transformers', 'ray', 'jsonschema', 'math-verify'):
    try: print(p, m.version(p), end='; ')
    except m.PackageNotFoundError: print(p, 'missing', end='; ')" 2>&1 | sed 's/; $//')
record install "$INSTALL_S" $(($(date +%s) - start)) "$status" "${#wheels[@]} wheels into $SITE; $note; $imports; $cache_note"
echo "[round] install: exit $status in $(($(date +%s) - start)) s; $note; $imports; $cache_note"

# ---- the kit: CHECKS in order, each within its budget and the round's time left; its report in OUT/PART
kit() {
  local part="$1" checks="$2" start limit status
  if [ -z "$checks" ]; then return; fi
  start=$(date +%s)
  limit=$(left)
  if [ "$limit" -lt 10 ]; then
    record "$part" 0 0 "not run" "$checks: no time left of ${ROUND_S} s"
    echo "[round] $part: not run (no time left)"
    return
  fi
  timeout $((limit + 15)) "$PY" -m bpo_megatron.gpu_smoke --out "$OUT/$part" --workdir "$WORK/kit" --device "$DEVICE" \
      --checks "$checks" --budgets "$KIT_BUDGETS" --total "$limit" 2>&1 | tee "$OUT/$part.txt" | grep --line-buffered "^\[gpu-smoke\]"
  status=${PIPESTATUS[0]}
  record "$part" "$limit" $(($(date +%s) - start)) "$status" "$checks"
}

# ---- 2. what the goals are judged by
kit kit "$KIT_GOALS"

# ---- 3. the CUDA-only tests: the test files with a CUDA skip, the tests named for CUDA
if [ "$CUDA_TESTS" = 1 ]; then
  start=$(date +%s)
  files=$(grep -l "skipif(not torch.cuda.is_available()" tests/test_*.py | tr '\n' ' ')
  limit=$(cap $CUDA_TESTS_S)
  if [ "$limit" -lt 10 ]; then
    record cuda_tests 0 0 "not run" "no time left of ${ROUND_S} s"
  else
    timeout "$limit" "$PY" -m pytest -q -p no:cacheprovider -rs -k cuda $files > "$OUT/cuda_tests.txt" 2>&1
    status=$?
    [ $status = 124 ] && echo "[round] the CUDA tests did not finish within ${limit} s" >> "$OUT/cuda_tests.txt"
    record cuda_tests "$CUDA_TESTS_S" $(($(date +%s) - start)) "$status" "pytest -k cuda $files"
    echo "[round] cuda tests: exit $status in $(($(date +%s) - start)) s: $(tail -1 "$OUT/cuda_tests.txt")"
  fi
fi

# ---- 4. the rest of the kit
kit kit-rest "$KIT_REST"
# which trainer layer specs ran: trainer_step trains transformer-engine's beside the local spec where
# transformer-engine is installed here (without it, the local spec alone); the report says so too
specs=$("$PY" -c "import json, sys
for part in ('kit', 'kit-rest'):
    try: checks = json.load(open(f'$OUT/{part}/report.json'))['checks']
    except (OSError, ValueError, KeyError): continue
    for c in checks:
        if c['name'] == 'trainer_step': print(c['numbers'].get('layer_specs', '?')); sys.exit()
print('none (trainer_step did not run)')" 2>/dev/null)
echo "[round] layer specs trained: ${specs:-unknown}"

# ---- the report to commit, and what it was built from in one archive beside it
"$PY" -m bpo_megatron.gpu_smoke.round_report "$OUT" --device "$DEVICE"
report=$(ls -t "$OUT"/*.md 2>/dev/null | head -1)
stem=$(basename "${report:-$OUT/$DEVICE-unknown.md}" .md)
raw=(parts.tsv gpu.txt install.txt cuda_tests.txt kit.txt kit kit-rest.txt kit-rest)
present=()
for name in "${raw[@]}"; do [ -e "$OUT/$name" ] && present+=("$name"); done
if [ ${#present[@]} -gt 0 ] && tar -czf "$OUT/$stem-raw.tar.gz" -C "$OUT" "${present[@]}"; then
  (cd "$OUT" && rm -rf "${present[@]}")
fi
# the profiler traces the checks wrote, each named for the round (the train_fast_paths ones: train-<model>-<size>)
if [ -d "$WORK/kit/traces" ]; then
  for trace in "$WORK/kit/traces"/*; do [ -f "$trace" ] && cp "$trace" "$OUT/$stem-$(basename "$trace")"; done
fi
# the compile caches, packed to bring along next time if they fit what a run returns
files=$(find "$OUT" -maxdepth 1 -type f | wc -l)
tar -czf "$WORK/compile-cache.tar.gz" -C "$CACHE" . 2>/dev/null
size_mib=$(( $(stat -c %s "$WORK/compile-cache.tar.gz" 2>/dev/null || echo 0) / 1048576 ))
if [ -z "$(find "$CACHE" -type f | head -1)" ]; then
  echo "[round] compile caches: nothing was compiled"
elif [ "$size_mib" -le "$CACHE_MAX_MIB" ] && [ $((files + 1)) -le "$MAX_FILES" ]; then
  mv "$WORK/compile-cache.tar.gz" "$OUT/compile-cache.tar.gz"
  echo "[round] compile caches: OUT/compile-cache.tar.gz (${size_mib} MiB; bring it along next time as $COMPILE_CACHE_IN)"
else
  echo "[round] compile caches not kept: ${size_mib} MiB packed (cap ${CACHE_MAX_MIB}), $files files in OUT (cap $MAX_FILES)"
fi
rm -rf "$CACHE" "$WORK"
files=$(find "$OUT" -type f | wc -l)
[ "$files" -gt "$MAX_FILES" ] && echo "[round] warning: OUT holds $files files; a device run returns $MAX_FILES" >&2
echo "[round] done in $(($(date +%s) - T0)) s: $(cd "$OUT" && ls | tr '\n' ' ')"
