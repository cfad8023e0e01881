"""Atomic, resharding checkpoints of the trainer (Megatron-Core distributed checkpointing).

Layout under a checkpoint root::

    root/latest                  name of the newest complete checkpoint ("step-00000012")
    root/step-00000012/          Megatron dist_checkpointing of {"model", "optimizer"}
        trainer_state.json       step, data cursor and anything else the caller passes
        rng/rank-00003.pt        this rank's RNG states (restored only under the same layout)
    root/.partial-step-00000013  a save in progress; never read

A save writes into the ``.partial-`` directory, renames it into place and only then moves the
``latest`` marker (write to a temporary file, fsync, ``os.replace``), so a process killed at any
point leaves the previous checkpoint loadable. Model and optimizer tensors are saved with their
global shapes, so a checkpoint loads under a different TP/EP/PP layout.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

LATEST = "latest"
PARTIAL_PREFIX = ".partial-"
STATE_FILE = "trainer_state.json"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from a root (follows ``latest``) or from a step directory itself."""
    path = Path(path)
    if (path / LATEST).is_file():
        name = (path / LATEST).read_text().strip()
        target = path / name
        if not (target / STATE_FILE).is_file():
            raise FileNotFoundError(f"{path / LATEST} names {name!r}, which is not a complete checkpoint")
        return target
    if (path / STATE_FILE).is_file():
        return path
    raise FileNotFoundError(
        f"no checkpoint at {path}: expected a '{LATEST}' marker or a step directory with {STATE_FILE}"
    )


def latest_step(root: str | Path) -> int | None:
    """Step of the newest complete checkpoint under ``root``, or None."""
    try:
        return int(json.loads((resolve(root) / STATE_FILE).read_text())["step"])
    except FileNotFoundError:
        return None


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _restore_rng(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _has_state(optimizer) -> bool:
    """Whether the optimizer has taken a step (a fresh one has no Adam moments to save)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(len(opt.optimizer.state) for opt in inner)


def _sharded_state(model: torch.nn.Module, optimizer, *, is_loading: bool) -> dict[str, Any]:
    model_state = model.sharded_state_dict(prefix="")
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading)
    return state


def save(root: str | Path, step: int, model: torch.nn.Module, optimizer, trainer_state: dict[str, Any],
         *, layout: dict[str, int], keep_last: int | None = None) -> Path:
    """Collectively save ``model`` (the unwrapped GPTModel chunk) and ``optimizer`` (every rank calls)."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    if optimizer is not None and not _has_state(optimizer):
        optimizer = None  # before the first step there is nothing but the model to save
    final = root / step_dir_name(step)
    partial = root / f"{PARTIAL_PREFIX}{final.name}"
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{PARTIAL_PREFIX}*"):  # left by saves that were killed
            shutil.rmtree(stale, ignore_errors=True)
        partial.mkdir()
    dist.barrier()
    dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False), str(partial))
    (partial / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), partial / "rng" / f"rank-{rank:05d}.pt")
    if rank == 0:
        meta = {"step": step, "layout": layout, "world_size": dist.get_world_size(),
                "optimizer_state": optimizer is not None, **trainer_state}
        _write_atomically(partial / STATE_FILE, json.dumps(meta, indent=2, sort_keys=True))
    dist.barrier()
    if rank == 0:
        if final.exists():  # re-saving a step: the old copy goes only once the new one is whole
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(root)
        _write_atomically(root / LATEST, final.name)
        if keep_last:
            _prune(root, keep_last)
    dist.barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file())
    for old in steps[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load(path: str | Path, model: torch.nn.Module, optimizer, *, layout: dict[str, int]) -> dict[str, Any]:
    """Collectively load a checkpoint (resharding to this layout); returns the trainer state.

    RNG states are restored only when the layout is the one that saved them (otherwise each rank
    keeps the RNG it was seeded with; training uses no dropout, so results do not depend on it).
    """
    from megatron.core import dist_checkpointing

    directory = resolve(path)
    meta = json.loads((directory / STATE_FILE).read_text())
    if not meta.get("optimizer_state", False):
        optimizer = None  # saved before the first step: a fresh optimizer is the right state
    state = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True), str(directory))
    model.load_state_dict(state["model"], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    same_layout = meta.get("layout") == layout and meta.get("world_size") == dist.get_world_size()
    rng_file = directory / "rng" / f"rank-{dist.get_rank():05d}.pt"
    if same_layout and rng_file.is_file():
        _restore_rng(torch.load(rng_file, weights_only=False))
    return meta
