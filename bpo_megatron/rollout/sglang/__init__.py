"""SGLang rollout engine (GPU clusters). The client side runs anywhere; the server needs CUDA."""

from bpo_megatron.rollout.sglang.engine import RolloutFailed, SGLangEngine
from bpo_megatron.rollout.sglang.options import SGLangConfig, SGLangOptions

__all__ = ["RolloutFailed", "SGLangConfig", "SGLangEngine", "SGLangOptions"]
