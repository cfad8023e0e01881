"""Benchmark: the CPU demo's RL throughput with rollouts generated ahead of training
(``train.async.max_staleness`` k = 1, 2) against the synchronous loop (k = 0), measured side by
side in one run with the same model and settings.

Each k runs ``configs/tiny_moe_cpu.yaml`` for a few steps on engines apart from the trainer
(``cluster.colocate=false``; no evaluation, checkpoints or warm start), drops the first step
(warm-up, and nothing is under way yet) and reports steps per minute, response tokens per second
(generated and trained on) and the ratio to k = 0. The overlap can only help as far as the
machine runs the engines and the trainer at the same time: on 2 CPU cores both compete for them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe_cpu.yaml"


@dataclass(frozen=True)
class Throughput:
    staleness: int
    step_s: float  # mean seconds per step
    tokens_per_step: float  # response tokens per step
    rollout_s: float  # mean seconds per step the driver waited for generation
    train_s: float
    steps: int

    @property
    def steps_per_minute(self) -> float:
        return 60.0 / self.step_s

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_s


def measure(staleness: int, steps: int = 10, config: Path = DEMO, overrides: tuple[str, ...] = ()) -> Throughput:
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.loop.rl_loop import run
    from bpo_megatron.observability.metrics import read_metrics

    with tempfile.TemporaryDirectory(prefix="bench-async-") as scratch:
        cfg = load_experiment(config, [f"train.steps={steps}", "eval.every=0", "eval.at_start=false",
                                       "checkpoint.every=0", "train.sft_warmup_steps=0", "cluster.colocate=false",
                                       f"train.async.max_staleness={staleness}",
                                       f"logging.run_dir={Path(scratch) / 'run'}", "logging.tensorboard=false",
                                       "logging.progress=false", *overrides])
        run(cfg, echo=lambda line: None)
        records = [r for r in read_metrics(Path(scratch) / "run") if r["step"] > 1]
    mean = lambda key: statistics.fmean(r[key] for r in records)  # noqa: E731
    responses = cfg.train.prompts_per_step * cfg.rollout.group_size
    return Throughput(staleness, mean("time/step_s"), responses * mean("response_length_mean"),
                      mean("time/rollout_s"), mean("time/train_s"), len(records))


def format_table(results: list[Throughput]) -> str:
    base = results[0]
    lines = [f"RL steps of the CPU demo, engines apart from the trainer, mean of {base.steps} steps each "
             "(the first dropped)", "",
             "| train.async.max_staleness | steps/min | response tokens/s | vs k = 0 | waiting for rollouts (s/step) "
             "| training (s/step) |", "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.staleness} | {r.steps_per_minute:.1f} | {r.tokens_per_second:.1f} | "
              f"{r.steps_per_minute / base.steps_per_minute:.2f}× | {r.rollout_s:.3f} | {r.train_s:.3f} |"
              for r in results]
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the demo config")
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    args = build_parser(parser).parse_args(argv)
    results = [measure(k, args.steps, overrides=tuple(args.overrides)) for k in args.staleness]
    print(format_table(results))
    return 0
