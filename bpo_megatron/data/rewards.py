"""Verifiable rewards: 1.0 for a correct final answer, 0.0 otherwise (never an exception).

``math`` checks equivalence with math-verify (LaTeX/sympy aware) in a pool of worker processes,
because math-verify bounds its parsing with ``signal.alarm``, which only works in a process's
main thread, and a pathological answer must not stall the step. ``exact`` compares strings.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Callable

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


def _math_verify_one(args: tuple[str, str]) -> float:
    response, answer = args
    try:
        from math_verify import parse, verify

        gold = parse(f"${answer}$" if "$" not in answer and "\\boxed" not in answer else answer)
        predicted = parse(response)
        return float(bool(predicted) and verify(gold, predicted))
    except Exception:  # noqa: BLE001 - an unparseable answer is a wrong answer
        return 0.0


class MathVerifier:
    """Scores responses in worker processes; a call that exceeds ``timeout_s`` scores 0."""

    def __init__(self, workers: int = 2, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self._pool = cf.ProcessPoolExecutor(max_workers=workers)

    def __call__(self, responses: list[str], answers: list[str]) -> list[float]:
        futures = [self._pool.submit(_math_verify_one, pair) for pair in zip(responses, answers)]
        scores = []
        for future in futures:
            try:
                scores.append(future.result(timeout=self.timeout_s))
            except (cf.TimeoutError, cf.process.BrokenProcessPool):
                future.cancel()
                scores.append(0.0)
        return scores

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


_MATH: MathVerifier | None = None


@reward("math")
def math_equivalence(responses: list[str], answers: list[str]) -> list[float]:
    global _MATH
    if _MATH is None:
        _MATH = MathVerifier()
    return _MATH(responses, answers)


def reward_fn(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"data.reward={name!r} is unknown; choose one of {sorted(REWARDS)}")
    return REWARDS[name]
