"""Run outputs: metrics as JSONL (mirrored to the experiment trackers), one readable line per step."""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

# What the one-line summary shows, in order: (metric, label, format)
SUMMARY = (
    ("reward_mean", "reward", ".3f"),
    ("reward/errors", "reward errors", ".0f"),  # a user reward's failed calls and invalid values (scored 0)
    ("reward/invalid", "invalid", ".0f"),
    ("loss", "loss", ".4f"),
    ("clip_frac", "masked", ".3f"),
    ("weight_mean", "w", ".3f"),
    ("weight_max", "w_max", ".2f"),
    ("abs_logp_diff_mean", "|Δlogp|", ".2e"),
    ("routing_agreement", "route=", ".3f"),
    ("grad_norm", "gnorm", ".3f"),
    ("time/rollout_s", "rollout", ".1fs"),
    ("time/train_s", "train", ".1fs"),
    ("time/sync_s", "sync", ".1fs"),
)


class MetricsWriter:
    """Appends one record per step to ``metrics.jsonl``, and mirrors it to the experiment trackers.
    A background evaluation's record comes later, under the step it evaluated (see
    :func:`evaluation_only`): a step has its record, then at most one evaluation record.

    ``resume_after``: the step the run resumes from. Records of later steps (and, with None, all
    records: a fresh start) are left over from an interrupted attempt that will be run again, so
    they are dropped first and every step is recorded once. ``keep_records``: how many records the
    file held when that step's checkpoint was saved (its trainer state says); the records after
    them are dropped too, so an evaluation that was still running at the save, and is run again
    on resume, is recorded once.

    ``trackers``: names of :data:`bpo_megatron.observability.trackers.TRACKERS`, each told the
    run's resolved ``config`` (the tree of ``config.yaml``) and ``settings`` (the ``logging``
    section; None: its defaults), and each continuing its own run on a resume (:mod:`~.trackers.mirror`). A tracker
    that cannot start or log is warned about and dropped; the run goes on. ``tensorboard=True``
    adds TensorBoard, for callers from before ``trackers``.
    """

    def __init__(self, run_dir: str | Path, *, trackers: Sequence[str] = (), config: dict | None = None,
                 settings: Any = None, resume_after: int | None = None, keep_records: int | None = None,
                 tensorboard: bool = False) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        dropped = truncate_metrics(run_dir, resume_after, keep=keep_records)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # truncate_metrics dropped a torn last line already
            kept = read_metrics(run_dir) if self.path.is_file() else []
        self._records = len(kept)  # the index in metrics.jsonl of the next record
        names = (*trackers, *(("tensorboard",) if tensorboard and "tensorboard" not in trackers else ()))
        self._trackers = None
        if names:
            from bpo_megatron.observability.config import LoggingConfig
            from bpo_megatron.observability.trackers import TrackedRun
            from bpo_megatron.observability.trackers.mirror import TrackerMirror

            run = TrackedRun.of(run_dir, config=config, settings=settings or LoggingConfig(), resume_after=resume_after)
            self._trackers = TrackerMirror(run, names, kept, dropped)

    @property
    def records(self) -> int:
        """How many records ``metrics.jsonl`` holds (what a checkpoint saved now records)."""
        return self._records

    @property
    def trackers(self) -> tuple[str, ...]:
        """The trackers that receive the records (those that started and have not failed)."""
        return self._trackers.active if self._trackers is not None else ()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        record = {"step": step, "time": time.time(), **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        if self._trackers is not None:
            self._trackers.log(self._records, step, metrics, record["time"])
        self._records += 1

    def close(self, *, failed: bool = False) -> None:
        """``failed``: the run stopped on an error (trackers that keep a status mark their run so).
        Closing again does nothing."""
        if self._trackers is not None:
            self._trackers.close(failed=failed)
            self._trackers = None


def progress_bar(done: int, total: int, width: int = 20) -> str:
    filled = round(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def summary_line(step: int, total: int, metrics: dict[str, float], *, bar: bool = False) -> str:
    parts = [f"{progress_bar(step, total)} step {step}/{total}" if bar else f"step {step}/{total}"]
    for key, label, fmt in SUMMARY:
        if key in metrics:
            unit = "s" if fmt.endswith("s") else ""
            spec = fmt[:-1] if unit else fmt
            sep = "" if label.endswith("=") else " "
            parts.append(f"{label}{sep}{format(metrics[key], spec)}{unit}")
    return " | ".join(parts)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every record of a run. A last line cut short (the driver was killed while writing it) is
    dropped with a warning; a damaged line before it raises naming the line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                warnings.warn(f"{path}:{number}: the last record is incomplete (a write was interrupted); "
                              "it is ignored", stacklevel=2)
                break
            raise ValueError(f"{path}:{number}: not a metrics record ({exc.msg})") from exc
    return records


def truncate_metrics(run_dir: str | Path, after_step: int | None, *, keep: int | None = None) -> list[dict]:
    """Keep only the records of steps up to ``after_step`` (none for None), and with ``keep`` only
    among the first ``keep`` records, atomically; returns the records dropped, in file order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a torn last line is dropped here on purpose
        records = read_metrics(run_dir)
    limit = len(records) if keep is None else keep
    kept = [r for r in records[:limit] if after_step is not None and r["step"] <= after_step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    held = {id(r) for r in kept}
    return [r for r in records if id(r) not in held]


def evaluation_only(record: dict) -> bool:
    """Whether a record holds an evaluation alone (``eval/*`` metrics): the initial policy's, or
    a background evaluation's, written apart from its step's training record."""
    metrics = [key for key in record if key not in ("step", "time")]
    return bool(metrics) and all(key.startswith("eval/") for key in metrics)
