"""``python -m bpo_megatron.gpu_smoke --out DIR [--device cpu] [--checks a,b] [--timeout S]
[--budgets a=S,b=S] [--total S]``.

Each check runs in a child process (``python -m bpo_megatron.gpu_smoke.child``) with a time limit:
its ``--budgets`` entry, else ``--timeout``, and never more than what is left of ``--total`` (a
check with less than ``MIN_START_S`` left is reported as not run). The report is rewritten after
every check, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bpo_megatron.gpu_smoke.checks import CHECKS
from bpo_megatron.gpu_smoke.report import Outcome, environment, verdict, write

MIN_START_S = 10.0  # a check is not started with less than this left of --total
BUDGET_ENV = "BPO_GPU_SMOKE_BUDGET_S"  # tells a check its own limit (one that runs a subprocess bounds it)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bpo_megatron.gpu_smoke", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="directory for report.json and report.md")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cuda: the GPU profile; cpu: the tiny CPU profile (CUDA hidden from the checks); "
                             "auto: cuda when a GPU is visible")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of: {', '.join(CHECKS)}")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each check may take (default 300)")
    parser.add_argument("--budgets", default="", metavar="NAME=S,...",
                        help="per-check limits in seconds, in place of --timeout for the checks named")
    parser.add_argument("--total", type=float, default=None, metavar="S",
                        help="seconds the whole run may take: a check's limit is cut to what is left, and a "
                             f"check with less than {MIN_START_S:.0f} s left is reported as not run")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where checks write checkpoints (default: a temporary directory, removed after)")
    return parser


def _resolve_device(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _budgets(text: str) -> dict[str, float]:
    """``a=120,b=30`` -> {"a": 120.0, "b": 30.0}; ValueError naming a malformed entry."""
    budgets = {}
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        name, sep, seconds = entry.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = float("nan")
        if not sep or not value > 0:
            raise ValueError(f"--budgets: {entry!r} is not NAME=SECONDS with SECONDS > 0")
        budgets[name.strip()] = value
    return budgets


def _run_child(name: str, device: str, workdir: Path, timeout: float) -> Outcome:
    result = workdir / f"{name}.result.json"
    env = dict(os.environ)
    env[BUDGET_ENV] = f"{timeout:.0f}"
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU profile must not touch a GPU that happens to be there
    env.setdefault("PYTHONUNBUFFERED", "1")
    command = [sys.executable, "-m", "bpo_megatron.gpu_smoke.child", name, "--device", device,
               "--workdir", str(workdir), "--result", str(result)]
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the check and anything it started
        process.wait()
        return Outcome(name, error=f"check {name!r} did not finish within its limit of {timeout:.0f} s",
                       seconds=time.perf_counter() - start)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    if not result.exists():
        return Outcome(name, error=f"check {name!r} exited with status {process.returncode} and wrote no result",
                       seconds=time.perf_counter() - start)
    return Outcome(**json.loads(result.read_text()))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    names = [n.strip() for n in args.checks.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        print(f"error: --checks: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(CHECKS)}",
              file=sys.stderr)
        return 2
    try:
        budgets = _budgets(args.budgets)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if unknown := [n for n in budgets if n not in CHECKS]:
        print(f"error: --budgets: unknown {', '.join(unknown)}; choose from {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    device = _resolve_device(args.device)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda, but torch sees no GPU (use --device cpu for the CPU profile)", file=sys.stderr)
            return 2
    env = environment() if device == "cuda" else {**environment(), "device": "cpu"}
    outcomes: list[Outcome] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bpo-gpu-smoke-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        for name in names:
            limit = budgets.get(name, args.timeout)
            left = None if args.total is None else args.total - (time.perf_counter() - started)
            if left is not None and left < MIN_START_S:
                outcome = Outcome(name, error=f"not run: {max(left, 0):.0f} s left of --total {args.total:.0f} s "
                                              f"(its budget: {limit:.0f} s)")
                outcomes.append(outcome)
                write(args.out, env, outcomes, profile=device)
                print(f"[gpu-smoke] {name}: not run ({max(left, 0):.0f} s left of --total)", flush=True)
                continue
            limit = limit if left is None else min(limit, left)
            print(f"[gpu-smoke] {name} (limit {limit:.0f} s) ...", flush=True)
            outcome = _run_child(name, device, workdir, limit)
            outcomes.append(outcome)
            write(args.out, env, outcomes, profile=device)
            print(f"[gpu-smoke] {name}: {verdict(outcome)} ({outcome.seconds:.1f} s)", flush=True)
            for line in outcome.criteria:
                print(f"    {line}", flush=True)
            if outcome.error:
                print("    " + outcome.error.strip().replace("\n", "\n    ")[-3000:], flush=True)
    failed = [o.name for o in outcomes if not o.passed]
    print(f"[gpu-smoke] {len(outcomes) - len(failed)} of {len(outcomes)} checks passed"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f"; report: {args.out / 'report.md'}")
    return 1 if failed else 0
