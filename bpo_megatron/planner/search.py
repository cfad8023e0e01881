"""``plan --sweep``: every (tp, pp, cp, ep, etp) layout of the trainer that passes the checks and fits.

The trainer gets every GPU of the allocation when engines are colocated, otherwise what the
engines leave (``rollout.num_engines × cluster.gpus_per_engine``). Candidates keep TP inside a
node and split the attention heads; context parallelism (powers of two) is a candidate with packed
micro-batches only (``trainer.max_tokens_per_micro_batch``). They are sorted by what costs
throughput first: fewer pipeline stages (bubbles), then less tensor parallelism (per-layer
collectives), then less context parallelism (a key/value all-gather per layer), then less expert
tensor parallelism, then the lower peak memory (the most headroom for longer responses or bigger
micro-batches).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.planner.layout import Allocation
from bpo_megatron.planner.plan import Plan, make_plan

if TYPE_CHECKING:
    from bpo_megatron.experiment import ExperimentConfig


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def trainer_ranks_for(cfg: ExperimentConfig, allocation: Allocation) -> int:
    evaluation = int(cfg.evaluation_engines * cfg.cluster.gpus_per_engine)  # background evaluation's own GPUs
    if cfg.cluster.colocate:
        return allocation.gpus - evaluation
    return allocation.gpus - int(cfg.rollout.num_engines * cfg.cluster.gpus_per_engine) - evaluation


def candidate_layouts(hf: HFModelConfig, ranks: int, gpus_per_node: int, *, packed: bool = False
                      ) -> list[ParallelConfig]:
    """Every layout to try; ``packed``: with context parallelism too (it splits packed samples)."""
    layouts = []
    heads = (hf.num_attention_heads, hf.num_key_value_heads)
    for tp in (t for t in _divisors(gpus_per_node) if all(h % t == 0 for h in heads)):
        for pp in _divisors(hf.num_hidden_layers):
            if ranks % (tp * pp):
                continue
            sizes = [c for c in _divisors(ranks // (tp * pp)) if c & (c - 1) == 0] if packed else [1]
            for cp in sizes:
                for ep in _divisors(hf.num_experts) if hf.is_moe else [1]:
                    for etp in sorted({1, tp}) if ep > 1 else [tp]:
                        if (ranks // pp) % (ep * etp) == 0:
                            layouts.append(ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp))
    return layouts


@dataclass(frozen=True)
class SweepResult:
    plans: list[Plan]  # the layouts that fit, best first
    rejected: dict[str, int]  # why the others do not: failed check or "memory", with counts


def sweep(cfg: ExperimentConfig, hf: HFModelConfig, allocation: Allocation) -> SweepResult:
    """Plans of every layout that passes all checks and fits in the GPUs' memory, best first."""
    ranks = trainer_ranks_for(cfg, allocation)
    if ranks < 1:
        return SweepResult([], {f"the engines take all {allocation.gpus} GPUs, none is left for the trainer": 1})
    cluster = dataclasses.replace(cfg.cluster, trainer_ranks=ranks, nodes=allocation.nodes,
                                  gpus_per_node=allocation.gpus_per_node,
                                  gpu_memory_gb=allocation.gpu_memory_gb)
    plans, rejected = [], Counter()
    packed = bool(cfg.trainer.max_tokens_per_micro_batch)
    for parallel in candidate_layouts(hf, ranks, allocation.gpus_per_node, packed=packed):
        plan = make_plan(dataclasses.replace(cfg, parallel=parallel, cluster=cluster), hf, allocation)
        if plan.fits:
            plans.append(plan)
        elif not plan.layout_ok:
            rejected.update({next(c.message for c in plan.checks if not c.ok): 1})
        else:
            rejected.update({"memory per GPU exceeded (training or rollout)" if not plan.memory_ok
                             else "host memory per node exceeded (checkpoint save or load)": 1})
    plans.sort(key=lambda pl: (pl.cfg.parallel.pp, pl.cfg.parallel.tp, pl.cfg.parallel.cp, pl.cfg.parallel.expert_tp,
                               pl.train_peak))
    return SweepResult(plans, dict(rejected.most_common()))
