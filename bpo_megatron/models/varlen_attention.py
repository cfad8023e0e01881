"""Causal attention within each segment of packed queries and keys (``thd``), the kernel of the
local spec's fused core attention (:mod:`bpo_megatron.models.fused_attention`) and of its
context-parallel attention (:mod:`bpo_megatron.models.context_attention`): torch's FlashAttention
varlen kernel on CUDA in half precision, SDPA under a block-diagonal causal mask elsewhere."""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def varlen_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, max_seqlen_q: int,
                            max_seqlen_kv: int, *, scale: float) -> torch.Tensor:
    """Causal attention within each segment of packed queries ``[t_q, heads, d]`` and keys and
    values ``[t_kv, groups, d]`` (``heads`` a multiple of ``groups``), segment ``i`` between bounds
    ``i`` and ``i + 1`` of ``cu_seqlens_q`` / ``cu_seqlens_kv`` (int32, on the tensors' device).
    FlashAttention's varlen kernel on CUDA in half precision, SDPA under a block-diagonal causal
    mask elsewhere; ``[t_q, heads, d]`` either way, and no read of the device."""
    gqa = query.shape[1] != key.shape[1]
    if query.is_cuda and query.dtype in FLASH_DTYPES:
        # varlen_attn with the flag (torch 2.13, 2.14) wants enable_gqa=True for fewer key/value
        # heads; torch 2.11's has no flag and hands them to the same kernel, which takes them
        flag = {"enable_gqa": True} if gqa and _varlen_takes_gqa_flag() else {}
        return varlen_attn(query, key, value, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                           scale=scale, window_size=(-1, 0), **flag)  # (-1, 0): causal
    allowed = _block_causal_mask(cu_seqlens_q, query.shape[0], cu_seqlens_kv, key.shape[0])
    # [t, heads, d] -> [1, heads, t, d]: SDPA's layout, grouped heads at dim -3
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)


def _block_causal_mask(cu_seqlens_q: torch.Tensor, total_q: int, cu_seqlens_kv: torch.Tensor,
                       total_kv: int) -> torch.Tensor:
    """``[t_q, t_kv]`` bool, True where query position i may attend key position j: both in the same
    segment, j not after i. Positions are counted from their segment's end, as FlashAttention
    aligns the causal mask of a segment with fewer queries than keys (equal lengths: the usual
    lower triangle). Device ops only."""

    def segment_and_distance_to_end(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
        ends = cu_seqlens[1:]
        segment = torch.searchsorted(ends, positions, right=True)
        return segment, ends[segment] - positions

    segment_q, to_end_q = segment_and_distance_to_end(cu_seqlens_q, total_q)
    segment_kv, to_end_kv = segment_and_distance_to_end(cu_seqlens_kv, total_kv)
    return (segment_q[:, None] == segment_kv[None, :]) & (to_end_kv[None, :] >= to_end_q[:, None])


@functools.cache
def _varlen_takes_gqa_flag() -> bool:
    return "enable_gqa" in inspect.signature(varlen_attn).parameters
