#!/usr/bin/env bash
# Build, on this (CPU) machine, the wheels the GPU machine needs: Python 3.12 manylinux wheels of
# tools/gpu/bundle-requirements.txt plus this package, into .gpu-bundle/ (git-ignored; pass it as
# a carried path). Prints the bundle's size and refuses one over the 64 MiB a call can carry.
# Usage: bash tools/gpu/build_bundle.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-.gpu-bundle}"
LIMIT_MIB=64
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
rm -rf "$OUT"
mkdir -p "$OUT"
"$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$OUT" -r tools/gpu/bundle-requirements.txt
"$PY" -m pip wheel --disable-pip-version-check -q --no-deps --no-build-isolation -w "$OUT" . >/dev/null
bytes=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
echo "[gpu-bundle] $(ls "$OUT" | wc -l) wheels in $OUT, $((bytes / 1024 / 1024)) MiB ($bytes bytes):"
ls -1 "$OUT" | sed 's/^/  /'
if [ "$bytes" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
  echo "[gpu-bundle] error: over the ${LIMIT_MIB} MiB a device call can carry" >&2
  exit 1
fi
