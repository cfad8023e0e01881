#!/usr/bin/env bash
# Create .venv with everything the CPU path needs (idempotent: a second run only re-checks).
# Usage: bash tools/setup.sh            -> .venv with the package (editable) and test tools
#        bash tools/setup.sh --tests    -> .venv-sglang (below), then .venv: everything the test
#                                          suite runs, the SGLang contract tests included
#        bash tools/setup.sh --sglang   -> .venv-sglang: SGLang 0.5.23's own code for the contract
#                                          tests (tests/sglang_contract; they skip without it)
#        bash tools/setup.sh --megatron-newest -> .megatron-newest: megatron-core 0.19.2 (and the
#                                          triton it imports) to put before .venv's 0.16.1 with
#                                          PYTHONPATH, for the Megatron tests under the newest version
#        bash tools/setup.sh --transformers-oldest -> .transformers-oldest: transformers 5.19.0 (what
#                                          SGLang 0.5.23 pins), for the tests that use transformers
#        bash tools/setup.sh --torch-oldest -> .torch-oldest: torch 2.11.0 (the oldest the package
#                                          admits; PyPI's CUDA 13 build, what the GPU image runs) for
#                                          tools/check_torch_names.py and tests/test_torch_window.py.
#                                          It imports on a CPU machine with the CUDA 13 libraries of
#                                          .venv-sglang (built first if missing), linked in as
#                                          .torch-oldest/nvidia, where torch looks for them
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

# new_venv DIR INPUT_FILES...: exit 0 at once when DIR was built from these exact files;
# otherwise create DIR afresh (PIP then installs into it; finish_venv stamps it).
new_venv() {
  VENV="$1"
  shift
  STAMP="$VENV/.bpo-setup-stamp"
  WANT="$(cat "$@" | sha256sum | cut -d' ' -f1)"
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    echo "[setup] $VENV is up to date"
    exit 0
  fi
  echo "[setup] creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
  "${PIP[@]}" install --upgrade pip
}

finish_venv() {
  echo "$WANT" > "$STAMP"
  echo "[setup] done: $("$VENV/bin/python" -W ignore -c "$1")"
}

if [ "${1:-}" = "--tests" ]; then
  bash "$0" --sglang
  shift
fi

if [ "${1:-}" = "--sglang" ]; then
  # SGLang pins torch 2.14.1 and transformers 5.19.0, the trainer's environment torch 2.13 and
  # transformers 5.23: the two live apart. Importing sglang.srt on a CPU needs a torchvision
  # built for the same torch.
  new_venv .venv-sglang tools/sglang-contract-requirements.txt tools/constraints-sglang.txt
  "${PIP[@]}" install -c tools/constraints-sglang.txt torch torchvision
  "${PIP[@]}" install -c tools/constraints-sglang.txt --no-deps sglang
  "${PIP[@]}" install -c tools/constraints-sglang.txt -r tools/sglang-contract-requirements.txt
  finish_venv "import importlib.metadata as m, sglang.srt.entrypoints.http_server, \
sglang.srt.managers.scheduler_components.weight_updater; print('sglang', m.version('sglang'), 'torch', m.version('torch'))"
  exit 0
fi

# overlay DIR CONSTRAINTS IMPORT [LINK]: install the packages pinned in CONSTRAINTS (no dependencies)
# into DIR, to put before .venv's own with PYTHONPATH, and link the directory LINK into it; a second
# run with the same pins does nothing.
overlay() {
  TARGET="$1"
  WANT="$(cat "$2" | sha256sum | cut -d' ' -f1)"
  if [ -f "$TARGET/.bpo-setup-stamp" ] && [ "$(cat "$TARGET/.bpo-setup-stamp")" = "$WANT" ]; then
    echo "[setup] $TARGET is up to date"
    exit 0
  fi
  [ -x .venv/bin/python ] || { echo "[setup] build .venv first: bash tools/setup.sh" >&2; exit 1; }
  echo "[setup] installing $(grep -v '^#' "$2" | tr '\n' ' ')into $TARGET"
  rm -rf "$TARGET"
  .venv/bin/python -m pip --disable-pip-version-check -q install --no-deps --ignore-requires-python \
      --target "$TARGET" -r "$2"
  [ -z "${4:-}" ] || ln -s "$(realpath --relative-to="$TARGET" "$4")" "$TARGET/"
  echo "$WANT" > "$TARGET/.bpo-setup-stamp"
  echo "[setup] done: $(PYTHONPATH=$TARGET .venv/bin/python -W ignore -c "$3")"
  exit 0
}

if [ "${1:-}" = "--megatron-newest" ]; then
  # 0.17+ declare Python >= 3.12 but run on this Python 3.11 (their Megatron tests pass); they
  # import triton at module level, which the CPU torch wheel does not bring.
  overlay .megatron-newest tools/constraints-megatron-newest.txt 'import megatron.core as m; print("megatron-core", m.__version__)'
fi

if [ "${1:-}" = "--transformers-oldest" ]; then
  # the oldest transformers the package admits: the one SGLang 0.5.23 pins
  overlay .transformers-oldest tools/constraints-transformers-oldest.txt 'import transformers as t; print("transformers", t.__version__)'
fi

if [ "${1:-}" = "--torch-oldest" ]; then
  # PyPI has no CPU build of torch 2.11 for Linux; its CUDA 13 build loads its CUDA libraries at
  # import (a driver is not needed). torch 2.14.1 in .venv-sglang brings CUDA 13 libraries of the same
  # major versions: .torch-oldest/nvidia links to them. CUDA builds also hold the CUDA-only names
  # (torch._C._host_emptyCache, ProcessGroupNCCL) that a CPU build lacks.
  bash "$0" --sglang
  overlay .torch-oldest tools/constraints-torch-oldest.txt 'import torch; print("torch", torch.__version__)' \
      "$(.venv-sglang/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia"
fi

new_venv .venv pyproject.toml tools/constraints-cpu.txt
# torch first and exactly: a range would let pip choose a multi-GB CUDA build.
echo "[setup] installing torch (CPU) and megatron-core"
"${PIP[@]}" install -c tools/constraints-cpu.txt torch megatron-core
echo "[setup] installing bpo-megatron (editable) with test tools and the experiment trackers"
"${PIP[@]}" install -c tools/constraints-cpu.txt -e ".[dev,trackers]"
"$VENV/bin/python" -m pip check
finish_venv "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
