"""A KV cache of fixed slots: each decoding row owns one slot of ``length`` positions per layer.

Keys and values sit at ``[slot, position, kv_head, head_dim]``, so a row's tokens are contiguous and
its first prompt token is position 0: no left padding, no attention mask over padding, and the
layout is the one FlashAttention's variable-length kernel reads (``[slots · length, kv_heads, D]``
with each slot a segment of ``length`` and ``seqused_k`` the tokens in use). The buffers are
allocated once per decoding session and never move, which a captured CUDA graph needs.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    """Static key/value buffers of ``slots`` rows × ``length`` positions for every layer."""

    def __init__(self, *, layers: int, slots: int, length: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, value_dim: int | None = None) -> None:
        # value_dim: when values are narrower or wider than keys (latent attention caches its latent
        # as keys and the rotated shared key as values: decode.cache_layout)
        shape = (slots, length, kv_heads, head_dim)
        value_shape = (slots, length, kv_heads, head_dim if value_dim is None else value_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(value_shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots, self.length = slots, length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def load_prefill(self, layer: int, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
                     columns: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Copy a left-padded prefill's keys and values ``[batch, kv_heads, width, D]`` (transformers'
        layout): entry ``(rows[i], columns[i])`` goes to ``(slots[i], positions[i])``."""
        self.keys[layer][slots, positions] = keys.transpose(1, 2)[rows, columns]
        self.values[layer][slots, positions] = values.transpose(1, 2)[rows, columns]
