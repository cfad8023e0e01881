"""Telling a slow engine from a stuck one while it generates.

An engine is stalled when, with requests outstanding, it has shown no progress for
``stall_timeout_s``: its progress count (decoding steps) has not moved, or it has not answered a
progress probe at all (a stopped process answers nothing). An engine whose probe answers with no
count (``None``: a server that reports none) shows progress by answering. A generation of any
length is never mistaken for a stall: every decoding step moves the count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_UNSEEN = object()


@dataclass
class StallWatch:
    stall_timeout_s: float
    _count: dict[int, object] = field(default_factory=dict)
    _since: dict[int, float] = field(default_factory=dict)

    def start(self, engine: int, now: float) -> None:
        """``engine`` has requests outstanding from ``now`` on (a fresh start)."""
        self._count[engine], self._since[engine] = _UNSEEN, now

    def answered(self, engine: int, count: int | None, now: float) -> None:
        """A progress probe of ``engine`` answered ``count``."""
        if engine not in self._since:
            return
        if count is None or count != self._count[engine]:
            self._count[engine], self._since[engine] = count, now

    def progressed(self, engine: int, now: float) -> None:
        """``engine`` showed progress otherwise (a sample came back)."""
        if engine in self._since:
            self._since[engine] = now

    def stop(self, engine: int) -> None:
        """``engine`` has nothing outstanding any more."""
        self._count.pop(engine, None)
        self._since.pop(engine, None)

    def stalled(self, now: float) -> list[int]:
        return sorted(i for i, since in self._since.items() if now - since > self.stall_timeout_s)

    def quiet_for(self, engine: int, now: float) -> float:
        return now - self._since[engine]
