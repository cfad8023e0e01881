"""Checksums of a checkpoint's files: written at save, verified before a checkpoint is used.

``checksums.json`` maps every file of a step directory (relative path) to its size and SHA-256.
Hashing is split over the ranks that saved (each hashes every world-size-th file), and the
verification over threads (hashlib releases the GIL on large buffers), so a checkpoint of
hundreds of GB is checked at disk speed.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "checksums.json"
_BLOCK = 8 * 1024 * 1024


def files_of(directory: Path) -> list[str]:
    """Relative paths of every file under ``directory`` but the manifest, sorted."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def digest(path: Path) -> dict[str, int | str]:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            sha.update(block)
    return {"bytes": path.stat().st_size, "sha256": sha.hexdigest()}


def digests(directory: Path, names: list[str]) -> dict[str, dict[str, int | str]]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(names, pool.map(lambda name: digest(directory / name), names)))


def write_manifest(directory: Path, entries: dict[str, dict[str, int | str]]) -> None:
    (directory / MANIFEST).write_text(json.dumps(dict(sorted(entries.items())), indent=1))


def problems(directory: Path, share: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with the files of ``directory`` against its manifest (empty: intact, or no
    manifest to check against — a checkpoint written before checksums existed). ``share``
    ``(i, n)`` checks only every n-th file from the i-th (ranks split the work)."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return []
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        return [f"{manifest_path} is damaged (not valid JSON)"]
    index, count = share
    names = sorted(manifest)[index::count]
    found = [f"{directory / name} is missing" for name in names if not (directory / name).is_file()]
    present = [name for name in names if (directory / name).is_file()]
    sized = []
    for name in present:
        size = (directory / name).stat().st_size
        if size == manifest[name]["bytes"]:
            sized.append(name)
        else:
            found.append(f"{directory / name} has {size} bytes where {manifest[name]['bytes']} were written")
    for name, entry in digests(directory, sized).items():
        if entry["sha256"] != manifest[name]["sha256"]:
            found.append(f"{directory / name} does not match its checksum (its bytes changed after the save)")
    return found
