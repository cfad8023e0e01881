"""Verifiable rewards: 1.0 for a correct final answer, 0.0 otherwise (never an exception).

``math`` scores only a response's final answer: the last top-level ``\\boxed{...}`` (or
``\\fbox{...}``), else the last line starting with ``Answer:``, as the templates ask for. A
response with neither scores 0: a number that merely happens to end the reasoning is not an
answer, and reading one would reward responses that never committed to one. The answer found is
checked for equivalence with the reference by math-verify (LaTeX/sympy aware) in a pool of
worker processes, because math-verify bounds its parsing with ``signal.alarm``, which only works
in a process's main thread, and a pathological answer must not stall the step. The pool is sized
to the CPUs the driver may use (:func:`scoring_workers`): a step scores thousands of responses.
``exact`` compares strings.

Whether a response was cut off by the length limit is not visible in its text; scoring such
responses is :func:`bpo_megatron.tasks.scoring.score`'s job (``data.truncated_reward``).

Besides these names ``data.reward`` takes a user's own reward (:func:`reward_fn`): a function as
``package.module:function`` (:mod:`~bpo_megatron.data.user_reward`) or a service's URL
(:mod:`~bpo_megatron.data.reward_service`), both reading whole problem records
(:mod:`~bpo_megatron.data.reward_values`).
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from bpo_megatron.data.reward_service import RewardService, is_url
from bpo_megatron.data.scoring_pool import TimedPool
from bpo_megatron.data.user_reward import FunctionReward, is_function_spec

if TYPE_CHECKING:
    from bpo_megatron.data.config import DataConfig

logger = logging.getLogger(__name__)

RewardFn = Callable[[list[str], list[str]], list[float]]
REWARDS: dict[str, RewardFn] = {}


def reward(name: str):
    def register(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn
    return register


@reward("exact")
def exact_match(responses: list[str], answers: list[str]) -> list[float]:
    return [float(r.strip() == a.strip()) for r, a in zip(responses, answers)]


@reward("worked-sum")
def worked_result_match(responses: list[str], answers: list[str]) -> list[float]:
    """Exact match of what follows the last ``=`` (a worked answer's result: a scratchpad's sum),
    whatever the work before it says."""
    return [float(r.rpartition("=")[2].strip() == a.rpartition("=")[2].strip()) for r, a in zip(responses, answers)]


# ------------------------------------------------------------------------- final-answer markers
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "Answer: 42", also in bold ("**Answer:** 42") as chat models often write it.
_ANSWER_LINE = re.compile(r"^[ \t]*(?:\*\*)?answer[ \t]*:(?:\*\*)?[ \t]*(.*?)[ \t]*$", re.IGNORECASE | re.MULTILINE)


def _closing_brace(text: str, start: int) -> int | None:
    """Index of the ``}`` closing the group that starts at ``start`` (just after its ``{``), or
    None when the text ends first. Escaped braces (``\\{``, ``\\}``) are content, not groups."""
    depth, i = 1, start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last top-level ``\\boxed{...}``; a box nested in another belongs to it
    and ``\\boxed{1}\\boxed{2}`` is two answers, the last one ``2``. None when there is no box, or
    when the last one is never closed (an answer not finished is not an answer)."""
    found, position = None, 0
    while (match := _BOX.search(text, position)) is not None:
        end = _closing_brace(text, match.end())
        if end is None:
            return None
        found, position = text[match.end():end], end + 1
    return found


def answer_line(text: str) -> str | None:
    """What follows ``Answer:`` on the last line that starts with it (case-insensitive)."""
    lines = [m.group(1) for m in _ANSWER_LINE.finditer(text)]
    return lines[-1] if lines and lines[-1] else None


# In order of precedence: a box is the more explicit marker ("Answer: \boxed{5}" reads as 5).
ANSWER_MARKERS: tuple[Callable[[str], str | None], ...] = (last_boxed, answer_line)


def final_answer(response: str) -> str | None:
    """The response's final answer by the first marker it has, or None: no marker, no answer."""
    for marker in ANSWER_MARKERS:
        found = marker(response)
        if found is not None:
            # a sentence's closing period ("Answer: 42.") would make the answer unparseable
            found = found.strip().rstrip(".").strip()
            return found or None
    return None


def _math_verify_one(args: tuple[str, str]) -> float:
    predicted_answer, answer = args
    try:
        from math_verify import parse, verify

        gold = parse(f"${answer}$" if "$" not in answer and "\\boxed" not in answer else answer)
        # Boxed again so math-verify reads exactly this answer, LaTeX or plain, and nothing else.
        predicted = parse(f"\\boxed{{{predicted_answer}}}")
        return float(bool(predicted) and verify(gold, predicted))
    except Exception:  # noqa: BLE001 - an unparseable answer is a wrong answer
        return 0.0


# A scoring call's time limit (math-verify's and a user function's): a pathological answer, or a
# user's reward that hangs, scores 0 instead of stalling the step.
SCORING_TIMEOUT_S = 10.0
# The driver's own loop (batching, advantages, Ray's client) keeps this many CPUs.
DRIVER_CPUS = 2
# Each worker holds math-verify and sympy (~60 MB); beyond this many, answers of one step
# (a few thousand) are scored faster than the engines produce them anyway.
MAX_SCORING_WORKERS = 32
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """CPUs this process may use: those it is allowed to run on (``os.sched_getaffinity``, what
    Slurm and taskset restrict), and no more than its cgroup's CPU quota (what a Kubernetes CPU
    limit sets, which leaves the affinity at every CPU of the node)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota == "max":
            return cpus
        return min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        return cpus  # no cgroup v2 CPU controller here: the affinity is the limit


def scoring_workers(cpus: int | None = None) -> int:
    """Scoring processes for ``cpus`` CPUs (default: :func:`available_cpus`): all but
    ``DRIVER_CPUS``, at least 1 and at most ``MAX_SCORING_WORKERS``."""
    cpus = available_cpus() if cpus is None else cpus
    return max(1, min(MAX_SCORING_WORKERS, cpus - DRIVER_CPUS))


class MathVerifier:
    """Scores responses by their final answers in worker processes; a response without one
    scores 0 without being sent, a call that exceeds ``timeout_s`` scores 0 (a pathological
    answer is a wrong one) and its pool is replaced (:class:`TimedPool`; ``timeouts`` counts
    them). ``workers``: the pool's processes (default: :func:`scoring_workers`, from the CPUs this
    process may use)."""

    def __init__(self, workers: int | None = None, timeout_s: float = SCORING_TIMEOUT_S) -> None:
        if workers is not None and workers < 1:
            raise ValueError(f"MathVerifier needs at least 1 worker process, got workers={workers}")
        self.workers = scoring_workers() if workers is None else workers
        self.timeout_s = timeout_s
        self.timeouts = 0
        self._pool = TimedPool(self.workers, timeout_s)

    def __call__(self, responses: list[str], answers: list[str]) -> list[float]:
        finals = [final_answer(r) for r in responses]
        sent = [i for i, final in enumerate(finals) if final is not None]
        results = self._pool.run(_math_verify_one, [((finals[i], answers[i]),) for i in sent])
        scores = [0.0] * len(responses)
        for i, result in zip(sent, results):
            if result.timed_out:
                self.timeouts += 1
                if self.timeouts == 1:
                    logger.warning("math-verify did not finish within %g s on the answer %r (scored 0; its worker "
                                   "pool was replaced; warned once)", self.timeout_s, finals[i][:200])
            scores[i] = float(result.value) if result.ok else 0.0
        return scores

    def close(self) -> None:
        self._pool.close()


_MATH: MathVerifier | None = None


@reward("math")
def math_equivalence(responses: list[str], answers: list[str]) -> list[float]:
    global _MATH
    if _MATH is None:
        _MATH = MathVerifier()
    return _MATH(responses, answers)


def unknown_reward(spec: str) -> str | None:
    """Why ``data.reward=spec`` names no reward (None when it names one; nothing is imported)."""
    if spec in REWARDS or is_url(spec) or is_function_spec(spec):
        return None
    return (f"data.reward={spec!r} is unknown; choose one of {sorted(REWARDS)}, a function of yours as "
            "package.module:function, or a reward service as http://host:port/path")


def reward_fn(spec: str, data: DataConfig | None = None, *, workers: int | None = None):
    """The reward ``data.reward=spec`` names: a built-in verifier (``responses, answers ->
    scores``), or a user's :class:`~bpo_megatron.data.reward_values.RecordReward`, a function
    (imported here: a missing module or function raises ValueError naming it; scored in
    ``workers`` processes, default :func:`scoring_workers`) or a service, whose
    ``data.reward_timeout_s`` and ``data.reward_retries`` ``data`` gives (default: the defaults); a
    function's batches run within ``data.reward_batch_timeout_s`` (without ``data``: no bound)."""
    if spec in REWARDS:
        return REWARDS[spec]
    if (why := unknown_reward(spec)) is not None:
        raise ValueError(why)
    if is_url(spec):
        settings = {} if data is None else {"timeout_s": data.reward_timeout_s, "retries": data.reward_retries}
        return RewardService(spec, **settings)
    # a user's function scores like math-verify: as many worker processes, the same timeout
    return FunctionReward(spec, workers=workers or scoring_workers(), timeout_s=SCORING_TIMEOUT_S,
                          batch_timeout_s=None if data is None else data.reward_batch_timeout_s)
