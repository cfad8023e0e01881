#!/usr/bin/env bash
# The first run of a GPU visit (seconds): leave the head, brought along, of Ray's wheel (.gpu-bundle-stage, made by
# tools/gpu/build_bundle.sh) under /tmp, each part checked against the sha256 its manifest records,
# for the second run (tools/gpu/round.sh) to join with the tail that .gpu-bundle brings. Files under /tmp
# outlive a run while the machine stays up between runs.
#   bash tools/gpu/stage.sh    (run on the GPU machine with .gpu-bundle-stage brought along)
set -euo pipefail
cd "$(dirname "$0")/../.."
SRC="${STAGE_SRC:-.gpu-bundle-stage}"
DEST="${STAGE_DIR:-/tmp/bpo-gpu-stage}"
MANIFEST="$SRC/ray-wheel.manifest"
if [ ! -f "$MANIFEST" ]; then
  echo "[stage] error: $MANIFEST is missing: build it here with 'bash tools/gpu/build_bundle.sh' and bring $SRC along" >&2
  exit 1
fi
mkdir -p "$DEST"
staged=0
while read -r kind sum name folder; do
  [ "$kind" = part ] && [ -f "$SRC/$name" ] || continue
  if [ "$(sha256sum "$SRC/$name" | cut -d' ' -f1)" != "$sum" ]; then
    echo "[stage] error: $SRC/$name does not match its sha256 in $MANIFEST (a damaged copy: rebuild the bundle)" >&2
    exit 1
  fi
  cp "$SRC/$name" "$DEST/$name.tmp" && mv "$DEST/$name.tmp" "$DEST/$name"
  staged=$((staged + 1))
done < "$MANIFEST"
cp "$MANIFEST" "$DEST/ray-wheel.manifest"
if [ "$staged" = 0 ]; then
  echo "[stage] error: $SRC holds none of the parts $MANIFEST lists" >&2
  exit 1
fi
echo "[stage] $staged part(s) of $(sed -n 's/^wheel [0-9a-f]* //p' "$MANIFEST") staged in $DEST ($(du -sh "$DEST" | cut -f1)); now: bash tools/gpu/round.sh OUT (bring .gpu-bundle along)"
