"""``rl_loop``'s reading of a run's ``metrics.jsonl``: one row per step with its phase times, the
device traffic recorded apart from them, throughput and the loop's agreement numbers; the steady
state; and whether the phases account for the whole step.

* **Phases** (``time/<phase>_s``, ``loop/rl_loop.py``'s ``PHASES`` and the driver's own time, which
  the loop's timer writes as the step less those): each is reported under its own name, and together
  they must make up ``time/step_s`` within :data:`PHASE_SUM_TOLERANCE` — a phase the loop adds
  without the report knowing shows up as a gap, not as unexplained seconds.
* **Apart from the phases** (inside them: the push within ``sync``, the offload after it, the
  onload in ``train``; read from the keys the loop records, :data:`APART`): the weight push, the
  trainer's offload and onload, the engines' resume. A run that predates a key reports it as
  :data:`NOT_RECORDED`.
* **Steady state**: the median of the steps from :data:`STEADY_FROM` on (the first pins the host
  buffers and compiles, the second may follow a save); NaN when the run has none of them.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from bpo_megatron.gpu_smoke.profiles import Profile, finite
from bpo_megatron.gpu_smoke.report import Outcome

PHASES = ("rollout", "sync", "train", "driver")  # a step's time/<phase>_s, the driver's own time last
# name in the report -> the metrics keys that hold it, newest first (sync_seconds: the push's older name)
APART = {"push_s": ("push_s", "sync_seconds"), "offload_s": ("offload_s",), "onload_s": ("onload_s",),
         "resume_s": ("resume_s",)}
NOT_RECORDED = "not recorded"
STEADY_FROM = 3
PHASE_SUM_TOLERANCE = (1e-3, 0.01)  # |Σ phases − step| ≤ 0.1% of the step + 10 ms (clock reads between phases)


def _number(record: dict[str, Any], key: str) -> float:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) else float("nan")


def step_rows(records: list[dict[str, Any]], *, responses: int, devices: int) -> list[dict[str, Any]]:
    """One row per recorded step (records without ``time/step_s`` are not steps)."""
    rows = []
    for r in (r for r in records if "time/step_s" in r):
        step_s = float(r["time/step_s"])
        phases = {f"{p}_s": _number(r, f"time/{p}_s") for p in PHASES}
        apart = {name: next((float(r[k]) for k in keys if isinstance(r.get(k), (int, float))), NOT_RECORDED)
                 for name, keys in APART.items()}
        generated = responses * _number(r, "response_length_mean")
        rows.append({"step": int(r["step"]), **phases, "step_s": step_s,
                     "phases_gap_s": step_s - sum(phases.values()), **apart,
                     "generated_tokens": generated, "tokens_per_s_per_device": generated / step_s / devices,
                     "rollout_tokens_per_s": generated / phases["rollout_s"] if phases["rollout_s"] else float("nan"),
                     "routing_agreement": _number(r, "routing_agreement"),
                     "abs_logp_diff_mean": _number(r, "abs_logp_diff_mean"),
                     "loss": _number(r, "loss"), "grad_norm": _number(r, "grad_norm"),
                     "offload_gb": r.get("offload_bytes", 0.0) / 1e9, "sync_gb": r.get("sync_bytes", 0.0) / 1e9})
    return rows


def phases_sum_to_step(row: dict[str, Any]) -> bool:
    relative, absolute = PHASE_SUM_TOLERANCE
    return math.isfinite(row["phases_gap_s"]) and abs(row["phases_gap_s"]) <= relative * row["step_s"] + absolute


def steady(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of the steps from STEADY_FROM on: step time, tokens/s per device, each phase,
    and what was recorded apart (NOT_RECORDED where no steady step has it)."""
    late = [row for row in rows if row["step"] >= STEADY_FROM]

    def median(key: str) -> Any:
        values = [row[key] for row in late if isinstance(row[key], float)]
        if not late:
            return float("nan")
        return statistics.median(values) if values else NOT_RECORDED

    out: dict[str, Any] = {"steady_steps": ",".join(str(row["step"]) for row in late) or "none",
                           "steady_step_s": median("step_s"),
                           "steady_tokens_per_s_per_device": median("tokens_per_s_per_device"),
                           **{f"steady_{p}_s": median(f"{p}_s") for p in PHASES}}
    out.update({name: median(name) for name in APART})
    return out


def judge(out: Outcome, rows: list[dict[str, Any]], profile: Profile, *, exited: int | None, devices: int,
          responses: int, precision: str) -> None:
    """Add the steps' numbers and criteria to ``out`` (``rows`` from :func:`step_rows`, at least
    one; ``exited``: the run's exit status, None when it was stopped; ``precision``: what the
    trainer and the engine compute in, for the criterion's wording)."""
    last = rows[-1]
    agreement = min(row["routing_agreement"] for row in rows)
    gap = max(row["abs_logp_diff_mean"] for row in rows)
    worst_sum = max(rows, key=lambda row: abs(row["phases_gap_s"]) if math.isfinite(row["phases_gap_s"]) else math.inf)
    out.numbers.update(
        steps=len(rows), devices=devices, responses_per_step=responses, **steady(rows),
        first_step_s=rows[0]["step_s"], **{f"last_step_{p}_s": last[f"{p}_s"] for p in PHASES},
        last_step_s=last["step_s"], last_tokens_per_s_per_device=last["tokens_per_s_per_device"],
        last_rollout_tokens_per_s=last["rollout_tokens_per_s"],
        routing_agreement_min=agreement, abs_logp_diff_mean_max=gap,
        offload_gb=max(row["offload_gb"] for row in rows), sync_gb=last["sync_gb"])
    out.require(len(rows) >= profile.loop_steps and exited == 0,
                f"{len(rows)} of {profile.loop_steps} steps recorded and the run exited 0 (status {exited})")
    out.require(all(finite(row["loss"], row["grad_norm"], row["step_s"], row["abs_logp_diff_mean"]) for row in rows),
                "every step's loss, grad norm, |Δ log p| and time are finite")
    relative, absolute = PHASE_SUM_TOLERANCE
    out.require(all(phases_sum_to_step(row) for row in rows),
                f"every step's phases ({', '.join(PHASES)}) sum to its time within {relative:.1%} + "
                f"{absolute * 1e3:.0f} ms (largest gap {worst_sum['phases_gap_s']:+.4f} s at step {worst_sum['step']})")
    out.require(math.isfinite(agreement) and agreement >= profile.loop_routing_min,
                f"routing agreement (trainer's own vs the engine's, the pairs R3 replays) ≥ "
                f"{profile.loop_routing_min:g} at every step (min {agreement:.4f})")
    out.require(gap <= profile.logp_mean_tol,
                f"mean |log π − log μ| ({precision}) ≤ {profile.logp_mean_tol:g} at every step (max {gap:.2e})")
    unrecorded = [name for name in APART if all(row[name] == NOT_RECORDED for row in rows)]
    if unrecorded:
        out.notes.append(f"Not recorded by this run's loop: {', '.join(unrecorded)} (its metrics.jsonl has none of "
                         f"{', '.join(k for name in unrecorded for k in APART[name])}).")
