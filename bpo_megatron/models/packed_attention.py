"""Megatron's local core attention, extended to packed sequences (the ``thd`` format).

Megatron-Core's torch ``DotProductAttention`` refuses packed-sequence parameters; transformer-
engine's attention takes them natively, so only the local spec (CPU, or GPUs without TE) needs
this. Given ``thd`` parameters, ``Attention.forward`` hands core attention queries ``[t, heads, d]``
and keys and values ``[t, query groups, d]`` of all packed samples; each segment between two
``cu_seqlens`` bounds is one sample, attended to causally on its own by the parent's own
computation (same grouped-query head repetition, softmax scale, mask and softmax), so a packed
sample gets exactly the attention it gets alone in a padded batch. Without packed parameters the
parent runs unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedDotProductAttention(DotProductAttention):
    """:class:`DotProductAttention` that also attends within each segment of a packed row."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        bounds = _segment_bounds(packed_seq_params, total=query.shape[0])
        if attention_mask is not None:
            raise ValueError("packed sequences are masked by their segments: attention_mask must be None")
        attend = super().forward
        # [n, 1, heads, d] per segment: the parent's [s, b, heads, d] with one row; its output
        # [n, 1, heads × d] stacks into the [t, 1, heads × d] that Attention reshapes for thd.
        return torch.cat([
            attend(query[start:end].unsqueeze(1), key[start:end].unsqueeze(1), value[start:end].unsqueeze(1), None,
                   attn_mask_type=attn_mask_type, attention_bias=attention_bias)
            for start, end in zip(bounds, bounds[1:])
        ])


def _segment_bounds(params: PackedSeqParams, *, total: int) -> list[int]:
    """The segment bounds of self-attention over a packed row of ``total`` positions."""
    if params.qkv_format != "thd":
        raise ValueError(f"packed attention takes qkv_format='thd', got {params.qkv_format!r}")
    padded = (params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded)
    if any(bound is not None for bound in padded):
        raise ValueError("padded segment bounds (cu_seqlens_*_padded) are for context parallelism, "
                         "which the local attention does not support")
    if not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv):
        raise ValueError("self-attention over a packed row needs cu_seqlens_q == cu_seqlens_kv")
    bounds = params.cu_seqlens_q.tolist()
    if bounds[0] != 0 or bounds[-1] != total or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds} must rise strictly from 0 to the {total} packed positions")
    return bounds
