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


def scratchpad_sum(a: int, b: int) -> str:
    """The written column addition of ``a + b``, least significant column first, then the sum:
    ``4817+2965`` → ``7+5=12c1;1+6+1=8c0;8+9=17c1;4+2+1=7c0;=7782`` (a carry in is written as
    ``+1``; a missing digit of the shorter operand is 0)."""
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    columns, carry = [], 0
    for i in range(max(len(digits_a), len(digits_b))):
        x = int(digits_a[i]) if i < len(digits_a) else 0
        y = int(digits_b[i]) if i < len(digits_b) else 0
        total = x + y + carry
        columns.append(f"{x}+{y}{'+1' if carry else ''}={total}c{total // 10};")
        carry = total // 10
    return "".join(columns) + f"={a + b}"


def _column_addition(low: int, high: int) -> TaskFn:
    """Sum of two numbers of ``low``–``high`` digits each, answered with its scratchpad
    (:func:`scratchpad_sum`; scored on the sum after the last ``=``: ``data.reward=worked-sum``)."""
    def make(rng: random.Random) -> tuple[str, str]:
        a, b = (rng.randrange(10 ** (n - 1), 10 ** n) for n in (rng.randint(low, high), rng.randint(low, high)))
        return f"{a}+{b}", scratchpad_sum(a, b)
    return make


# Tier C (experiments/tier_c): a base trained on 2–4-digit operands, RL on held-out longer ones
task("addpad")(_column_addition(2, 4))
task("addpad5")(_column_addition(5, 5))
task("addpad56")(_column_addition(5, 6))


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
