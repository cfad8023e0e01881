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


def _reversal(low: int, high: int) -> TaskFn:
    """A word of ``low``–``high`` letters a–h, reversed ("rev abc" -> "cba")."""
    def make(rng: random.Random) -> tuple[str, str]:
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randrange(low, high + 1)))
        return f"rev {word}", word[::-1]
    return make


def _sorting(low: int, high: int) -> TaskFn:
    """``low``–``high`` digits in ascending order ("sort 3 9 1" -> "139")."""
    def make(rng: random.Random) -> tuple[str, str]:
        digits = [rng.randrange(10) for _ in range(rng.randrange(low, high + 1))]
        return "sort " + " ".join(map(str, digits)), "".join(map(str, sorted(digits)))
    return make


def _largest(low: int, high: int) -> TaskFn:
    """The largest of ``low``–``high`` numbers below 100 ("max 12 7 40" -> "40")."""
    def make(rng: random.Random) -> tuple[str, str]:
        numbers = [rng.randrange(100) for _ in range(rng.randrange(low, high + 1))]
        return "max " + " ".join(map(str, numbers)), str(max(numbers))
    return make


# The longer variants hold lengths their base task never reaches: held-out tasks for a model
# trained on the base ones (Tier B's max5).
task("reverse")(_reversal(3, 5))
task("reverse6")(_reversal(6, 7))
task("sort")(_sorting(3, 5))
task("sort6")(_sorting(6, 7))
task("max")(_largest(2, 4))
task("max5")(_largest(5, 6))


@task("sum3")
def _sum3(rng: random.Random) -> tuple[str, str]:
    """Sum of three numbers below 100 (answers of one to three digits)."""
    numbers = [rng.randrange(100) for _ in range(3)]
    return "+".join(map(str, numbers)), str(sum(numbers))


@task("mul2")
def _mul(rng: random.Random) -> tuple[str, str]:
    """Product of two numbers of two digits (a calculator's task: rollout.agent.name=calculator)."""
    a, b = rng.randrange(10, 100), rng.randrange(10, 100)
    return f"{a}*{b}", str(a * b)


MIXTURE = "+"  # "add2+max+reverse": each problem of one of these tasks, drawn uniformly


def unknown_tasks(name: str) -> list[str]:
    """The parts of ``name`` (a task or a ``+``-joined mixture of tasks) that are not registered."""
    return [part for part in name.split(MIXTURE) if part not in TASKS]


def resolve(name: str) -> TaskFn:
    """The task ``name``: a registered task, or a mixture ``a+b+c`` whose every problem comes
    from one of its tasks, chosen uniformly by the same generator (so a seed still fixes the set)."""
    if unknown := unknown_tasks(name):
        raise ValueError(f"procedural task {unknown[0]!r} (of {name!r}) is unknown; choose one of {sorted(TASKS)}, "
                         f"or several joined by {MIXTURE!r}")
    parts = [TASKS[part] for part in name.split(MIXTURE)]
    if len(parts) == 1:
        return parts[0]
    return lambda rng: rng.choice(parts)(rng)


def generate(name: str, count: int, seed: int) -> list[Problem]:
    make = resolve(name)
    rng = random.Random(seed)
    problems = []
    for i in range(count):
        text, answer = make(rng)
        problems.append(Problem(id=f"{name}-{seed}-{i}", problem=text, answer=answer, source=f"procedural:{name}"))
    return problems
