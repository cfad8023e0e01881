"""Check outcomes and the report: ``report.json`` (machine-readable) and ``report.md``."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform as host_platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Outcome:
    """One check: whether every criterion held, the numbers measured and what was compared."""

    name: str
    passed: bool = False
    numbers: dict[str, Any] = field(default_factory=dict)
    criteria: list[str] = field(default_factory=list)  # "what must hold: measured" lines
    notes: list[str] = field(default_factory=list)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    seconds: float = 0.0
    error: str = ""

    def require(self, condition: bool, what: str) -> bool:
        """Record a pass criterion; the check passes only if all of them hold."""
        self.criteria.append(f"{'PASS' if condition else 'FAIL'}: {what}")
        return condition

    def finish(self) -> Outcome:
        self.passed = not self.error and bool(self.criteria) and all(c.startswith("PASS") for c in self.criteria)
        return self


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": host_platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "-",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    for package in ("megatron-core", "transformers", "transformer-engine", "triton", "bpo-megatron"):
        env[package] = _version(package)
    if torch.cuda.is_available():
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        try:
            version = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as error:  # noqa: BLE001 - a report field, not a check
            env["nccl"] = f"unknown ({type(error).__name__})"
    return env


def write(out: Path, env: dict[str, Any], outcomes: list[Outcome], *, profile: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = {"environment": env, "profile": profile, "passed": all(o.passed for o in outcomes),
               "checks": [asdict(o) for o in outcomes]}
    (out / "report.json").write_text(json.dumps(payload, indent=1, default=str))
    (out / "report.md").write_text(markdown(env, outcomes, profile=profile))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def verdict(outcome: Outcome, *, bold: bool = False) -> str:
    """pass, FAIL, or "not run" (a check that could not start: no time left, Ray missing)."""
    if outcome.passed:
        return "pass"
    if outcome.error.startswith("not run"):
        return "not run"
    return "**FAIL**" if bold else "FAIL"


def markdown(env: dict[str, Any], outcomes: list[Outcome], *, profile: str) -> str:
    lines = [f"# GPU smoke report ({profile} profile)", "",
             " · ".join(f"{k}: {v}" for k, v in env.items()), "",
             "| check | result | seconds |", "|---|---|---|"]
    lines += [f"| {o.name} | {verdict(o, bold=True)} | {o.seconds:.1f} |" for o in outcomes]
    for o in outcomes:
        lines += ["", f"## {o.name}: {verdict(o)}", ""]
        lines += [f"- {c}" for c in o.criteria]
        if o.numbers:
            lines += ["", "| number | value |", "|---|---|"]
            lines += [f"| {k} | {_cell(v)} |" for k, v in o.numbers.items()]
        for title, rows in o.tables.items():
            if rows:
                keys = list(rows[0])
                lines += ["", f"**{title}**", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
                lines += ["| " + " | ".join(_cell(r.get(k, "")) for k in keys) + " |" for r in rows]
        lines += [""] + [f"> {n}" for n in o.notes] if o.notes else []
        if o.error:
            lines += ["", "```", o.error.rstrip()[-4000:], "```"]
    return "\n".join(lines) + "\n"
