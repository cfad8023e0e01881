"""Benchmarks shipped with the package: ``bpo-megatron bench NAME [options]``. Each measures ours
and the reference side by side in one run and prints a ratio table (docs/benchmarks.md); each
module's ``main(argv, parser)`` runs it."""

from __future__ import annotations

import argparse

from bpo_megatron.registry import LazyRegistry

# Imported on use: each pulls in Megatron-Core, which takes seconds to import.
BENCHMARKS = LazyRegistry({
    "async": "bpo_megatron.bench.asynchronous",
    "background-eval": "bpo_megatron.bench.background_eval",
    "checkpoint": "bpo_megatron.bench.checkpoint",
    "logprobs": "bpo_megatron.bench.logprobs",
    "ops": "bpo_megatron.bench.ops",
    "packing": "bpo_megatron.bench.packing",
    "rollout": "bpo_megatron.bench.rollout",
    "step": "bpo_megatron.bench.step",
    "sync": "bpo_megatron.bench.sync",
}, unknown="unknown benchmark {name!r}; choose one of {sorted_listed}")


def main(argv: list[str]) -> int:
    """``bpo-megatron bench NAME ...``: the named benchmark, given the rest of the arguments."""
    parser = argparse.ArgumentParser(prog="bpo-megatron bench", add_help=False)
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    args = parser.parse_args(argv[:1])
    module = BENCHMARKS.load(args.name)
    bench_parser = argparse.ArgumentParser(prog=f"bpo-megatron bench {args.name}", description=module.__doc__)
    return module.main(argv[1:], bench_parser)
