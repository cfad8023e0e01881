"""Training prompts as a resumable stream over a screened dataset or an endless procedural task."""

from __future__ import annotations

import random

from bpo_megatron.data.problems import Problem, Rejected, read_problems
from bpo_megatron.data.procedural import generate
from bpo_megatron.tasks.prompts import PROCEDURAL, Encoded, PromptFormat, screen


class BadRecords(ValueError):
    """Records a run cannot use; the message names the first few and the ways out."""

    def __init__(self, setting: str, rejected: list[Rejected], total: int) -> None:
        shown = "\n  ".join(str(r) for r in rejected[:5])
        more = f"\n  ... and {len(rejected) - 5} more" if len(rejected) > 5 else ""
        super().__init__(
            f"{setting}: {len(rejected)} of {total} records cannot be used:\n  {shown}{more}\n"
            "fix them, or set data.on_bad_record=skip to leave them out (they are counted and reported)")
        self.rejected = rejected


def usable(problems: list[Problem], rejected: list[Rejected], fmt: PromptFormat, *, setting: str,
           skip_bad: bool) -> tuple[list[Encoded], list[Rejected]]:
    """The encodable problems of a dataset read with ``rejected`` records already set aside; the
    rejected ones raise :class:`BadRecords` unless ``skip_bad``."""
    kept, unfit = screen(problems, fmt)
    rejected = rejected + unfit
    total = len(problems) + len(rejected) - len(unfit)
    if rejected and not skip_bad:
        raise BadRecords(setting, rejected, total)
    if not kept:
        raise BadRecords(setting, rejected, total) if rejected else ValueError(f"{setting} holds no problems")
    return kept, rejected


class PromptStream:
    """Encoded prompts in a seeded shuffled order, epoch after epoch; ``cursor`` counts the
    prompts handed out, so a resumed run continues with exactly the next ones.

    ``spec`` is a dataset (screened once, here) or ``procedural:<task>`` (each epoch generated
    from ``seed + epoch``). A generated problem that does not fit (``data.max_prompt_tokens``
    too small for the task) is an error whatever ``data.on_bad_record`` says: skipping it would
    change the length of the epoch, and the fix is a setting, not the data.
    """

    EPOCH = 10_000  # problems per epoch of a procedural task (each epoch from its own seed)

    def __init__(self, spec: str, root: str, fmt: PromptFormat, *, seed: int, cursor: int = 0,
                 fields=None, skip_bad: bool = False) -> None:
        self.spec, self.fmt, self.seed, self.cursor, self.skip_bad = spec, fmt, seed, cursor, skip_bad
        self._procedural = spec[len(PROCEDURAL):] if spec.startswith(PROCEDURAL) else None
        self.rejected: list[Rejected] = []
        self._fixed: list[Encoded] | None = None
        if not self._procedural:
            problems, rejected = read_problems(spec, root, fields)
            self._fixed, self.rejected = usable(problems, rejected, fmt, setting=f"data.train={spec}",
                                                skip_bad=skip_bad)
        self._epoch, self._order = -1, []

    def _epoch_prompts(self, epoch: int) -> list[Encoded]:
        if self._procedural:
            problems = generate(self._procedural, self.EPOCH, seed=self.seed + epoch)
            kept, _ = usable(problems, [], self.fmt, setting=f"data.train={self.spec}", skip_bad=False)
            return kept
        order = list(self._fixed)
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def check_first_epoch(self) -> None:
        """Screen a procedural task's first epoch now (a dataset was screened when read), so a
        task that does not fit the settings is refused before the run starts."""
        if self._procedural and self._epoch != 0:
            self._epoch, self._order = 0, self._epoch_prompts(0)

    def describe(self) -> str:
        if self._procedural:
            return f"procedural task {self._procedural!r} ({self.EPOCH} per epoch)"
        skipped = f", {len(self.rejected)} left out" if self.rejected else ""
        return f"{len(self._fixed)} problems of {self.spec}{skipped}"

    def peek(self) -> Encoded:
        """The next prompt :meth:`take` will hand out, without handing it out."""
        cursor = self.cursor
        try:
            return self.take(1)[0]
        finally:
            self.cursor = cursor

    def take(self, count: int) -> list[Encoded]:
        size = self.EPOCH if self._procedural else len(self._fixed)
        batch = []
        for position in range(self.cursor, self.cursor + count):
            epoch, offset = divmod(position, size)
            if epoch != self._epoch:
                self._epoch, self._order = epoch, self._epoch_prompts(epoch)
            batch.append(self._order[offset])
        self.cursor += count
        return batch
