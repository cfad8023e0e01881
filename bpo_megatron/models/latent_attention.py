"""The local spec's core attention for multi-head latent attention (MLA, DeepSeek-V3).

Megatron-Core's ``MLASelfAttention`` builds its core attention with ``k_channels`` (a head's query
and key dims: the part without RoPE, then the rotated part) and ``v_channels`` (a head's value
dims), which differ; transformer-engine's attention takes both, Megatron's local
``DotProductAttention`` neither, so MLA on the local spec (``model.layer_spec: local``, CPUs and GPUs) needs these. The
softmax scale comes from ``MLASelfAttention`` (``1/sqrt(k_channels)`` times YaRN's mscale²), never
from the head size.

Both are the local core attentions of :mod:`~bpo_megatron.models.packed_attention` (the reference,
padded or packed ``thd`` rows one segment at a time, with its checks) and
:mod:`~bpo_megatron.models.fused_attention` (torch's fused kernels), sized by the value dims: the
parents' computation never assumes the value head is as wide as the query's (a ``[.., s, k] @
[.., k, s]`` score, a ``[.., s, s] @ [.., s, v]`` output), except the output width the reference
derives from ``kv_channels`` and the fused kernels, which want one head size: for those the values
are zero-padded to the query's width and the padding cut from the output (the same numbers: padded
columns only ever meet zeros). Context parallelism is refused (the model
configuration names ``parallel.cp``) before these are built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from bpo_megatron.models.fused_attention import FusedDotProductAttention
from bpo_megatron.models.packed_attention import PackedDotProductAttention


def _latent_init(module, k_channels: int | None, v_channels: int | None) -> None:
    if k_channels is None and v_channels is None:
        # Megatron's Attention base builds a core attention of kv_channels heads first, which
        # MLASelfAttention then replaces by one given both sizes
        return
    if not k_channels or not v_channels:
        raise ValueError(f"{type(module).__name__} is MLA's core attention: it needs both k_channels and "
                         f"v_channels (got {k_channels!r}, {v_channels!r})")
    if module.config.context_parallel_size != 1:
        raise ValueError("multi-head latent attention on the local spec does not support context parallelism")
    # the parents size their output by kv_channels; here each head outputs its value dims
    module.k_channels, module.v_channels = k_channels, v_channels
    module.hidden_size_per_attention_head = v_channels
    module.hidden_size_per_partition = v_channels * module.num_attention_heads_per_partition


class LatentDotProductAttention(PackedDotProductAttention):
    """:class:`PackedDotProductAttention` with query/key heads of ``k_channels`` and value heads of
    ``v_channels`` dims (the reference, ``model.attention: unfused``)."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _latent_init(self, k_channels, v_channels)


class LatentFusedDotProductAttention(FusedDotProductAttention):
    """:class:`FusedDotProductAttention` with query/key heads of ``k_channels`` and value heads of
    ``v_channels`` dims (``model.attention: fused``)."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _latent_init(self, k_channels, v_channels)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        width = value.shape[-1]
        if width < query.shape[-1]:
            # the fused kernels (FlashAttention's, varlen or not, on CUDA; torch's flash kernel on a
            # CPU) take one head size for queries, keys and values; SDPA would otherwise fall back to
            # its math path, which keeps every [s, s] probability matrix
            value = F.pad(value, (0, query.shape[-1] - width))
        out = super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                              attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if value.shape[-1] == width:
            return out
        heads = query.shape[-2]
        return out.unflatten(-1, (heads, value.shape[-1]))[..., :width].flatten(-2)
