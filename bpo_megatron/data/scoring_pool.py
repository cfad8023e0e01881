"""Scoring calls in worker processes, each within a time limit, that a hung call cannot stall.

math-verify bounds its parsing with ``signal.alarm`` (a process's main thread only) and a user's
reward may hang, so scores are computed in worker processes. A call past ``timeout_s`` is
abandoned, and with it its pool: its worker would stay busy with the call for good, and every
later call queued behind it would time out in turn, scoring 0 without a word. The calls still
pending are sent to a fresh pool, so each round settles at least the call that timed out. With
``deadline_s``, a whole batch of calls gets that long: at the deadline every call not yet settled
is abandoned (``timed_out``, ``past_deadline``) with its pool, so a function that hangs on every
call costs the batch ``deadline_s``, not ``timeout_s`` per call.

Workers are forked from the driver, so they inherit its signal handlers, among them the
stack-dumping SIGTERM handler Ray's core installs in every process it starts in: a pool ended
with SIGTERM (:meth:`TimedPool.close`, after every run) would print one dump per worker after the
run's last line. Each worker puts SIGTERM back to the default (die quietly) when it starts.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class CallResult:
    value: Any = None
    timed_out: bool = False
    past_deadline: bool = False  # timed out because the batch's deadline passed, not its own timeout
    error: str | None = None  # the exception a call raised (or its result failed to pickle)

    @property
    def ok(self) -> bool:
        return not self.timed_out and self.error is None


class TimedPool:
    """``workers`` processes; :meth:`run` gives each call ``timeout_s`` seconds. ``replaced``
    counts the pools abandoned for a hung call (a metric worth watching)."""

    def __init__(self, workers: int, timeout_s: float) -> None:
        if workers < 1:
            raise ValueError(f"a scoring pool needs at least 1 worker process, got workers={workers}")
        self.workers, self.timeout_s = workers, timeout_s
        self.replaced = 0
        self._pool = None

    def run(self, fn: Callable, calls: list[tuple], deadline_s: float | None = None) -> list[CallResult]:
        """``fn(*args)`` for every ``args`` of ``calls``, in order; all of them within
        ``deadline_s`` seconds when given (see the module docstring)."""
        end = None if deadline_s is None else time.monotonic() + deadline_s
        results: dict[int, CallResult] = {}
        pending = list(range(len(calls)))
        while pending:
            if end is not None and time.monotonic() >= end:
                results.update({i: CallResult(timed_out=True, past_deadline=True) for i in pending})
                break
            if self._pool is None:
                self._pool = multiprocessing.Pool(self.workers, initializer=_quiet_on_sigterm)
            running = {i: self._pool.apply_async(fn, calls[i]) for i in pending}
            pending, hung = [], False
            for i, call in running.items():
                if hung and not call.ready():
                    pending.append(i)  # queued behind the hung call, or running beside it: to a fresh pool
                    continue
                wait = self.timeout_s if end is None else max(0.0, min(self.timeout_s, end - time.monotonic()))
                try:
                    results[i] = CallResult(value=call.get(timeout=wait))
                except multiprocessing.TimeoutError:
                    past = wait < self.timeout_s  # cut by the batch's deadline, not by its own timeout
                    results[i] = CallResult(timed_out=True, past_deadline=past)
                    hung = True
                except Exception as exc:  # noqa: BLE001 - whatever the call raised, or a result that does not pickle
                    results[i] = CallResult(error=f"{type(exc).__name__}: {exc}")
            if hung:
                self.close()
                self.replaced += 1
        return [results[i] for i in range(len(calls))]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


def _quiet_on_sigterm() -> None:
    """A worker's start: SIGTERM ends it without a word, whatever handler the driver had
    installed (see the module docstring)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
