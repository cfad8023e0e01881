"""The policy model: Hugging Face configs of the supported families (Qwen3, Qwen3-MoE, GLM-4.5 MoE,
DeepSeek-V3; :mod:`bpo_megatron.models.families`) mapped onto Megatron-Core GPTModels
(:mod:`bpo_megatron.models.megatron_model`)."""

from bpo_megatron.models.families import FAMILIES, ModelFamily
from bpo_megatron.models.hf_config import ARCHITECTURES, HFModelConfig
from bpo_megatron.models.options import ModelOptions, default_params_dtype
from bpo_megatron.models.megatron_model import (
    build_gpt_model,
    layer_spec,
    model_vocab_size,
    padded_vocab_size,
    transformer_config,
    uses_transformer_engine,
)

__all__ = [
    "ARCHITECTURES",
    "FAMILIES",
    "ModelFamily",
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
