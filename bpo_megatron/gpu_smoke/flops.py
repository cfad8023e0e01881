"""The FLOPs a model needs per token, the one count behind every MFU the kit reports.

Model FLOPs utilisation counts the work the model defines, not what an implementation runs: 2 FLOPs
per weight of every matrix product a position goes through (the attention projections, the router,
the experts it is routed to, a dense or shared MLP, the output layer; not the input embedding, a
lookup, nor the norms' scales) plus causal attention, 2 · heads · (query/key dims + value dims)
FLOPs per (query, key) pair and layer (QKᵀ and AV), and ×3 for a training step (forward and the
two products of the backward). Recomputed activations are not counted. The weights are read from
the weight rules (:mod:`bpo_megatron.weights.names`), so every family the project converts is
counted the same way, latent attention included.

The split says what each share measures: ``layers`` + ``attention`` is the transformer layers'
work (what a deeper model of the same layer shapes multiplies), ``lm_head`` the output layer's,
which dominates a shallow model with a large vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bpo_megatron.models import HFModelConfig
from bpo_megatron.weights.names import RULES_BY_NAME, expected_keys, model_dims

TRAIN_FACTOR = 3.0  # a training step: the forward, and the backward's two products per forward product


@dataclass(frozen=True)
class Flops:
    """Forward FLOPs of some sequences, by where they are spent."""

    layers: float  # the transformer layers' matrix products (projections, router, chosen experts)
    attention: float  # QKᵀ and AV under the causal mask
    lm_head: float  # the output layer

    @property
    def transformer(self) -> float:
        """The transformer layers' whole work (their products and their attention)."""
        return self.layers + self.attention

    @property
    def total(self) -> float:
        return self.layers + self.attention + self.lm_head

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.layers + other.layers, self.attention + other.attention, self.lm_head + other.lm_head)

    def __mul__(self, factor: float) -> Flops:
        return Flops(self.layers * factor, self.attention * factor, self.lm_head * factor)


def layer_weights_per_token(hf: HFModelConfig) -> int:
    """The weights of every layer's matrix products one token goes through: each layer's 2-D
    weights, of the experts only the ``num_experts_per_tok`` it is routed to."""
    dims = model_dims(hf)
    total = 0
    for name, layer, expert in expected_keys(hf):
        rule = RULES_BY_NAME[name]
        if layer < 0 or rule.buffer or expert >= hf.num_experts_per_tok:  # embedding, final norm, output;
            continue  # an expert the token is not routed to (all experts of a layer have one shape)
        total += sum(math.prod(shape) for shape in rule.hf_shapes(dims) if len(shape) == 2)
    return total


def forward_flops(hf: HFModelConfig, input_positions: list[int]) -> Flops:
    """Forward FLOPs of sequences with these numbers of input positions (each causal on its own,
    as packed segments are)."""
    positions = sum(input_positions)
    pairs = sum(n * (n + 1) / 2 for n in input_positions)  # position t attends to t positions
    per_pair = 2.0 * hf.num_attention_heads * (hf.query_key_head_dim + hf.value_head_dim) * hf.num_hidden_layers
    return Flops(layers=2.0 * layer_weights_per_token(hf) * positions, attention=per_pair * pairs,
                 lm_head=2.0 * hf.vocab_size * hf.hidden_size * positions)


def train_flops(hf: HFModelConfig, input_positions: list[int]) -> Flops:
    """FLOPs of a training step (forward and backward) over these sequences."""
    return forward_flops(hf, input_positions) * TRAIN_FACTOR
