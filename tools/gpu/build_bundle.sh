#!/usr/bin/env bash
# Build, on this (CPU) machine, the wheels a GPU machine without a package registry needs, in two
# folders (both git-ignored; each is what one run on the GPU machine brings along beside the work
# tree, so the tree's files and each folder together must stay under the 64 MiB a run can bring):
#   .gpu-bundle/        Python 3.12 manylinux wheels of tools/gpu/bundle-requirements.txt, this
#                       package, and the tail of Ray's wheel       (second run: tools/gpu/round.sh)
#   .gpu-bundle-stage/  the head of Ray's wheel                      (first run: tools/gpu/stage.sh)
# Ray's cp312 wheel (~76 MiB) is larger than one run may bring along, so it travels in parts: split here
# with `split`, its sha256 and each part's recorded in ray-wheel.manifest (in both folders); the first run
# leaves its part under /tmp, the second run joins the parts, checks the sha256 and installs the wheel.
# Ray's version: the one .venv runs (RAY_VERSION=... to choose another). Refuses a folder over the limit.
# Usage: bash tools/gpu/build_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.gpu-bundle
STAGE=.gpu-bundle-stage
LIMIT_MIB=64
STAGE_PART_MIB=${STAGE_PART_MIB:-46}   # Ray's first part, brought along alone to the first run (with the
# manifest and .gitignore beside it), leaving the work tree (~13 MiB of tracked files: the datasets and experiments ship in it) room to grow
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
DOWNLOAD=("$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all:
  --python-version 3.12 --implementation cp --abi cp312
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

rm -rf "$OUT" "$STAGE"
mkdir -p "$OUT" "$STAGE"
# the stage folder sits outside the repository's .gitignore: it ignores itself, so it never
# travels as an untracked file of the work tree (only when brought along)
echo '*' > "$STAGE/.gitignore"
"${DOWNLOAD[@]}" -d "$OUT" -r tools/gpu/bundle-requirements.txt
"$PY" -m pip wheel --disable-pip-version-check -q --no-deps --no-build-isolation -w "$OUT" . >/dev/null

RAY_VERSION="${RAY_VERSION:-$("$PY" -m pip show ray 2>/dev/null | sed -n 's/^Version: //p')}"
[ -n "$RAY_VERSION" ] || { echo "[gpu-bundle] error: Ray is not installed in $PY; set RAY_VERSION" >&2; exit 1; }
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"${DOWNLOAD[@]}" -d "$TMP" "ray==$RAY_VERSION"
WHEEL="$(cd "$TMP" && ls ray-*.whl)"
(cd "$TMP" && split -b "${STAGE_PART_MIB}M" -d -a 2 "$WHEEL" "$WHEEL.part-")
MANIFEST="$TMP/ray-wheel.manifest"
{
  echo "# $WHEEL in parts, joined in this order by tools/gpu/round.sh; folder: where each part travels"
  echo "wheel $(cd "$TMP" && sha256sum "$WHEEL" | cut -d' ' -f1) $WHEEL"
  first=1
  for part in $(cd "$TMP" && ls "$WHEEL".part-*); do
    folder=$([ $first = 1 ] && echo "$STAGE" || echo "$OUT")
    echo "part $(cd "$TMP" && sha256sum "$part" | cut -d' ' -f1) $part $folder"
    mv "$TMP/$part" "$folder/"
    first=0
  done
} > "$MANIFEST"
cp "$MANIFEST" "$OUT/"
cp "$MANIFEST" "$STAGE/"

status=0
# what travels with every run besides the folder: the tracked and untracked-not-ignored files
tree_bytes=$({ git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s 2>/dev/null \
  | awk '{s += $1} END {print s + 0}')
echo "[gpu-bundle] work tree: $((tree_bytes / 1024 / 1024)) MiB ($tree_bytes bytes)"
for folder in "$OUT" "$STAGE"; do
  bytes=$(du -cb "$folder" | tail -1 | cut -f1)
  echo "[gpu-bundle] $folder: $(ls "$folder" | wc -l) files, $((bytes / 1024 / 1024)) MiB ($bytes bytes):"
  ls -1 "$folder" | sed 's/^/  /'
  if [ $((bytes + tree_bytes)) -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
    echo "[gpu-bundle] error: $folder and the work tree ($(( (bytes + tree_bytes) / 1024 / 1024 )) MiB) are over the" \
      "${LIMIT_MIB} MiB one run on the GPU machine can bring along; lower STAGE_PART_MIB or the tree" >&2
    status=1
  fi
done
exit $status
