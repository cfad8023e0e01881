"""Megatron's local core attention, extended to packed sequences (the ``thd`` format), and the
contract of the packed-sequence parameters every local core attention takes.

Megatron-Core's torch ``DotProductAttention`` refuses packed-sequence parameters; transformer-
engine's attention takes them natively, so only the local spec (``model.layer_spec: local``, CPUs and GPUs) needs
this. Given ``thd`` parameters, ``Attention.forward`` hands core attention queries ``[t, heads, d]``
and keys and values ``[t, query groups, d]`` of all packed samples; each segment between two
``cu_seqlens`` bounds is one sample, attended to causally on its own by the parent's own
computation (same grouped-query head repetition, softmax scale, mask and softmax), so a packed
sample gets exactly the attention it gets alone in a padded batch. Without packed parameters the
parent runs unchanged. This is the reference (``model.attention: unfused``, the CPU default);
:mod:`bpo_megatron.models.fused_attention` computes the same with torch's fused kernels.

The segment bounds are checked once per micro-batch where they are built from host lengths
(:func:`check_packed_seq_params`, called by the trainer's packing), not in every layer: on a GPU
every layer's read of a device tensor would wait for the device. A layer checks only what the
parameters say without reading a tensor (:func:`check_packed_layout`). The reference itself loops
over the segments on the host, so it reads the bounds in each layer (a copy from the device when
run on a GPU; nothing on a CPU).
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from bpo_megatron.models.context_attention import (context_parallel_attention, refuse_unpacked,
                                                    without_context_parallelism)


class PackedDotProductAttention(DotProductAttention):
    """:class:`DotProductAttention` that also attends within each segment of a packed row, and
    over the CP group (:mod:`~bpo_megatron.models.context_attention`) under context parallelism."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(without_context_parallelism(config), *args, **kwargs)
        self.context_parallel_size = config.context_parallel_size

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if packed_seq_params is None:
            refuse_unpacked(self.context_parallel_size)
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        check_packed_layout(packed_seq_params)
        if attention_mask is not None:
            raise ValueError("packed sequences are masked by their segments: attention_mask must be None")
        if self.context_parallel_size > 1:
            return context_parallel_attention(query, key, value, packed_seq_params, scale=self.softmax_scale)
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        if bounds[-1] != query.shape[0]:
            raise ValueError(f"cu_seqlens end at {bounds[-1]}, not at the {query.shape[0]} packed positions")
        attend = super().forward
        # [n, 1, heads, d] per segment: the parent's [s, b, heads, d] with one row; its output
        # [n, 1, heads × d] stacks into the [t, 1, heads × d] that Attention reshapes for thd.
        return torch.cat([
            attend(query[start:end].unsqueeze(1), key[start:end].unsqueeze(1), value[start:end].unsqueeze(1), None,
                   attn_mask_type=attn_mask_type, attention_bias=attention_bias)
            for start, end in zip(bounds, bounds[1:])
        ])


def check_packed_layout(params: PackedSeqParams) -> None:
    """Refuse ``thd`` parameters the local core attentions do not compute, from what they say
    without reading a tensor (no device sync: every layer calls this)."""
    if params.qkv_format != "thd":
        raise ValueError(f"packed attention takes qkv_format='thd', got {params.qkv_format!r}")
    padded = ((params.cu_seqlens_q_padded, params.cu_seqlens_q), (params.cu_seqlens_kv_padded, params.cu_seqlens_kv))
    if any(bound is not None and bound is not unpadded for bound, unpadded in padded):
        # (the trainer's context-parallel rows pad each sample inside its segment, and pass the
        # same bounds as both, as transformer-engine's CP attention reads them)
        raise ValueError("padded segment bounds (cu_seqlens_*_padded) other than the segments themselves: the "
                         "local attention attends whole segments")
    q, kv = params.cu_seqlens_q, params.cu_seqlens_kv
    if q.shape != kv.shape or params.max_seqlen_q != params.max_seqlen_kv:
        raise ValueError("self-attention over a packed row needs cu_seqlens_q == cu_seqlens_kv and "
                         f"max_seqlen_q == max_seqlen_kv, got {q.shape[0]} and {kv.shape[0]} bounds, "
                         f"max_seqlen {params.max_seqlen_q} and {params.max_seqlen_kv}")


def check_packed_seq_params(params: PackedSeqParams, *, total: int) -> None:
    """Refuse ``thd`` parameters over a packed row of ``total`` positions that would attend across
    samples or past the row: bounds that do not rise strictly from 0 to ``total``, query bounds
    other than the key/value bounds, a ``max_seqlen`` below the longest segment (FlashAttention
    sizes its work by it and would leave positions out), bounds that are not int32 (the kernels'
    type). Reads the bounds, so it takes host tensors: call it where they are built, once per
    micro-batch, before they move to the device."""
    check_packed_layout(params)
    q, kv = params.cu_seqlens_q, params.cu_seqlens_kv
    for name, bounds in (("cu_seqlens_q", q), ("cu_seqlens_kv", kv)):
        if bounds.device.type != "cpu":
            raise ValueError(f"{name} is on {bounds.device}: check packed bounds on the host where they are "
                             "built, before they move to the device (reading them there waits for it)")
        if bounds.dtype != torch.int32 or bounds.dim() != 1 or bounds.numel() < 2:
            raise ValueError(f"{name} must be a 1-D int32 tensor of at least two bounds, got {bounds.dtype} "
                             f"{tuple(bounds.shape)}")
    if not torch.equal(q, kv):
        raise ValueError(f"self-attention over a packed row needs cu_seqlens_q == cu_seqlens_kv, got "
                         f"{q.tolist()} and {kv.tolist()}")
    bounds = q.tolist()
    if bounds[0] != 0 or bounds[-1] != total or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds} must rise strictly from 0 to the {total} packed positions")
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    if not isinstance(params.max_seqlen_q, int) or params.max_seqlen_q < longest:
        raise ValueError(f"max_seqlen_q={params.max_seqlen_q!r} must be an int of at least the longest segment "
                         f"({longest}) of cu_seqlens {bounds}")
