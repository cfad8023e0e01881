"""``bpo-megatron plan CONFIG [section.key=value ...]``: check a layout and estimate memory per GPU.

Prints the layout checks, the per-GPU memory of training (per pipeline stage) and of the rollout
engines, the micro-batches per data-parallel rank with their load imbalance and useful tokens for
a stated length distribution (``--lengths``), the host memory of the busiest trainer node at a
checkpoint save and at a load, and a verdict against the GPU's and the node's memory. ``--sweep`` lists every trainer layout that fits
the allocation instead. The model's architecture comes from ``model.path`` (a checkpoint
directory or just its ``config.json``) or ``--hf-config``; no weights are read.

Exit status: 0 fits (``--sweep``: at least one layout fits), 1 does not fit, 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from bpo_megatron.planner.batches import LENGTH_DISTRIBUTIONS
from bpo_megatron.planner.host import DEFAULT_NODE_HOST_MEMORY_GB


NEUTRAL_LAYOUT = ["parallel.tp=1", "parallel.pp=1", "parallel.ep=1", "parallel.etp=null", "cluster.trainer_ranks=1"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bpo-megatron plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="experiment YAML (e.g. configs/qwen3_30b_a3b_bpo.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2 cluster.trainer_ranks=16")
    parser.add_argument("--hf-config", help="Hugging Face config.json (or its directory) to plan for, "
                                            "instead of model.path")
    parser.add_argument("--nodes", type=int, help="nodes (default: cluster.nodes)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: cluster.gpus_per_node)")
    parser.add_argument("--gpu-memory-gb", type=float, help="memory of one GPU in GB (default: cluster.gpu_memory_gb)")
    parser.add_argument("--host-memory-gb", type=float,
                        help="host memory of one node in GB, which a checkpoint save must fit in (default: "
                             f"{DEFAULT_NODE_HOST_MEMORY_GB:g})")
    parser.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
                        help="shard optimizer states over DP (default: optimizer.distributed, unset on for GPUs, as the "
                             "trainer does)")
    parser.add_argument("--lengths", choices=sorted(LENGTH_DISTRIBUTIONS), default="paper",
                        help="prompt and response lengths to estimate micro-batches per DP rank, imbalance and "
                             "useful tokens for, padded against packed (default: paper; max: every sample at "
                             "the caps); see bpo_megatron/planner/batches.py")
    parser.add_argument("--sweep", action="store_true", help="list the trainer layouts that fit")
    parser.add_argument("--limit", type=int, default=20, help="layouts shown by --sweep (default 20)")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_intermixed_args(argv)
    from bpo_megatron.config import ConfigError
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.models.hf_config import HFModelConfig
    from bpo_megatron.planner.layout import Allocation
    from bpo_megatron.planner.plan import make_plan
    from bpo_megatron.planner.report import format_plan, format_sweep
    from bpo_megatron.planner.search import sweep

    flags = {"cluster.nodes": args.nodes, "cluster.gpus_per_node": args.gpus_per_node,
             "cluster.gpu_memory_gb": args.gpu_memory_gb}
    overrides = list(args.overrides) + [f"{k}={v}" for k, v in flags.items() if v is not None]
    if args.sweep:
        # the sweep chooses the layout itself: a configured one that does not split must not stop it
        overrides += NEUTRAL_LAYOUT
    try:
        # the layout is checked by the plan itself, so it can report every problem at once
        cfg = load_experiment(args.config, overrides, check_model=False)
        hf = HFModelConfig.load(args.hf_config or cfg.model.path)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"bpo-megatron plan: {exc}", file=sys.stderr)
        return 2
    allocation = Allocation.of(cfg)
    if args.host_memory_gb is not None:
        if not args.host_memory_gb > 0:
            print(f"bpo-megatron plan: --host-memory-gb must be > 0, got {args.host_memory_gb:g}", file=sys.stderr)
            return 2
        allocation = dataclasses.replace(allocation, host_memory_gb=args.host_memory_gb)
    if args.sweep:
        if not allocation.gpus_per_node:
            print("bpo-megatron plan: --sweep needs GPUs (--gpus-per-node or cluster.gpus_per_node)",
                  file=sys.stderr)
            return 2
        result = sweep(cfg, hf, allocation)
        print(format_sweep(result, allocation, limit=args.limit))
        return 0 if result.plans else 1
    plan = make_plan(cfg, hf, allocation, distributed_optimizer=args.distributed_optimizer, lengths=args.lengths)
    print(format_plan(plan))
    return 0 if plan.fits else 1
