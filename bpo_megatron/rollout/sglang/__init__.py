"""SGLang rollout engine (GPU clusters). The client side runs anywhere; the server needs CUDA."""

from bpo_megatron.rollout.sglang.config import SGLangConfig
from bpo_megatron.rollout.sglang.engine import RolloutFailed, SGLangEngine

__all__ = ["RolloutFailed", "SGLangConfig", "SGLangEngine"]
