"""Megatron-Core's process groups for a :class:`ParallelConfig`, set up and torn down in one place."""

from __future__ import annotations

import torch

from bpo_megatron.parallel.config import ParallelConfig


def initialize_parallel(parallel: ParallelConfig, *, seed: int) -> None:
    """Create the TP/PP/CP/EP/DP groups of ``parallel`` (inside an initialised torch.distributed
    world) and seed Megatron's tracked RNG streams and torch's default generator."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from bpo_megatron.megatron import ensure_megatron_cpu_compat, ensure_megatron_fixes

    ensure_megatron_fixes()
    ensure_megatron_cpu_compat()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
    )
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def layout_record(parallel: ParallelConfig, world_size: int) -> dict[str, int]:
    """The layout a checkpoint records, to tell whether it is loaded under the same one."""
    return {"tp": parallel.tp, "pp": parallel.pp, "ep": parallel.ep, "etp": parallel.expert_tp,
            "dp": parallel.data_parallel_size(world_size)}
