"""The policy model: Qwen3 / Qwen3-MoE Hugging Face configs mapped onto Megatron-Core GPTModels."""

from bpo_megatron.models.hf_config import ARCHITECTURES, HFModelConfig
from bpo_megatron.models.options import ModelOptions, default_params_dtype
from bpo_megatron.models.qwen3 import (
    build_gpt_model,
    layer_spec,
    model_vocab_size,
    padded_vocab_size,
    transformer_config,
    uses_transformer_engine,
)

__all__ = [
    "ARCHITECTURES",
    "HFModelConfig",
    "ModelOptions",
    "build_gpt_model",
    "default_params_dtype",
    "layer_spec",
    "model_vocab_size",
    "padded_vocab_size",
    "transformer_config",
    "uses_transformer_engine",
]
