"""Benchmark: the CPU demo's wall time with evaluation inline against eval.mode=background.

Inline, the rollout engines evaluate while training waits; in the background an evaluation engine
of its own does while training goes on. Both run the same evaluation schedule, measured side by
side in one process.

Each round runs ``configs/tiny_moe_cpu.yaml`` once per mode, the modes alternating (inline,
background, inline, ...) so both see the same machine load; one Ray instance serves every run.
The table gives each run's wall time (actors' start included) and its time from the warm start on
(the first ``sft`` line; the actors' start excluded), the mean per mode and the ratio background /
inline, and whether every evaluation (each step's correct and total responses, Avg@k) is the same
in every run.

The overlap only helps as far as the machine has a core for the evaluation engine while the trainer
trains (a cluster gives evaluation engines GPUs of their own). On 2 cores the demo's two trainer
ranks leave none (``--trainer-ranks 2``), so by default the trainer is one rank (``parallel.ep=1``)
and an evaluation (64 questions × 64 responses) is about eight steps' work, every 8 steps.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe_cpu.yaml"
MODES = ("inline", "background")
# A warm start after which the tiny model answers some sums (non-zero evaluations to compare)
WARM_START = ("train.sft_warmup_steps=10", "train.sft_batch_size=32", "train.sft_lr=0.01")
LAYOUTS = {1: ("cluster.trainer_ranks=1", "parallel.ep=1"), 2: ()}  # trainer ranks -> overrides (2: the demo's)


@dataclass(frozen=True)
class Timing:
    mode: str
    round: int
    wall_s: float  # the whole run
    from_warm_start_s: float  # from the warm start's first line to the end
    evaluations: dict[int, dict[str, float]]  # step -> its eval/* metrics


def overrides_for(mode: str, steps: int, every: int, k: int = 16, extra: tuple[str, ...] = ()) -> list[str]:
    return [f"train.steps={steps}", f"eval.every={every}", f"eval.k={k}", "eval.at_start=true", "checkpoint.every=0",
            *WARM_START, f"eval.mode={mode}", "logging.tensorboard=false", "logging.progress=false", *extra]


def measure(mode: str, round_: int, steps: int, every: int, k: int = 16, extra: tuple[str, ...] = (),
            config: Path = DEMO) -> Timing:
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.loop.rl_loop import run
    from bpo_megatron.observability.metrics import read_metrics

    with tempfile.TemporaryDirectory(prefix="bench-eval-") as scratch:
        cfg = load_experiment(config, [*overrides_for(mode, steps, every, k, extra),
                                       f"logging.run_dir={Path(scratch) / 'run'}"])
        warm: list[float] = []

        def echo(line: str) -> None:
            if line.startswith("sft ") and not warm:
                warm.append(time.perf_counter())

        start = time.perf_counter()
        run(cfg, echo=echo)
        end = time.perf_counter()
        evaluations = {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")}
                       for r in read_metrics(Path(scratch) / "run") if any(k.startswith("eval/") for k in r)}
    return Timing(mode, round_, end - start, end - (warm[0] if warm else start), evaluations)


def run_rounds(rounds: int, steps: int, every: int, k: int = 16, extra: tuple[str, ...] = ()) -> list[Timing]:
    """Every mode once per round, alternating, in one Ray instance (started here when none is)."""
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.orchestration.cluster import start_ray, stop_ray

    cfg = load_experiment(DEMO, overrides_for("background", steps, every, k, extra))
    started = start_ray(cfg.cluster, cpus_needed=cfg.cluster.trainer_ranks + 2 * cfg.rollout.num_engines)
    try:
        return [measure(mode, r, steps, every, k, extra) for r in range(rounds) for mode in MODES]
    finally:
        if started:
            stop_ray()


def format_table(timings: list[Timing], steps: int, every: int, k: int = 16) -> str:
    base = timings[0].evaluations
    identical = all(t.evaluations == base for t in timings)
    mean = {mode: statistics.fmean(t.wall_s for t in timings if t.mode == mode) for mode in MODES}
    warm = {mode: statistics.fmean(t.from_warm_start_s for t in timings if t.mode == mode) for mode in MODES}
    lines = [f"CPU demo, {steps} RL steps, evaluation (eval.k={k} responses a question) every {every} step(s) and "
             f"at step 0 ({len(base)} evaluations a run), modes alternating", "",
             "| round | eval.mode | wall s | from warm start s |", "|---:|---|---:|---:|"]
    lines += [f"| {t.round + 1} | {t.mode} | {t.wall_s:.1f} | {t.from_warm_start_s:.1f} |" for t in timings]
    lines += ["", "| eval.mode | mean wall s | vs inline | mean from warm start s | vs inline |",
              "|---|---:|---:|---:|---:|"]
    lines += [f"| {mode} | {mean[mode]:.1f} | {mean[mode] / mean['inline']:.2f}× | {warm[mode]:.1f} | "
              f"{warm[mode] / warm['inline']:.2f}× |" for mode in MODES]
    means = ", ".join(f"{step}: {metrics.get(key, float('nan')):.3f}" for step, metrics in sorted(base.items())
                      for key in [next((k for k in metrics if k.startswith("eval/mean_avg@")), "")])
    lines += ["", f"evaluations identical in every run: {'yes' if identical else 'NO'} (mean Avg@k by step: {means})"]
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--every", type=int, default=8, help="eval.every")
    parser.add_argument("--k", type=int, default=64, help="eval.k: responses per question (the demo's 4 makes an "
                        "evaluation about a step's work, 64 about eight steps' with one trainer rank)")
    parser.add_argument("--trainer-ranks", type=int, choices=sorted(LAYOUTS), default=1,
                        help="1: parallel.ep=1 (a core free for the evaluation engine); 2: the demo's EP=2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the demo config")
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    args = build_parser(parser).parse_args(argv)
    timings = run_rounds(args.rounds, args.steps, args.every, args.k, (*LAYOUTS[args.trainer_ranks], *args.overrides))
    print(format_table(timings, args.steps, args.every, args.k))
    return 0
