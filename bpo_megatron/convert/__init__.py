"""The offline Hugging Face ↔ Megatron-Core checkpoint tool for the supported model families
(:mod:`bpo_megatron.models.families`).

``convert_hf_to_mcore`` / ``convert_mcore_to_hf`` are the two file conversions behind
``bpo-megatron convert``; each starts a gloo world of its own
and moves the weights with :mod:`bpo_megatron.weights` (the name map, the layouts, the gather),
which a training run uses at every weight sync. Megatron is imported only when a model is touched.
"""

from bpo_megatron.convert.hf_to_mcore import convert_hf_to_mcore
from bpo_megatron.convert.mcore_to_hf import convert_mcore_to_hf
from bpo_megatron.convert.validate import ConfigMismatchError, check_same_architecture

__all__ = [
    "ConfigMismatchError",
    "check_same_architecture",
    "convert_hf_to_mcore",
    "convert_mcore_to_hf",
]
