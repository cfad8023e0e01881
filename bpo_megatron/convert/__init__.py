"""Hugging Face ↔ Megatron-Core checkpoints for Qwen3 / Qwen3-MoE.

``iter_hf_weights`` streams Hugging Face tensors out of a live sharded model (export, weight sync
to rollout engines); ``load_hf_weights`` loads a Hugging Face checkpoint into any layout;
``convert_hf_to_mcore`` / ``convert_mcore_to_hf`` are the two file conversions behind
``tools/convert_checkpoint.py``. Megatron is imported only when a model is touched.
"""

from bpo_megatron.convert.gather import ExportPlan, StreamedTensor, iter_hf_weights, weight_stream
from bpo_megatron.convert.hf_to_mcore import convert_hf_to_mcore
from bpo_megatron.convert.load import load_hf_weights
from bpo_megatron.convert.mcore_to_hf import convert_mcore_to_hf
from bpo_megatron.convert.names import RULES, WeightRule, expected_keys, hf_tensor_shapes
from bpo_megatron.convert.safetensors_io import HFWeightsReader, ShardedSafetensorsWriter
from bpo_megatron.convert.validate import ConfigMismatchError, check_same_architecture

__all__ = [
    "RULES",
    "StreamedTensor",
    "ConfigMismatchError",
    "ExportPlan",
    "HFWeightsReader",
    "ShardedSafetensorsWriter",
    "WeightRule",
    "check_same_architecture",
    "convert_hf_to_mcore",
    "convert_mcore_to_hf",
    "expected_keys",
    "hf_tensor_shapes",
    "iter_hf_weights",
    "load_hf_weights",
    "weight_stream",
]
