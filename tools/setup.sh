#!/usr/bin/env bash
# Create .venv with everything the CPU path needs (idempotent: a second run only re-checks).
# Usage: bash tools/setup.sh            -> .venv with the package (editable) and test tools
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=.venv
STAMP="$VENV/.bpo-setup-stamp"
want="$(cat pyproject.toml tools/constraints-cpu.txt | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "[setup] .venv is up to date"
  exit 0
fi
echo "[setup] creating $VENV with $("$PYTHON" --version)"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# torch first and exactly: a range would let pip choose a multi-GB CUDA build.
echo "[setup] installing torch (CPU) and megatron-core"
"${PIP[@]}" install -c tools/constraints-cpu.txt torch megatron-core
echo "[setup] installing bpo-megatron (editable) with test tools"
"${PIP[@]}" install -c tools/constraints-cpu.txt -e ".[dev]"
"$VENV/bin/python" -m pip check
echo "$want" > "$STAMP"
echo "[setup] done: $("$VENV/bin/python" -W ignore -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)')"
