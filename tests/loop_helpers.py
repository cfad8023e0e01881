"""What the tests that drive the whole RL loop share: a run whose printed lines are kept, and a
driver killed right after a given step's line (the resume tests' interruption)."""

from __future__ import annotations


class Interrupted(Exception):
    """Stands for a driver killed right after a step's metrics were written."""


def run_loop(cfg, *, stop_after_step: int | None = None) -> tuple[dict, list[str]]:
    """The run's result and every line it printed; with ``stop_after_step``, :class:`Interrupted`
    as soon as that step's progress line is printed."""
    from bpo_megatron.loop.rl_loop import run

    lines: list[str] = []

    def echo(line: str) -> None:
        lines.append(line)
        if stop_after_step is not None and f" step {stop_after_step}/" in line:
            raise Interrupted(line)

    return run(cfg, echo=echo), lines


def assert_the_demo_learned(run_dir) -> None:
    """A full demo run learned: its training reward over the last 10 steps above the first 10 by
    more than 0.05, its last evaluation above its first."""
    from bpo_megatron.observability.metrics import read_metrics

    records = read_metrics(run_dir)
    rewards = [r["reward_mean"] for r in records if "reward_mean" in r]
    evals = [r["eval/mean_avg@4"] for r in records if "eval/mean_avg@4" in r]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.05, (first, last)
    assert evals[-1] > evals[0], evals
