"""Layout checks and per-GPU memory estimates for an experiment (``bpo-megatron plan``).

    from bpo_megatron.planner import make_plan, format_plan
    print(format_plan(make_plan(cfg, hf)))

Modules: :mod:`.params` (parameters per rank), :mod:`.precision` (bytes of weights, gradients and
optimizer states), :mod:`.activations`, :mod:`.rollout` (engine weights and KV cache),
:mod:`.layout` (checks), :mod:`.batches` (micro-batches per rank, imbalance and useful tokens for a
length distribution), :mod:`.plan`, :mod:`.search` (``--sweep``), :mod:`.report`.
"""

from bpo_megatron.planner.layout import Allocation, Check, layout_checks
from bpo_megatron.planner.params import StageParams, rank_parameters
from bpo_megatron.planner.plan import Plan, make_plan
from bpo_megatron.planner.precision import Precision, StaticMemory, static_memory
from bpo_megatron.planner.report import format_plan, format_sweep
from bpo_megatron.planner.search import SweepResult, sweep

__all__ = [
    "Allocation", "Check", "Plan", "Precision", "StageParams", "StaticMemory", "SweepResult", "format_plan",
    "format_sweep", "layout_checks", "make_plan", "rank_parameters", "static_memory", "sweep",
]
