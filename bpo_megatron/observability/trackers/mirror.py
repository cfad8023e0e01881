"""Feeding the trackers every record of ``metrics.jsonl`` once, across kills and resumes.

The run directory's ``trackers.json`` (the ledger) says, per tracker, which run of it holds this
run's points (``run_id`` and where it lives) and how many records of ``metrics.jsonl`` (in file
order) that run holds. A resumed attempt writes the same sequence of records as the interrupted
one (the same steps in the same order; ``metrics.jsonl`` keeps the records up to the checkpoint and
the steps after it are run again), so a record's index says whether a tracker has it:

* a tracker continues its recorded run (wandb ``id=..., resume="allow"``, MLflow's run id) and is
  sent only records past what it holds: records ``metrics.jsonl`` kept that it lacks (added to the
  run on a resume, or dropped by a failure in an earlier attempt) when it starts, then the new
  ones. A tracker cannot delete a point, so the steps that an interrupted attempt logged past its
  checkpoint stay as that attempt logged them and the resumed attempt does not log them again
  (a resume recomputes them alike but for clocks and floating-point summation order);
* TensorBoard drops those steps itself (``rewinds``) and gets them again.

A tracker that fails to import, start or log is warned about once (:class:`TrackerWarning`,
naming it and the error) and dropped for the rest of the attempt; its ledger entry stays, so the
next attempt continues its run and fills the gap. A kill between a tracker's write and the ledger's
may repeat that one record in a tracker that keeps points.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Sequence

from bpo_megatron.observability.trackers import TrackedRun, Tracker, TrackerWarning, tracker_class

LEDGER_FILE = "trackers.json"
METADATA = ("step", "time")  # the keys of a metrics.jsonl record that are not metrics


class TrackerMirror:
    def __init__(self, run: TrackedRun, names: Sequence[str], kept: list[dict]) -> None:
        """Start (or continue) each tracker of ``names``; ``kept``: the records ``metrics.jsonl``
        holds now (those up to the checkpoint this attempt resumes from)."""
        self.path = run.run_dir / LEDGER_FILE
        self._ledger = read_ledger(self.path)
        self._active: dict[str, Tracker] = {}
        for name in names:
            self._start(name, run, kept)
        self._save()

    @property
    def active(self) -> tuple[str, ...]:
        return tuple(self._active)

    def log(self, index: int, step: int, metrics: dict[str, float], time: float) -> None:
        """Record number ``index`` of ``metrics.jsonl``, to every tracker that lacks it."""
        for name in list(self._active):
            if index >= self._ledger[name]["records"]:
                self._log(name, index, step, metrics, time)
        self._save()

    def close(self, *, failed: bool = False) -> None:
        for name, tracker in list(self._active.items()):
            try:
                tracker.close(failed=failed)
            except Exception as exc:  # noqa: BLE001 - a tracker never stops the run
                _warn(name, "failed to close", exc)
        self._active.clear()
        self._save()

    def _start(self, name: str, run: TrackedRun, kept: list[dict]) -> None:
        recorded = self._ledger.get(name, {})
        try:
            cls = tracker_class(name)
            tracker = cls(run, recorded)
        except Exception as exc:  # noqa: BLE001 - an ImportError as much as a refused store
            _warn(name, "could not start", exc)
            return
        held = recorded.get("records", 0) if tracker.continued else 0
        if cls.rewinds:
            held = min(held, len(kept)) if run.resume_after is not None else 0
        self._ledger[name] = {**tracker.record(), "records": held}
        self._active[name] = tracker
        for index in range(held, len(kept)):
            record = kept[index]
            metrics = {k: v for k, v in record.items() if k not in METADATA}
            if not self._log(name, index, record["step"], metrics, record.get("time", 0.0)):
                return

    def _log(self, name: str, index: int, step: int, metrics: dict[str, float], time: float) -> bool:
        try:
            self._active[name].log(step, metrics, time)
        except Exception as exc:  # noqa: BLE001 - a tracker never stops the run
            _warn(name, f"failed to log step {step}", exc)
            tracker = self._active.pop(name)
            try:
                tracker.close(failed=True)
            except Exception:  # noqa: BLE001 - already warned about this tracker
                pass
            return False
        self._ledger[name]["records"] = index + 1
        return True

    def _save(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self._ledger, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.path)


def read_ledger(path: Path) -> dict[str, dict[str, Any]]:
    """The ledger, or nothing (with a warning: every tracker starts a new run) when it is damaged."""
    if not path.is_file():
        return {}
    try:
        ledger = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        warnings.warn(f"{path} is damaged ({exc}); the trackers start new runs", TrackerWarning, stacklevel=2)
        return {}
    if not isinstance(ledger, dict) or not all(isinstance(v, dict) for v in ledger.values()):
        warnings.warn(f"{path} does not hold a tracker ledger; the trackers start new runs", TrackerWarning,
                      stacklevel=2)
        return {}
    return ledger


def _warn(name: str, what: str, exc: BaseException) -> None:
    warnings.warn(f"tracker {name} {what} ({type(exc).__name__}: {exc}); the run goes on without it",
                  TrackerWarning, stacklevel=3)
