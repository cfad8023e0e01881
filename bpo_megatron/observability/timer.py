"""Where a step's time goes: named phases timed around the work, the rest the driver's own."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator


class PhaseTimer:
    """Started at construction. ``with timer.phase("train"): ...`` adds that block's seconds to the
    phase (a phase may be entered several times). :meth:`metrics` gives ``time/<phase>_s`` of each
    phase named in ``phases``, ``time/step_s`` since the start and ``time/driver_s``: the step less
    every phase (the driver's own work: scoring, batching, bookkeeping)."""

    def __init__(self, phases: tuple[str, ...]) -> None:
        self.phases = phases
        self.seconds: dict[str, float] = defaultdict(float)
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.phases:
            raise ValueError(f"phase {name!r} is not one of {self.phases}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        step = time.perf_counter() - self._start
        out = {f"time/{name}_s": self.seconds[name] for name in self.phases}
        out["time/step_s"] = step
        out["time/driver_s"] = step - sum(self.seconds[name] for name in self.phases)
        return out
