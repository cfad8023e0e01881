"""``python -m bpo_megatron.gpu_smoke.round_report OUT --device cuda|cpu``: the report of one GPU
visit (``tools/gpu/round.sh``), written as ``OUT/<device>-<date>.md`` and ``.json`` (``h100``,
``h200``, ...; ``cpu`` for a dry run) to copy to ``docs/gpu-validation/``.

It gathers what the round left in ``OUT``: ``parts.tsv`` (each part's limit, time and exit
status), ``gpu.txt`` (nvidia-smi), ``install.txt``, ``cuda_tests.txt`` (pytest's output: its
counts, failures and skips) and the kit's reports of the round's kit parts (``kit/report.json``,
``kit-rest/report.json``: the checks, in the order they ran). Whatever is missing (a part cut
short) is reported as missing. It states which goals hold (:mod:`bpo_megatron.gpu_smoke.goals`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
from pathlib import Path
from typing import Any

from bpo_megatron.gpu_smoke.goals import goal_lines, judge_goals
from bpo_megatron.gpu_smoke.report import Outcome, markdown

# The checkout the round ran in: its path is left out of the report (a report names files as the
# repository does, not as the machine it ran on holds them).
CHECKOUT = Path(__file__).resolve().parents[2]
COUNTS = ("passed", "failed", "skipped", "errors", "error", "deselected", "xfailed", "xpassed")
TAIL_LINES = 40


def device_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA H200`` -> ``h200``, ``cpu`` -> ``cpu``: the
    model of the GPU (a letter and two or three digits), else the name made file-safe."""
    if match := re.search(r"\b(GH|[A-Z])(\d{2,3})\b", name):
        return (match.group(1) + match.group(2)).lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def pytest_summary(text: str) -> dict[str, Any]:
    """The counts of pytest's closing line, its failures and skips (``-rs``), and whether it closed."""
    closing = next((line for line in reversed(text.splitlines()) if re.search(r"\b(passed|failed|skipped|error|"
                                                                             r"errors|deselected|no tests ran)\b",
                                                                             line)), "")
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (" + "|".join(COUNTS) + r")\b", closing)}
    if "error" in counts:
        counts["errors"] = counts.pop("error") + counts.get("errors", 0)
    failures = [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    skips = [line for line in text.splitlines() if line.startswith("SKIPPED ")]
    return {"closing_line": closing.strip("= "), "counts": counts, "failures": failures, "skips": skips,
            "timed_out": "did not finish within" in text}


def _parts(out: Path) -> list[dict[str, str]]:
    path = out / "parts.tsv"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"))) for line in lines[1:] if line.strip()]


def _part_result(part: dict[str, str]) -> str:
    status = part.get("status", "")
    if status == "0":
        return "ok"
    if status == "124":
        return "**cut at its limit**"
    if status == "not run":
        return "not run"
    return f"exit {status}"


def _kit_reports(out: Path, parts: list[dict[str, str]]) -> dict[str, Any]:
    """The kit's reports of the round's kit parts (``kit``, ``kit-rest``) merged: their checks in the
    order they ran, the first one's environment."""
    names = [p["part"] for p in parts if p.get("part", "").startswith("kit")] or ["kit"]
    merged: dict[str, Any] = {"environment": {}, "checks": []}
    for name in names:
        path = out / name / "report.json"
        if path.is_file():
            kit = json.loads(path.read_text())
            merged["environment"] = merged["environment"] or kit.get("environment", {})
            merged["profile"] = merged.get("profile") or kit.get("profile")
            merged["checks"] += kit.get("checks", [])
    merged["passed"] = bool(merged["checks"]) and all(c["passed"] for c in merged["checks"])
    return merged


def gather(out: Path, device: str) -> dict[str, Any]:
    parts = _parts(out)
    kit = _kit_reports(out, parts)
    gpu = (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").is_file() else ""
    name = kit["environment"].get("device") or (gpu.split(",")[0] if gpu and device == "cuda" else device)
    tests_text = (out / "cuda_tests.txt").read_text(errors="replace") if (out / "cuda_tests.txt").is_file() else ""
    tests_text = tests_text.replace(f"{CHECKOUT}/", "")
    tests = pytest_summary(tests_text) if tests_text else {"closing_line": "missing: the CUDA tests did not run",
                                                          "counts": {}, "failures": [], "skips": [], "timed_out": False}
    tests["tail"] = tests_text.splitlines()[-TAIL_LINES:]
    if device == "cpu":
        tests["note"] = "CUDA hidden (a dry run): every CUDA test skips"
    checks = kit.get("checks", [])
    return {
        "round": {"device": device, "device_name": name, "slug": device_slug("cpu" if device == "cpu" else name),
                  "date": datetime.date.today().isoformat(), "nvidia_smi": gpu, "parts": parts,
                  "seconds": sum(float(p.get("seconds") or 0) for p in parts),
                  "install": (out / "install.txt").read_text(errors="replace")[-2000:]
                  if (out / "install.txt").is_file() else "",
                  "cuda_tests": tests,
                  "goals": judge_goals(checks),
                  "passed": bool(checks) and all(c["passed"] for c in checks)
                  and not tests["counts"].get("failed") and not tests["counts"].get("errors")
                  and not tests["timed_out"]},
        **kit,
    }


def layer_specs_line(checks: list[dict[str, Any]]) -> str:
    """Which trainer layer specs (``model.layer_spec``) the round trained: the kit's trainer_step
    runs transformer-engine's beside the local spec where transformer-engine is installed."""
    step = next((c for c in checks if c.get("name") == "trainer_step"), None)
    if step is None:
        return "Layer specs trained: none (trainer_step did not run)."
    if "layer_specs" not in step.get("numbers", {}):
        return "Layer specs trained: not reported (trainer_step failed first, or predates model.layer_spec)."
    ran = step["numbers"]["layer_specs"]
    why = next((note for note in step.get("notes", []) if note.startswith("model.layer_spec=transformer_engine")), "")
    return f"Layer specs trained (trainer_step): {ran}" + (f"; {why}" if why else "") + "."


def to_markdown(report: dict[str, Any]) -> str:
    r = report["round"]
    tests = r["cuda_tests"]
    lines = [f"# GPU validation round: {r['device_name']}, {r['date']}", "",
             f"`tools/gpu/round.sh` ({'dry run, CPU profile' if r['device'] == 'cpu' else 'GPU profile'}): "
             f"{r['seconds']:.0f} s in all; {'everything passed' if r['passed'] else 'NOT everything passed'}.",
             ""]
    if r["nvidia_smi"]:
        lines += [f"nvidia-smi: {r['nvidia_smi']}", ""]
    lines += [layer_specs_line(report.get("checks", [])), ""]
    lines += goal_lines(r["goals"], dry_run=r["device"] == "cpu") + [""]
    lines += ["| part | limit (s) | seconds | result | note |", "|---|---|---|---|---|"]
    lines += [f"| {p.get('part')} | {p.get('limit_s')} | {p.get('seconds')} | {_part_result(p)} | "
              f"{p.get('note', '').replace('|', '/')} |" for p in r["parts"]]
    lines += ["", "## CUDA-only tests", "", f"pytest: {tests['closing_line'] or '(no closing line)'}"
              + (f" ({tests['note']})" if tests.get("note") else "")]
    if tests["failures"]:
        lines += [""] + [f"- {line}" for line in tests["failures"]]
    if tests["skips"]:
        lines += ["", "Skipped:"] + [f"- {line}" for line in tests["skips"][:20]]
    if tests["failures"] or tests["timed_out"]:
        lines += ["", "```", *tests["tail"], "```"]
    outcomes = [Outcome(**c) for c in report.get("checks", [])]
    if outcomes:
        kit = markdown(report.get("environment", {}), outcomes, profile=report.get("profile", r["device"]))
        lines += ["", re.sub(r"^# GPU smoke report", "## The kit", kit, count=1).replace("\n## ", "\n### ")]
    else:
        lines += ["", "## The kit", "", "missing: the kit wrote no report"]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bpo_megatron.gpu_smoke.round_report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    report = gather(args.out, args.device)
    stem = args.out / f"{report['round']['slug']}-{report['round']['date']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    stem.with_suffix(".md").write_text(to_markdown(report))
    print(f"[round] report: {stem}.md and .json ({'passed' if report['round']['passed'] else 'NOT all passed'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
