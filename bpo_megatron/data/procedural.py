"""Procedurally generated tasks with exact answers (CPU demos; no dataset download).

A task turns a seed into problems deterministically, so a training run can draw as many as it
needs and evaluation sets are fixed by their seed.
"""

from __future__ import annotations

import random
from typing import Callable

from bpo_megatron.data.problems import Problem

TaskFn = Callable[[random.Random], tuple[str, str]]
TASKS: dict[str, TaskFn] = {}


def task(name: str):
    def register(fn: TaskFn) -> TaskFn:
        TASKS[name] = fn
        return fn
    return register


@task("add")
def _add(rng: random.Random) -> tuple[str, str]:
    """Sum of two digits: 100 problems, answers of one or two digits."""
    a, b = rng.randrange(10), rng.randrange(10)
    return f"{a}+{b}", str(a + b)


@task("add2")
def _add2(rng: random.Random) -> tuple[str, str]:
    """Sum of two numbers below 100."""
    a, b = rng.randrange(100), rng.randrange(100)
    return f"{a}+{b}", str(a + b)


@task("reverse")
def _reverse(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice("abcdefgh") for _ in range(rng.randrange(3, 6)))
    return f"rev {word}", word[::-1]


@task("max")
def _max(rng: random.Random) -> tuple[str, str]:
    numbers = [rng.randrange(100) for _ in range(rng.randrange(2, 5))]
    return "max " + " ".join(map(str, numbers)), str(max(numbers))


def generate(name: str, count: int, seed: int) -> list[Problem]:
    if name not in TASKS:
        raise ValueError(f"procedural task {name!r} is unknown; choose one of {sorted(TASKS)}")
    rng = random.Random(seed)
    problems = []
    for i in range(count):
        text, answer = TASKS[name](rng)
        problems.append(Problem(id=f"{name}-{seed}-{i}", problem=text, answer=answer, source=f"procedural:{name}"))
    return problems
