"""The process world a conversion runs in: its size for a layout, and the model on each rank."""

from __future__ import annotations

import logging
import math
import warnings
from typing import TYPE_CHECKING

import torch

from bpo_megatron.models import HFModelConfig, ModelOptions, build_gpt_model
from bpo_megatron.parallel import ParallelConfig

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

DEFAULT_TIMEOUT_S = 6 * 3600.0  # a 30B model on CPU takes a while; a hung rank still ends


def world_size_for(parallel: ParallelConfig) -> int:
    """The smallest world the layout fits: ``tp × pp × dp`` with the fewest data-parallel ranks
    that let ``ep × etp`` divide the ranks of a pipeline stage."""
    experts = parallel.ep * parallel.expert_tp
    dp = math.lcm(parallel.tp, experts) // parallel.tp
    return parallel.tp * parallel.pp * dp


def build_model(hf: HFModelConfig, parallel: ParallelConfig, options: ModelOptions) -> GPTModel:
    """Set up Megatron's process groups for ``parallel`` and build this rank's model chunk
    (inside an initialised ``torch.distributed`` world). Undo with :func:`tear_down`."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from bpo_megatron.megatron import ensure_megatron_cpu_compat

    warnings.filterwarnings("ignore", module=r"megatron\.")
    # torch's checkpoint planner warns about ShardedTensor on every load; nothing to act on
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    ensure_megatron_cpu_compat()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
    )
    # The initial values are overwritten; seeding only makes runs reproducible.
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    return build_gpt_model(hf, parallel, options)


def layout_record(parallel: ParallelConfig, world_size: int) -> dict[str, int]:
    """The ``layout`` a trainer checkpoint records (as ``TrainActor`` writes it)."""
    return {"tp": parallel.tp, "pp": parallel.pp, "ep": parallel.ep, "etp": parallel.expert_tp,
            "dp": world_size // parallel.model_parallel_size}


def tear_down() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
