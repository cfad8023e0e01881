"""Experiment trackers: TensorBoard, Weights & Biases and MLflow, each mirroring ``metrics.jsonl``.

``logging.trackers`` names them (:data:`TRACKERS`); each is a :class:`Tracker` in its own module,
imported only when a run asks for it, so none of their packages is needed otherwise. Every tracker
gets the run's identity (name = the run directory's name, the directory, the git commit of the
source that runs), its resolved config, and every record of ``metrics.jsonl`` under the same step
(:mod:`bpo_megatron.observability.trackers.mirror` feeds them, once each, across resumes).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from bpo_megatron.registry import LazyRegistry

# tracker name -> its class
TRACKERS = LazyRegistry({
    "tensorboard": "bpo_megatron.observability.trackers.tensorboard:TensorBoardTracker",
    "wandb": "bpo_megatron.observability.trackers.wandb:WandbTracker",
    "mlflow": "bpo_megatron.observability.trackers.mlflow:MlflowTracker",
}, unknown="logging.trackers: no tracker {name!r}; there are {sorted_listed}")


class TrackerWarning(UserWarning):
    """A tracker could not start or failed while logging; the run goes on without it."""


def tracker_class(name: str) -> type["Tracker"]:
    return TRACKERS.load(name)


def unavailable(name: str) -> str | None:
    """Why tracker ``name``'s package cannot be used here (``"is not installed"``, ``"does not
    import (…)"``), or None when it imports.

    The package is imported, not only looked up: a run imports it at its start, where a failure
    is only a warning, and a lookup alone takes a directory of the package's name (a leftover
    ``wandb/`` in the working directory, or what an uninstall left behind) for the package."""
    import importlib
    import importlib.util

    package = tracker_class(name).package
    if not package:
        return None
    if importlib.util.find_spec(package) is None:
        return "is not installed"
    try:
        module = importlib.import_module(package)
    except Exception as exc:  # noqa: BLE001 - whatever the package's import raises is the reason
        return f"does not import ({type(exc).__name__}: {exc})"
    if getattr(module, "__file__", None) is None:  # a namespace package: directories, no package
        where = ", ".join(str(path) for path in getattr(module, "__path__", []))
        return f"is not installed (what the import finds is only a directory of that name: {where})"
    return None


def missing_package(name: str) -> str | None:
    """Why tracker ``name`` cannot start here (:func:`unavailable`), naming the setting and the
    fix, or None."""
    if (why := unavailable(name)) is None:
        return None
    package = tracker_class(name).package
    return f"logging.trackers lists {name}, but its package {package!r} {why}: pip install {package}, or drop {name} from logging.trackers"


@dataclass(frozen=True)
class TrackedRun:
    """What every tracker is told about the run."""

    run_dir: Path  # absolute
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config (config.yaml's tree)
    settings: Any = None  # the LoggingConfig (W&B project, MLflow experiment and URI)
    resume_after: int | None = None  # the checkpointed step this attempt resumes from; None: a fresh start
    git_commit: str | None = None

    @property
    def name(self) -> str:
        return self.run_dir.name

    @classmethod
    def of(cls, run_dir: str | Path, *, config: dict | None, settings: Any, resume_after: int | None) -> "TrackedRun":
        return cls(run_dir=Path(run_dir).resolve(), config=dict(config or {}), settings=settings,
                   resume_after=resume_after, git_commit=source_commit())


class Tracker:
    """One tracker's run, started (or continued) in ``__init__``.

    ``recorded``: the ledger entry of the previous attempt (``run_id`` and where that run lives),
    empty for a run this tracker has not seen. ``continued``: whether this attempt continues the
    run that holds the previous attempt's points (False: it starts empty). ``record()``: what to
    write into the ledger so the next attempt continues this run. ``package``: what must be
    installed for it to start (checked before a run that lists it starts). ``rewinds``: the tracker drops
    the points of steps after ``run.resume_after`` itself (TensorBoard's purge); the others cannot
    delete a point, so they keep what an interrupted attempt logged past its checkpoint.
    """

    rewinds: ClassVar[bool] = False
    package: ClassVar[str] = ""  # the module the tracker needs, and the pip package that brings it
    continued: bool = False

    def __init__(self, run: TrackedRun, recorded: dict[str, Any]) -> None:
        raise NotImplementedError

    def record(self) -> dict[str, Any]:
        return {}

    def log(self, step: int, metrics: dict[str, float], time: float) -> None:
        raise NotImplementedError

    def close(self, *, failed: bool) -> None:
        raise NotImplementedError


def flat_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"steps": 3}}`` -> ``{"train.steps": 3}`` (for trackers whose params are flat)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def source_commit() -> str | None:
    """The git commit of the bpo_megatron source that runs, when it runs from a git checkout (an
    installed package has none: a repository around site-packages is not its source)."""
    import bpo_megatron

    root = Path(bpo_megatron.__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None
