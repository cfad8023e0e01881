"""The process world a conversion runs in: its size for a layout, and the model on each rank."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from bpo_megatron.models import HFModelConfig, ModelOptions, build_gpt_model
from bpo_megatron.observability.library_logs import quiet_library_logs
from bpo_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

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
    quiet_library_logs()
    # The initial values are overwritten; seeding only makes runs reproducible.
    initialize_parallel(parallel, seed=0)
    return build_gpt_model(hf, parallel, options)


def tear_down() -> None:
    destroy_parallel()
