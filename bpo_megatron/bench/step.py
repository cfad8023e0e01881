"""Benchmark: where an RL step of the CPU demo goes — rollout, training, weight sync, and the
driver's own work (scoring, advantages, batching, bookkeeping), measured by the loop itself.

Runs ``configs/tiny_moe_cpu.yaml`` for a few steps (no evaluation, no checkpoints, no supervised
warm start), drops the first step (warm-up) and prints each part's mean seconds and share of the
mean step (the parts add up to it), with the bytes the driver wrote into the object store for the
trainer per step.
The driver's share is the number to watch: everything the driver does between the engines and
the trainer is time neither of them computes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe_cpu.yaml"
PARTS = (("rollout", "time/rollout_s"), ("train", "time/train_s"), ("weight sync", "time/sync_s"),
         ("driver", "time/driver_s"))


@dataclass(frozen=True)
class StepSplit:
    seconds: dict[str, float]  # part -> mean seconds
    step_s: float  # mean step
    to_trainer_mb: float  # mean object-store writes for the trainer per step
    steps: int

    def share(self, part: str) -> float:
        return self.seconds[part] / self.step_s


def measure(steps: int = 12, config: Path = DEMO, overrides: tuple[str, ...] = ()) -> StepSplit:
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.loop.rl_loop import run
    from bpo_megatron.observability.metrics import read_metrics

    with tempfile.TemporaryDirectory(prefix="bench-step-") as scratch:
        cfg = load_experiment(config, [f"train.steps={steps}", "eval.every=0", "eval.at_start=false",
                                       "checkpoint.every=0", "train.sft_warmup_steps=0",
                                       f"logging.run_dir={Path(scratch) / 'run'}", "logging.tensorboard=false",
                                       "logging.progress=false", *overrides])
        run(cfg, echo=lambda line: None)
        records = [r for r in read_metrics(Path(scratch) / "run") if r["step"] > 1]
    mean = lambda key: statistics.fmean(r[key] for r in records)  # noqa: E731
    return StepSplit({part: mean(key) for part, key in PARTS}, mean("time/step_s"),
                     mean("driver/to_trainer_mb"), len(records))


def format_table(split: StepSplit) -> str:
    lines = [f"RL step of the CPU demo, mean of {split.steps} steps (the first dropped): "
             f"{split.step_s:.3f} s; object-store writes for the trainer {split.to_trainer_mb:.2f} MiB per step",
             "", "| part | seconds (mean) | share of the step |", "|---|---:|---:|"]
    lines += [f"| {part} | {split.seconds[part]:.3f} | {split.share(part):.1%} |" for part, _ in PARTS]
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the demo config")
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    args = build_parser(parser).parse_args(argv)
    print(format_table(measure(args.steps, overrides=tuple(args.overrides))))
    return 0
