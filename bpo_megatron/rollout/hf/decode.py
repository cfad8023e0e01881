"""One decode step of a transformers causal LM of the supported families as a function of static
buffers.

Every slot of a :class:`SlotKVCache` feeds one token per step: the step reads ``tokens`` and
``positions`` (``[slots]``), writes each slot's new key and value at its position, attends over the
slot's positions ``0 … position`` and returns the last-position logits ``[slots, vocab]``; with
routing capture it also writes the top-k experts of every MoE layer into ``routing``
(``[slots, moe_layers, top_k]``) inside the step, with no hook and no host sync. Same shapes and
addresses every step, so on CUDA the whole step is captured as one graph (:mod:`graphs`).

The weights are read through the model's own modules at every call (projections, norms, the
router's ``forward`` without its hooks), so an in-place weight update is seen by the next step, and
the numerics are transformers' own except where two kernels sum in another order. What differs
between the families is read from the modules: QK-norms where the attention has them, RoPE over the
leading dimensions the rotary table covers (GLM rotates half of each head), a shared expert where the
MoE block has one, and multi-head latent attention (DeepSeek-V3) where the attention has a ``kv_b_proj``.

Latent attention caches what transformers' own cache holds for it (:func:`cache_layout`): per
position the normed key/value latent (``kv_lora_rank`` dims) and the rotated key part shared by
every head (``qk_rope_head_dim``), not per-head keys and values. Each step decompresses the slot's
whole latent through ``kv_b_proj`` into per-head keys and values, as transformers' forward does,
and attends with SDPA under the slot mask on every device (query/key heads are wider than value
heads, which FlashAttention's kernel here does not take).


* attention: on CUDA in bf16 FlashAttention's variable-length kernel (native grouped-query
  attention, each slot limited to its tokens by ``seqused_k``), graphed or not; elsewhere SDPA over
  the whole slot with a mask;
* queries, keys and values: one GEMM over the stacked projections and one RMSNorm and RoPE over the
  query and key heads together where the engine installed them (:mod:`fused_qkv`);
* experts: token–expert pairs put in expert order by a counting sort (no sort kernel, no host read)
  and multiplied by ``torch._grouped_mm`` (bf16 on CUDA, any float dtype on a CPU), instead of
  transformers' loop over the experts hit (which syncs with the host to find them); a compiled
  layer is one graph, the GEMMs opaque ops in it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from bpo_megatron.models.families import FAMILIES
from bpo_megatron.models.routing import expert_id_dtype
from bpo_megatron.rollout.hf.capture import moe_routers, num_routed_experts
from bpo_megatron.rollout.hf.fused_qkv import ATTRIBUTE as FUSED_QKV, rms_norm
from bpo_megatron.rollout.hf.kv_cache import SlotKVCache

Attention = Literal["flash", "sdpa"]
SUPPORTED = tuple(name for name, family in FAMILIES.items() if family.embedded_decode)
ResolvedPath = Literal["eager", "cuda_graph"]


def resolve_path(decode: str, device: torch.device, dtype: torch.dtype) -> ResolvedPath:
    """How ``rollout.hf.decode`` runs the step on this device and dtype; the one place the
    embedded engine chooses its CUDA-only kernels (graph capture, FlashAttention, bf16 grouped GEMM).

    ``eager`` runs anywhere: on CUDA in another dtype than bf16, ``torch._grouped_mm`` takes its
    per-group fallback (which reads the group sizes on the host, so it cannot be captured)."""
    graphs_possible = device.type == "cuda" and dtype == torch.bfloat16
    if decode == "auto":
        return "cuda_graph" if graphs_possible else "eager"
    if decode == "cuda_graph" and not graphs_possible:
        raise ValueError(f"rollout.hf.decode=cuda_graph needs a CUDA device and rollout.hf.dtype=bf16 "
                         f"(FlashAttention and torch._grouped_mm are bf16 kernels); this engine has "
                         f"{device.type} and {dtype}. Use decode=eager (same step, op by op) or auto")
    return decode


def attention_for(device: torch.device, dtype: torch.dtype) -> Attention:
    """FlashAttention's kernel wherever it runs (CUDA, bf16), graphed or not: the eager step is then
    the graphed step op by op, so the two differ only by the capture; SDPA elsewhere."""
    return "flash" if device.type == "cuda" and dtype == torch.bfloat16 else "sdpa"


def check_supported(model: nn.Module) -> None:
    """Refuse a model the functional step does not reproduce (rather than decode it wrongly)."""
    config = model.config
    if config.model_type not in SUPPORTED:
        raise ValueError(f"rollout.engine=hf: the embedded engine decodes {SUPPORTED} models, not "
                         f"{config.model_type!r}; serve it with rollout.engine=sglang or vllm")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("rollout.engine=hf: the embedded engine does not decode sliding-window attention; "
                         "serve the model with rollout.engine=sglang or vllm")


def is_latent_attention(attn: nn.Module) -> bool:
    """Whether a transformers attention module is multi-head latent attention (DeepSeek-V3's)."""
    return isinstance(getattr(attn, "kv_b_proj", None), nn.Module)


def cache_layout(model: nn.Module) -> tuple[int, int, int]:
    """``(heads, key dims, value dims)`` of one position of one layer in the KV cache: transformers'
    cache entries, the keys and values of every KV head, or for latent attention one entry of the
    normed latent (as "keys") and the rotated shared key (as "values")."""
    attn = model.model.layers[0].self_attn
    if is_latent_attention(attn):
        return 1, attn.kv_lora_rank, attn.qk_rope_head_dim
    return model.config.num_key_value_heads, attn.head_dim, attn.head_dim


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the leading ``cos.shape[-1]`` dimensions of each head, the rest passed through."""
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rotated, kept = x[..., :width], x[..., width:]
    return torch.cat((rotated * cos + _rotate_half(rotated) * sin, kept), dim=-1)


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (DeepSeek's ``rope_interleave``): pair ``(x[2i], x[2i+1])`` rotates by
    frequency i, and the result is laid out de-interleaved (evens then odds), as transformers does."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def expert_slots(experts: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sort of the (token, k) pairs of ``experts`` ``[tokens, k]`` by expert (``expert_ids``:
    ``arange(E)``): each pair's row in expert order (an expert's pairs in pair order: the order a
    stable sort gives) and each expert's end row (int32, the grouped GEMM's offsets). No sort
    kernel, no host read: a pair's rank among its expert's pairs is a cumulative count over a
    one-hot ``[pairs, E]``."""
    flat = experts.reshape(-1).long()
    hits = flat[:, None] == expert_ids
    through = hits.cumsum(0, dtype=torch.int32)  # per expert: its pairs up to and including this one
    counts = through[-1]
    ends = counts.cumsum(0, dtype=torch.int32)
    rank = (through * hits).sum(1)  # 1-based rank among its expert's pairs
    return (ends - counts)[flat] + rank - 1, ends


# An opaque op to torch.compile (torch._grouped_mm's own meta kernel, which tracing needs, takes bf16
# only): a compiled layer traces through it without a graph break — one graph per layer kind, the
# dispatch, activation and combine fused around the GEMMs — and runs it as the kernel it is.
@torch.library.custom_op("bpo_megatron::grouped_gemm", mutates_args=())
def _grouped_gemm(x: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ``x[ends[e-1]:ends[e]]`` times ``weights[e]ᵀ`` (``weights`` ``[E, out, in]``)."""
    return torch._grouped_mm(x, weights.transpose(-2, -1), offs=ends)


@_grouped_gemm.register_fake
def _(x: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weights.shape[1])


def grouped_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, act: nn.Module,
                    round_inputs: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    expert_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k weights[:, k] · down_e(act(gate_e(x)) · up_e(x)) with e = experts[:, k], for fused expert
    weights ``gate_up`` ``[E, 2I, H]`` (gate rows then up rows) and ``down`` ``[E, H, I]``;
    ``round_inputs`` (an FP8 engine's, :mod:`fp8_compute`) applied to each GEMM's input;
    ``expert_ids``: ``arange(E)`` kept by the caller (made here when None).

    Static shapes and no host sync: the pairs are put in expert order by :func:`expert_slots`, each
    expert's rows multiplied by one grouped GEMM, and the pairs' outputs gathered back by their rows
    (no scatter) and summed over k in a fixed order.
    """
    tokens, topk = experts.shape
    if expert_ids is None:
        expert_ids = torch.arange(gate_up.shape[0], device=x.device)
    slots, ends = expert_slots(experts, expert_ids)
    same = (lambda t: t) if round_inputs is None else round_inputs
    ordered = x.new_empty(tokens * topk, x.shape[-1])
    ordered[slots.view(tokens, topk)] = same(x)[:, None]  # each token to its k rows, in one write
    gate, up = _grouped_gemm(ordered, gate_up, ends).chunk(2, dim=-1)
    out = _grouped_gemm(same(act(gate) * up), down, ends)
    return (out[slots].view(tokens, topk, -1) * weights[..., None].to(out.dtype)).sum(dim=1)


class FunctionalDecoder:
    """The decode step over a slot cache, for a transformers causal LM of :data:`SUPPORTED`."""

    def __init__(self, model: nn.Module, cache: SlotKVCache, *, attention: Attention,
                 routing: torch.Tensor | None, compile_layers: bool = False) -> None:
        check_supported(model)
        self._model = model
        self._layers = list(model.model.layers)
        self._cache = cache
        self._attention = attention
        device = cache.keys[0].device
        routers = moe_routers(model)
        self.routing = routing
        if routing is not None and routing.shape[1] != len(routers):
            raise ValueError(f"routing buffer has {routing.shape[1]} MoE layers, the model {len(routers)}")
        # per layer: is it a MoE layer, and the view of the routing buffer its router writes
        moe_layer = {id(router): i for i, router in enumerate(routers)}
        self._moe = [id(getattr(layer.mlp, "gate", None)) in moe_layer for layer in self._layers]
        self._routing_views = [routing[:, moe_layer[id(layer.mlp.gate)]] if moe and routing is not None else None
                               for layer, moe in zip(self._layers, self._moe)]
        # torch.compile per layer (one compiled graph serves every layer of a kind: their modules
        # are its inputs) fuses the elementwise work between the GEMMs — norms, RoPE, residuals,
        # the KV write, routing bookkeeping — into a few kernels
        self._latent = is_latent_attention(self._layers[0].self_attn)
        self._rotate = _rope_interleaved if getattr(model.config, "rope_interleave", False) else _rope
        self._layer_step = torch.compile(self._layer, dynamic=False) if compile_layers else self._layer
        # cos/sin of every position, from the model's own rotary module: each entry is the same
        # product a forward at that position computes, so a table lookup changes no value
        positions = torch.arange(cache.length, device=device)[None]
        probe = torch.zeros(1, dtype=cache.keys[0].dtype, device=device)
        cos, sin = model.model.rotary_emb(probe, positions)
        self._cos, self._sin = cos[0], sin[0]
        slots = cache.slots
        self._slot_ids = torch.arange(slots, device=device)
        self._mask_columns = torch.arange(cache.length, device=device)
        # each slot a segment of `length` keys in the flattened cache (FlashAttention's varlen form)
        self._cu_queries = torch.arange(slots + 1, dtype=torch.int32, device=device)
        self._cu_keys = self._cu_queries * cache.length
        routed = num_routed_experts(routers) if routers else 0
        self._expert_ids = torch.arange(routed, device=device)  # the experts' counting sort compares with it

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[slots, vocab]`` of the next token of every slot; ``tokens`` and ``positions``
        are ``[slots]`` (the token each slot feeds and where it sits)."""
        hidden = self._model.model.embed_tokens(tokens)
        cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]
        for index, layer in enumerate(self._layers):
            hidden = self._layer_step(layer, self._cache.keys[index], self._cache.values[index], self._moe[index],
                                      self._routing_views[index], hidden, cos, sin, positions)
        return self._model.lm_head(self._model.model.norm(hidden))

    def _layer(self, layer: nn.Module, keys: torch.Tensor, values: torch.Tensor, moe: bool,
               routing: torch.Tensor | None, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """One decoder layer; everything that differs between layers is an argument."""
        attend = self._attend_latent if self._latent else self._attend
        hidden = hidden + attend(layer.self_attn, keys, values, layer.input_layernorm(hidden), cos, sin, positions)
        return hidden + self._mlp(layer.mlp, moe, routing, layer.post_attention_layernorm(hidden))

    def _attend(self, attn: nn.Module, keys: torch.Tensor, values: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        slots, head_dim = x.shape[0], attn.head_dim
        fused = getattr(attn, FUSED_QKV, None)
        if fused is None:
            query = getattr(attn, "q_norm", _identity)(attn.q_proj(x).view(slots, -1, head_dim))
            key = getattr(attn, "k_norm", _identity)(attn.k_proj(x).view(slots, -1, head_dim))
            value = attn.v_proj(x).view(slots, -1, head_dim)
            query, key = _rope(query, cos, sin), _rope(key, cos, sin)
        else:  # one GEMM, then the query and key heads normed and rotated together
            qkv = torch.nn.functional.linear(x, fused.weight, fused.bias).view(slots, -1, head_dim)
            rotated, value = qkv[:, :fused.rotated_heads], qkv[:, fused.rotated_heads:]
            if fused.norm_weight is not None:
                rotated = rms_norm(rotated, fused.norm_weight, fused.eps)
            rotated = _rope(rotated, cos, sin)
            query, key = rotated[:, :fused.query_heads], rotated[:, fused.query_heads:]
        keys[self._slot_ids, positions] = key
        values[self._slot_ids, positions] = value
        if self._attention == "flash":
            out = self._flash(query, keys, values, positions, attn.scaling)
        else:
            mask = (self._mask_columns[None] <= positions[:, None])[:, None, None]
            out = torch.nn.functional.scaled_dot_product_attention(
                query[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                scale=attn.scaling, enable_gqa=True)[:, :, 0]
        return attn.o_proj(out.reshape(slots, -1))

    def _attend_latent(self, attn: nn.Module, latents: torch.Tensor, rotated_keys: torch.Tensor, x: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Multi-head latent attention over the slot's cached latents ``[slots, length, 1, kv_lora]``
        and rotated shared keys ``[slots, length, 1, rope]``."""
        slots, length = x.shape[0], latents.shape[1]
        nope, rope, value_dim = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
        if attn.q_lora_rank is None:
            query = attn.q_proj(x)
        else:
            query = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        query_pass, query_rot = query.view(slots, -1, nope + rope).split([nope, rope], dim=-1)
        latent, key_rot = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, rope], dim=-1)
        query = torch.cat((query_pass, self._rotate(query_rot, cos, sin)), dim=-1)
        latents[self._slot_ids, positions] = attn.kv_a_layernorm(latent)[:, None]
        rotated_keys[self._slot_ids, positions] = self._rotate(key_rot[:, None], cos, sin)
        # every cached position decompressed into per-head keys (without RoPE) and values
        key_pass, value = attn.kv_b_proj(latents[:, :, 0]).view(slots, length, -1, nope + value_dim).split(
            [nope, value_dim], dim=-1)
        key = torch.cat((key_pass, rotated_keys.expand(-1, -1, key_pass.shape[2], -1)), dim=-1)
        mask = (self._mask_columns[None] <= positions[:, None])[:, None, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, None], key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask, scale=attn.scaling)[:, :, 0]
        return attn.o_proj(out.reshape(slots, -1))

    def _flash(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               scale: float) -> torch.Tensor:
        slots, length, kv_heads, head_dim = keys.shape
        used = (positions + 1).to(torch.int32)
        return torch.ops.aten._flash_attention_forward(
            query, keys.view(slots * length, kv_heads, head_dim), values.view(slots * length, kv_heads, head_dim),
            self._cu_queries, self._cu_keys, 1, length, 0.0, False, False, scale=scale, seqused_k=used)[0]

    def _mlp(self, mlp: nn.Module, moe: bool, routing: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        if not moe:
            return mlp(x)
        # the router's own forward (not __call__): transformers' numerics, none of the capture hooks
        _, weights, experts = mlp.gate.forward(x)
        if routing is not None:
            routing.copy_(experts.to(routing.dtype))
        fused = mlp.experts
        out = grouped_experts(x, experts, weights, fused.gate_up_proj, fused.down_proj, fused.act_fn,
                              round_inputs=getattr(fused, "round_inputs", None), expert_ids=self._expert_ids)
        shared = getattr(mlp, "shared_experts", None)
        return out if shared is None else out + shared(x)


def routing_buffer(model: nn.Module, slots: int, device: torch.device) -> torch.Tensor:
    """The step's routing output ``[slots, moe_layers, top_k]`` in the capture's id dtype."""
    routers = moe_routers(model)
    return torch.zeros(slots, len(routers), model.config.num_experts_per_tok,
                       dtype=expert_id_dtype(num_routed_experts(routers)), device=device)
