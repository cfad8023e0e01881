"""The ``bpo-megatron`` command line: one registry of sub-commands.

    bpo-megatron bench logprobs [--tokens N --vocab V --tp 1 2 --dtype fp32 bf16]
    bpo-megatron convert hf-to-mcore --hf-dir HF --out CKPT [--tp N --ep N --pp N]
    bpo-megatron convert mcore-to-hf --ckpt CKPT --out HF [--hf-config HF_OR_CONFIG_JSON]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

from bpo_megatron.registry import LazyRegistry


@dataclass(frozen=True)
class Command:
    help: str
    run: Callable[[list[str]], int]  # receives the arguments after the command name


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str) -> Callable[[Callable[[list[str]], int]], Callable[[list[str]], int]]:
    def register(run: Callable[[list[str]], int]) -> Callable[[list[str]], int]:
        COMMANDS[name] = Command(help=help, run=run)
        return run

    return register


# Benchmarks are imported on use: each pulls in Megatron-Core, which takes seconds to import.
BENCHMARKS = LazyRegistry({
    "async": "bpo_megatron.bench.asynchronous",
    "background-eval": "bpo_megatron.bench.background_eval",
    "logprobs": "bpo_megatron.bench.logprobs",
    "ops": "bpo_megatron.bench.ops",
    "packing": "bpo_megatron.bench.packing",
    "rollout": "bpo_megatron.bench.rollout",
    "sglang-concurrency": "bpo_megatron.bench.sglang_concurrency",
    "step": "bpo_megatron.bench.step",
}, unknown="unknown benchmark {name!r}; choose one of {sorted_listed}")


@command("bench", "run a benchmark that prints a ratio table (ours vs the reference)")
def _bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bpo-megatron bench", add_help=False)
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    args = parser.parse_args(argv[:1])
    module = BENCHMARKS.load(args.name)
    bench_parser = argparse.ArgumentParser(prog=f"bpo-megatron bench {args.name}", description=module.__doc__)
    return module.main(argv[1:], bench_parser)


@command("convert", "convert checkpoints between Hugging Face and Megatron-Core (hf-to-mcore | mcore-to-hf)")
def _convert(argv: list[str]) -> int:
    from bpo_megatron.convert.cli import main as convert_main

    return convert_main(argv, prog="bpo-megatron convert")


@command("train", "run an RL experiment from a YAML config with dotted overrides")
def _train(argv: list[str]) -> int:
    from bpo_megatron.commands.train import main as train_main

    return train_main(argv)


@command("plot", "write PNG curves (reward, eval accuracy) of one or more run directories")
def _plot(argv: list[str]) -> int:
    from bpo_megatron.commands.plot import main as plot_main

    return plot_main(argv)


@command("eval", "Avg@k of a checkpoint or Hugging Face model on the config's eval datasets")
def _eval(argv: list[str]) -> int:
    from bpo_megatron.commands.evaluate import main as eval_main

    return eval_main(argv)


@command("compare", "run BPO and the baselines (or a sweep) over seeds; write the results table and curves")
def _compare(argv: list[str]) -> int:
    from bpo_megatron.commands.compare import main as compare_main

    return compare_main(argv)


@command("launch", "launch an experiment or a sweep with NeMo-Run: local | slurm (Ray on Slurm) | kuberay")
def _launch(argv: list[str]) -> int:
    from bpo_megatron.launch.cli import main as launch_main

    return launch_main(argv)


@command("plan", "check a parallel layout and estimate memory per GPU (training and rollout); --sweep")
def _plan(argv: list[str]) -> int:
    from bpo_megatron.planner.cli import main as plan_main

    return plan_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="bpo-megatron", description="RL post-training of MoE LLMs with BPO.")
    parser.add_argument("command", choices=sorted(COMMANDS), help=" | ".join(f"{n}: {c.help}" for n, c in COMMANDS.items()))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args = parser.parse_args(argv[:1])
    return COMMANDS[args.command].run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
