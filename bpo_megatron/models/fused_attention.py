"""The local spec's core attention on torch's fused kernels (``model.attention: fused``, the GPU
default).

Megatron's local ``DotProductAttention`` (the reference, with packed rows one segment at a time:
:mod:`bpo_megatron.models.packed_attention`) writes every head's ``[s, s]`` score matrix, masks it,
takes its softmax and keeps the probabilities for the backward. :class:`FusedDotProductAttention`
computes the same function without them:

* padded batches ``[s, b, heads, d]``: ``scaled_dot_product_attention(is_causal=True)``
  (FlashAttention on a GPU in bf16, torch's fused CPU kernel on a CPU);
* packed rows (``thd``: ``[t, heads, d]``, one sample between two ``cu_seqlens`` bounds):
  torch's FlashAttention varlen kernel on CUDA in bf16/fp16
  (``torch.nn.attention.varlen.varlen_attn``), which takes the bounds as the device tensor of the
  packed-sequence parameters and the longest segment as their host int ``max_seqlen``, so no layer
  reads the device. Elsewhere (a CPU; fp32, which FlashAttention does not take) the same interface
  is SDPA under a block-diagonal causal mask built on the device from the bounds: a dense
  ``[t, t]`` boolean, quadratic in the row, there so that CPUs run every line of this path.

The reference's function up to rounding (in fp32: summation order): grouped-query heads (``enable_gqa``: keys and
values are not repeated), Megatron's softmax scale, causal within each sample, output
``[s, b, heads × d]``, or ``[t, 1, heads × d]`` for packed rows (what ``Attention`` reshapes to).
What the fused kernels do not compute (attention dropout, sliding windows, softmax offsets,
query-key layer scaling, a mask type other than causal, explicit masks or biases) is refused when
the module is built or called.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from bpo_megatron.models.context_attention import (context_parallel_attention, refuse_unpacked,
                                                    without_context_parallelism)
from bpo_megatron.models.packed_attention import check_packed_layout
from bpo_megatron.models.varlen_attention import varlen_causal_attention


class FusedDotProductAttention(DotProductAttention):
    """:class:`DotProductAttention`'s causal self-attention, padded or packed, on torch's fused
    kernels (see the module docstring); same parameters (none) and checkpoints."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(without_context_parallelism(config), *args, **kwargs)
        self.context_parallel_size = config.context_parallel_size
        self._check_supported()

    def _check_supported(self) -> None:
        config = self.config
        refused = {
            "attention dropout": self.attention_dropout.p > 0,
            "sliding-window attention (window_size)": config.window_size is not None,
            f"softmax_type={config.softmax_type!r}": config.softmax_type != "vanilla",
            "apply_query_key_layer_scaling=True": config.apply_query_key_layer_scaling,
            f"attn_mask_type={self.attn_mask_type.name}": self.attn_mask_type != AttnMaskType.causal,
        }
        unsupported = [name for name, on in refused.items() if on]
        if unsupported:
            raise ValueError("the fused core attention (model.attention=fused) does not compute "
                             + "; ".join(unsupported) + " — model.attention=unfused runs Megatron's")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("the fused core attention masks causally itself and takes no attention_mask or "
                             "attention_bias; model.attention=unfused applies Megatron's")
        if packed_seq_params is not None:
            check_packed_layout(packed_seq_params)
            if self.context_parallel_size > 1:
                return context_parallel_attention(query, key, value, packed_seq_params, scale=self.softmax_scale)
            out = varlen_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                          packed_seq_params.cu_seqlens_kv, packed_seq_params.max_seqlen_q,
                                          packed_seq_params.max_seqlen_kv, scale=self.softmax_scale)
            return out.reshape(out.shape[0], 1, -1)
        refuse_unpacked(self.context_parallel_size)
        if query.shape[0] != key.shape[0]:
            raise ValueError(f"causal self-attention needs as many queries as keys, got {query.shape[0]} and "
                             f"{key.shape[0]}")
        # [s, b, heads, d] -> [b, heads, s, d] and back to [s, b, heads × d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                             enable_gqa=query.shape[2] != key.shape[2])
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
