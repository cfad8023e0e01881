"""The ``bpo-megatron`` command line: one registry of sub-commands, each a module whose
``main(argv)`` takes the arguments after the command's name and returns the exit status.

    bpo-megatron train CONFIG [section.key=value ...]
    bpo-megatron bench logprobs [--tokens N --vocab V --tp 1 2 --dtype fp32 bf16]
    bpo-megatron convert mcore-to-hf --ckpt CKPT --out HF [--hf-config HF_OR_CONFIG_JSON]

Each module is imported only when its command runs (Megatron-Core and NeMo-Run take seconds).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from bpo_megatron.registry import LazyRegistry


@dataclass(frozen=True)
class Command:
    help: str
    module: str  # holds main(argv: list[str]) -> int


COMMANDS: dict[str, Command] = {
    "train": Command("run an RL experiment from a YAML config with dotted overrides", "bpo_megatron.commands.train"),
    "eval": Command("Avg@k of a checkpoint or Hugging Face model on the config's eval datasets",
                    "bpo_megatron.commands.evaluate"),
    "compare": Command("run BPO and the baselines (or a sweep) over seeds; write the results table and curves",
                       "bpo_megatron.commands.compare"),
    "plot": Command("write PNG curves (reward, eval accuracy) of one or more run directories",
                    "bpo_megatron.commands.plot"),
    "plan": Command("check a parallel layout and estimate memory per GPU (training and rollout); --sweep",
                    "bpo_megatron.planner.cli"),
    "launch": Command("launch an experiment or a sweep with NeMo-Run: local | slurm (Ray on Slurm) | kuberay",
                      "bpo_megatron.launch.cli"),
    "convert": Command("convert checkpoints between Hugging Face and Megatron-Core (hf-to-mcore | mcore-to-hf)",
                       "bpo_megatron.convert.cli"),
    "bench": Command("run a benchmark that prints a ratio table (ours vs the reference)", "bpo_megatron.bench"),
}
_MODULES = LazyRegistry({name: c.module for name, c in COMMANDS.items()},
                        unknown="unknown command {name!r}; choose one of {sorted_listed}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="bpo-megatron", description="RL post-training of MoE LLMs with BPO.")
    parser.add_argument("command", choices=list(COMMANDS), help=" | ".join(f"{n}: {c.help}" for n, c in COMMANDS.items()))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args = parser.parse_args(argv[:1])
    return _MODULES.load(args.command).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
