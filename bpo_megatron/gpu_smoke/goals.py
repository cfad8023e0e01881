"""The goals a GPU round is judged by (issue 46: the host, not the chip), read from the kit's numbers.

Each goal names a check's number and a bound (and a stretch where the issue sets one). The round
report states for each whether it holds, by how much it misses, or that it was not measured: the
check did not run, or ran without reporting the number (a check that predates it, or failed first),
or the number is not a measurement (NaN: no data-sheet peak for the device; "not recorded": the
loop's metrics lacked the key).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Goal:
    check: str
    key: str
    what: str
    bound: float
    at_most: bool  # the number must be ≤ bound (a time, a cost ratio); else ≥ bound
    unit: str  # "s", "tok/s", "%" (a fraction shown in percent), "×"
    stretch: float | None = None

    def show(self, value: float) -> str:
        if self.unit == "%":
            return f"{value:.1%}"
        if self.unit == "tok/s":
            return f"{value:,.0f} tok/s"
        if self.unit == "×":
            return f"{value:.3f}×"
        return f"{value:.3g} s"

    def gap(self, difference: float) -> str:
        return f"{difference * 100:.1f} points" if self.unit == "%" else self.show(difference)

    @property
    def wanted(self) -> str:
        text = f"{'≤' if self.at_most else '≥'} {self.show(self.bound)}"
        return text + (f" (stretch {self.show(self.stretch)})" if self.stretch is not None else "")


GOALS = (
    Goal("rl_loop", "steady_step_s", "steady-state RL step (median of steps ≥ 3)", 4.5, True, "s"),
    Goal("rl_loop", "steady_tokens_per_s_per_device", "generated tokens/s per GPU, steady state", 14_000, False,
         "tok/s"),
    Goal("rl_loop", "push_s", "weight push into the engine, steady state", 0.3, True, "s"),
    Goal("train_fast_paths", "train_mfu_32k", "training MFU at 32,768-position micro-batches", 0.25, False, "%",
         stretch=0.30),
    Goal("train_fast_paths", "layer_mfu_30b_slice", "layer MFU of the Qwen3-30B-A3B slice", 0.20, False, "%"),
    Goal("rollout_decode", "best_graph_hbm_fraction_ctx576", "decode at 256 rows, context ≈ 576: share of HBM",
         0.40, False, "%", stretch=0.50),
    Goal("rollout_decode", "best_graph_hbm_fraction_ctx192", "decode at 256 rows, context 192: share of HBM",
         0.33, False, "%"),
    Goal("rollout_decode", "filtered_step_ratio_ctx576", "decode step with top-p/top-k on against plain (context ≈ 576)",
         1.10, True, "×"),
)


def _verdict(goal: Goal, value: float) -> str:
    holds = value <= goal.bound if goal.at_most else value >= goal.bound
    if holds:
        stretch = goal.stretch is not None and (value <= goal.stretch if goal.at_most else value >= goal.stretch)
        return "holds, the stretch too" if stretch else "holds"
    if goal.at_most:
        return f"misses: {value / goal.bound:.2f}× the bound ({goal.gap(value - goal.bound)} over)"
    return f"misses: {value / goal.bound:.0%} of the bound ({goal.gap(goal.bound - value)} short)"


def judge_goal(goal: Goal, checks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"goal": goal.what, "check": goal.check, "number": goal.key, "wanted": goal.wanted,
                           "value": None}
    check = checks.get(goal.check)
    if check is None:
        return {**row, "verdict": "not measured: the check did not run in this round"}
    value = check.get("numbers", {}).get(goal.key)
    if value is None:
        why = "it did not run" if check.get("error", "").startswith("not run") else (
            "it failed before measuring it" if check.get("error") else "it reports no such number")
        return {**row, "verdict": f"not measured: {goal.check} has no {goal.key} ({why})"}
    row["value"] = value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return {**row, "verdict": f"not measured: {value}"}
    if not math.isfinite(value):
        return {**row, "verdict": f"not measured: {value} (no data-sheet peak for this device, or too few steps)"}
    return {**row, "measured": goal.show(value), "verdict": _verdict(goal, float(value))}


def judge_goals(checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each goal's row, from the kit's checks (as report.json holds them)."""
    by_name = {c["name"]: c for c in checks}
    return [judge_goal(goal, by_name) for goal in GOALS]


def goal_lines(rows: list[dict[str, Any]], *, dry_run: bool) -> list[str]:
    """The goals as a markdown section."""
    held = sum(1 for r in rows if r["verdict"].startswith("holds"))
    unmeasured = sum(1 for r in rows if r["verdict"].startswith("not measured"))
    lines = ["## Goals", "",
             f"{held} of {len(rows)} hold, {len(rows) - held - unmeasured} miss, {unmeasured} not measured"
             + (" (a CPU dry run: the CPU profile's numbers against a GPU's goals)" if dry_run else "") + ".", "",
             "| goal | number | wanted | measured | verdict |", "|---|---|---|---|---|"]
    lines += [f"| {r['goal']} | `{r['check']}`: `{r['number']}` | {r['wanted']} | {r.get('measured', '-')} | "
              f"{r['verdict']} |" for r in rows]
    return lines
