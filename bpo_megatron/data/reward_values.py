"""What a user reward may return, and what a run makes of it.

A user reward (``data.reward: package.module:function`` or a reward service's URL) reads a whole
problem record (:func:`record_of`) and a response's text, and returns one of:

* a score: a real number in [-1, 1];
* a dict holding one as ``score``, besides named numbers the run logs as metrics
  (``reward/<name>``: per step, the mean over the responses that reported it).

Anything else is invalid: NaN or another number outside [-1, 1], a string, a dict without
``score``, an extra value that is not a finite number or is named ``invalid``/``errors`` (the
counts' own metrics). An invalid value, a call that raises and one that outlives its timeout all
score 0 and are counted (``reward/invalid``, ``reward/errors``), the first of each kind with a
warning naming its record: a response is always scored, so the batch keeps its shape, and a
broken reward shows in the metrics instead of silently steering training. A batch in which more
than ``data.reward_max_failed_frac`` of the responses failed so is not trained on: the run stops
(:class:`RewardFailed`, resumable once the reward is fixed) or, with
``data.on_reward_failure=skip_step``, the step is skipped. Before a run starts its dry call refuses
such a reward outright (:func:`bpo_megatron.loop.preflight.check_reward`).
"""

from __future__ import annotations

import math
import numbers
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from bpo_megatron.data.problems import Problem

RESERVED_EXTRAS = ("invalid", "errors")  # the names of the counts' own metrics (reward/invalid, reward/errors)
Failure = Literal["invalid", "error"]


class RewardFailed(RuntimeError):
    """A user reward failed on too much of a batch to train on it (or, a service, on the whole
    batch): the run stops before training on it, resumable once the reward is fixed."""


class RewardWarning(UserWarning):
    """A user reward returned an invalid value or failed mid-run (the response scored 0)."""


@dataclass(frozen=True)
class Outcome:
    """One response's reward: ``score`` with its ``extras``, or 0 and why (``failure``, ``detail``:
    what the reward returned or raised, for messages)."""

    score: float = 0.0
    extras: Mapping[str, float] = field(default_factory=dict)
    failure: Failure | None = None
    detail: str = ""


def record_of(problem: Problem) -> dict[str, str]:
    """The record a user reward reads: a plain dict, the same a reward service receives (less the
    response), so a function and a service are written against one schema."""
    return {"id": problem.id, "problem": problem.problem, "answer": problem.answer, "source": problem.source}


def _shown(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_number(value: Any) -> bool:
    # numbers.Real: float, int, bool (a reward written as `return response == answer`), numpy scalars
    return isinstance(value, numbers.Real)


def _invalid(value: Any, why: str) -> Outcome:
    return Outcome(failure="invalid", detail=f"returned {_shown(value)} ({type(value).__name__}): {why}")


def read_value(value: Any) -> Outcome:
    """The outcome of what a reward returned (see the module docstring for what is valid)."""
    extras: dict[str, float] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            return _invalid(value, "a dict must hold the score as 'score'")
        for name, extra in value.items():
            if name == "score":
                continue
            if not isinstance(name, str) or not name or name in RESERVED_EXTRAS:
                return _invalid(value, f"an extra value's name must be a non-empty string other than "
                                       f"{' and '.join(map(repr, RESERVED_EXTRAS))}, got {name!r}")
            if not _is_number(extra) or not math.isfinite(float(extra)):
                return _invalid(value, f"extra value {name!r} must be a finite number, got {_shown(extra)}")
            extras[name] = float(extra)
        score = value["score"]
    else:
        score = value
    if not _is_number(score):
        return _invalid(value, "a score must be a number in [-1, 1], or a dict holding one as 'score'")
    if not -1.0 <= float(score) <= 1.0:  # NaN fails this too
        return _invalid(value, "a score must be a finite number in [-1, 1]")
    return Outcome(float(score), extras)


class RecordReward(ABC):
    """A reward that reads problem records (a user function or a service), in contrast to the
    built-in verifiers, which compare a response with the reference answer alone.

    ``spec`` is the ``data.reward`` setting, for messages. Mid-run failures are warned about
    once per kind for the life of the object (a run's), each naming the record: enough to find
    the fault, without a line per response of a reward that fails everywhere."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._warned: set[str] = set()

    @abstractmethod
    def outcomes(self, records: list[dict[str, str]], responses: list[str]) -> list[Outcome]:
        """One outcome per response, in order; never raises for one response's failure."""

    def score_records(self, records: list[dict[str, str]], responses: list[str]) -> list[Outcome]:
        """:meth:`outcomes`, warning about the first invalid value and the first failed call."""
        outcomes = self.outcomes(records, responses)
        for record, outcome in zip(records, outcomes):
            if outcome.failure is not None and outcome.failure not in self._warned:
                self._warned.add(outcome.failure)
                counted = "reward/invalid" if outcome.failure == "invalid" else "reward/errors"
                warnings.warn(f"data.reward={self.spec}: record {record['id']!r} {outcome.detail}; the response scores "
                              f"0 and is counted in the metric {counted}, as is every further one (without a "
                              "warning)", RewardWarning, stacklevel=2)
        return outcomes

    def __call__(self, responses: list[str], answers: list[str]) -> list[float]:
        # the built-in verifiers' signature: answers alone are not the records this reward reads
        raise TypeError(f"data.reward={self.spec} reads problem records: score it with "
                        "bpo_megatron.tasks.scoring.score")

    def close(self) -> None:
        """Release what the reward holds (worker processes); it scores no more."""
