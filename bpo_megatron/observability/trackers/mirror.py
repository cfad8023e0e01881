"""Feeding the trackers every record of ``metrics.jsonl`` once, across kills and resumes.

The run directory's ``trackers.json`` (the ledger) says, per tracker, which run of it holds this
run's points (``run_id`` and where it lives) and how many records of ``metrics.jsonl`` (in file
order) that run holds. A resumed attempt writes the same records as the interrupted one
(``metrics.jsonl`` keeps the records up to the checkpoint and the steps after it are run again),
so a record's index says whether a tracker has it, up to one thing: a background evaluation's
record lands after whichever step the evaluation finished by, which may differ between attempts.
A record is therefore also known by its identity, its step and how many records of that step
precede it (a step's training record, then its evaluation's), and the records a tracker holds
past the prefix of the file it holds are listed by identity in the ledger (``beyond``):

* a tracker continues its recorded run (wandb ``id=..., resume="allow"``, MLflow's run id) and is
  sent only records past what it holds: records ``metrics.jsonl`` kept that it lacks (added to the
  run on a resume, or dropped by a failure in an earlier attempt) when it starts, then the new
  ones. A tracker cannot delete a point, so the steps that an interrupted attempt logged past its
  checkpoint stay as that attempt logged them and the resumed attempt does not log them again
  (a resume recomputes them alike but for clocks and floating-point summation order);
* TensorBoard drops those steps itself (``rewinds``) and gets them again; a record of an earlier
  step that it holds from there (an evaluation that finished after the checkpoint, run again on
  resume) is not dropped, and not sent again.

A tracker that fails to import, start or log is warned about once (:class:`TrackerWarning`,
naming it and the error) and dropped for the rest of the attempt; its ledger entry stays, so the
next attempt continues its run and fills the gap. A kill between a tracker's write and the ledger's
may repeat that one record in a tracker that keeps points.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from bpo_megatron.observability.trackers import TrackedRun, Tracker, TrackerWarning, tracker_class

LEDGER_FILE = "trackers.json"
METADATA = ("step", "time")  # the keys of a metrics.jsonl record that are not metrics


Identity = tuple[int, int]  # (step, how many records of that step precede it in the file)


def identities(records: Sequence[dict]) -> list[Identity]:
    """Each record's identity, in order."""
    seen: Counter = Counter()
    out = []
    for record in records:
        out.append((record["step"], seen[record["step"]]))
        seen[record["step"]] += 1
    return out


class TrackerMirror:
    def __init__(self, run: TrackedRun, names: Sequence[str], kept: list[dict], dropped: Sequence[dict] = ()) -> None:
        """Start (or continue) each tracker of ``names``; ``kept``: the records ``metrics.jsonl``
        holds now (those up to the checkpoint this attempt resumes from); ``dropped``: the records
        of the previous attempt after them, which trackers that keep points may hold."""
        self.path = run.run_dir / LEDGER_FILE
        self._ledger = read_ledger(self.path)
        self._active: dict[str, Tracker] = {}
        self._seen = Counter(record["step"] for record in kept)  # the identity of the next record
        self._dropped = identities([*kept, *dropped])[len(kept):]
        for name in names:
            self._start(name, run, kept)
        self._save()

    @property
    def active(self) -> tuple[str, ...]:
        return tuple(self._active)

    def log(self, index: int, step: int, metrics: dict[str, float], time: float) -> None:
        """Record number ``index`` of ``metrics.jsonl``, to every tracker that lacks it."""
        identity = (step, self._seen[step])
        self._seen[step] += 1
        for name in list(self._active):
            if index >= self._ledger[name]["records"]:
                self._offer(name, index, identity, step, metrics, time)
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
        beyond = {tuple(b) for b in recorded.get("beyond", ())} if tracker.continued else set()
        if held > len(kept):  # it holds records of the previous attempt that metrics.jsonl dropped
            beyond.update(self._dropped[:held - len(kept)])
            held = len(kept)
        if cls.rewinds:  # it hides what it holds of the steps after the checkpoint (all, on a fresh start)
            beyond = {b for b in beyond if run.resume_after is not None and b[0] <= run.resume_after}
            held = held if run.resume_after is not None else 0
        self._ledger[name] = {**tracker.record(), "records": held}
        self._set_beyond(name, beyond)
        self._active[name] = tracker
        for index, identity in enumerate(identities(kept)):
            if index < held:
                continue
            record = kept[index]
            metrics = {k: v for k, v in record.items() if k not in METADATA}
            if not self._offer(name, index, identity, record["step"], metrics, record.get("time", 0.0)):
                return

    def _offer(self, name: str, index: int, identity: Identity, step: int, metrics: dict[str, float],
               time: float) -> bool:
        """Record ``index`` to tracker ``name``, unless it holds that record already (``beyond``)."""
        beyond = {tuple(b) for b in self._ledger[name].get("beyond", ())}
        if identity in beyond:
            beyond.discard(identity)
            self._set_beyond(name, beyond)
            self._ledger[name]["records"] = index + 1
            return True
        return self._log(name, index, step, metrics, time)

    def _set_beyond(self, name: str, beyond: set) -> None:
        if beyond:
            self._ledger[name]["beyond"] = sorted([list(b) for b in beyond])
        else:
            self._ledger[name].pop("beyond", None)

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
