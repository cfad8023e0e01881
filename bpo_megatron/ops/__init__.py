"""Tensor-parallel kernels."""

from bpo_megatron.ops.head_logprobs import vocab_parallel_logprobs_at
from bpo_megatron.ops.vocab_parallel import vocab_parallel_logprobs

__all__ = ["vocab_parallel_logprobs", "vocab_parallel_logprobs_at"]
