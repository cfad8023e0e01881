"""Every weight of a model of the supported families, once: its Megatron-Core parameter names, its Hugging
Face tensor names and shapes, and the layout that turns one into the other.

The table is data: one :class:`WeightRule` per kind of weight. A rule lists the Megatron parameter
names of both module specs (Megatron's local torch modules, used on CPU, and transformer-engine's
on GPU, which fuses the block norms into the following linear layer and keeps the experts of a
layer in one grouped module), the Hugging Face names it becomes (the names on disk:
``mlp.experts.{e}.gate_proj.weight``, even though transformers 5 fuses experts in memory), their
shapes in terms of the config, and the name of the layout in :mod:`bpo_megatron.weights.layouts`.
Weights only some architectures have (Q/K/V biases, QK-norms, shared experts, the router's expert
bias, the projections and latent norms of multi-head latent attention) say so by a predicate on :class:`~bpo_megatron.models.hf_config.HFModelConfig`'s description,
never on the ``model_type``.

A weight is identified across ranks by its :data:`WeightKey` ``(rule, global layer, global
expert)``, with -1 where a rule has no layer or expert.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from bpo_megatron.models.hf_config import HFModelConfig

# Where a rule applies. "first"/"last" are model-level weights before / after the decoder layers
# (they also fix the export order: embedding, layers, final norm, output layer).
Scope = Literal["first", "layer", "dense_layer", "moe_layer", "expert", "last"]
WeightKey = tuple[str, int, int]  # (rule name, global layer or -1, global expert or -1)

_PHASE: dict[str, int] = {"first": 0, "layer": 1, "dense_layer": 1, "moe_layer": 1, "expert": 1,
                          "last": 2}


@dataclass(frozen=True)
class WeightRule:
    """One kind of weight. ``hf`` and ``shapes`` are in the order the layout splits or joins them."""

    name: str
    megatron: tuple[str, ...]  # parameter-name templates: local spec, then transformer-engine spec
    hf: tuple[str, ...]  # Hugging Face tensor-name templates
    shapes: tuple[tuple[str, ...], ...]  # one per HF tensor, in the dimension names of model_dims
    layout: str  # a key of layouts.LAYOUTS
    scope: Scope
    # With tie_word_embeddings the output layer is the embedding: HF checkpoints store only the
    # embedding, so this weight is read from (and not written as) that tensor.
    tied_to: str | None = None
    # Whether the model has this weight at all (None: every model whose layers it fits)
    present: Callable[[HFModelConfig], bool] | None = None
    # A buffer, not a parameter (the router's fixed expert bias): converted and synced, never
    # trained, and exported in its own dtype (fp32, as transformers keeps and saves it in any model dtype)
    buffer: bool = False
    # Only in models with (True) or without (False) multi-head latent attention; None: in both. Both
    # attentions call a query norm ``q_layernorm`` (per head, or of the query latent), so a Megatron
    # name is resolved within the model's kind of attention.
    latent_attention: bool | None = None
    # Weights an engine joins across rules into one parameter and writes only once every part has
    # arrived in the same load call: SGLang's DeepSeek loader concatenates a layer's q_a_proj and
    # kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa and drops a part that arrives alone when the
    # call ends (the layer then keeps its old weights). The rules of one load group stand next to each
    # other in RULES, so their tensors of a layer come one after the other in the export, and a
    # weight-sync bucket is never cut between them (:func:`load_group`).
    load_group: str | None = None
    _patterns: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.hf) != len(self.shapes):
            raise ValueError(f"rule {self.name}: {len(self.hf)} HF names but {len(self.shapes)} shapes")
        object.__setattr__(self, "_patterns", tuple(_compile(t) for t in self.megatron))

    @property
    def is_expert(self) -> bool:
        return self.scope == "expert"

    def match(self, megatron_name: str) -> tuple[int, int] | None:
        """``(local layer, local expert)`` (-1 when absent) if the parameter is this rule's."""
        for pattern in self._patterns:
            found = pattern.fullmatch(megatron_name)
            if found:
                groups = found.groupdict()
                return int(groups.get("layer") or -1), int(groups.get("expert") or -1)
        return None

    def applies_to(self, hf: HFModelConfig) -> bool:
        return self.in_attention(hf.multi_latent_attention) and (self.present is None or self.present(hf))

    def in_attention(self, latent: bool) -> bool:
        return self.latent_attention is None or self.latent_attention == latent

    def hf_names(self, layer: int = -1, expert: int = -1) -> list[str]:
        return [t.format(layer=layer, expert=expert) for t in self.hf]

    def hf_shapes(self, dims: dict[str, int]) -> list[tuple[int, ...]]:
        return [tuple(dims[d] for d in shape) for shape in self.shapes]


def _compile(template: str) -> re.Pattern[str]:
    pattern = re.escape(template)
    for placeholder in ("layer", "expert"):
        pattern = pattern.replace(re.escape("{" + placeholder + "}"), f"(?P<{placeholder}>\\d+)")
    return re.compile(pattern)


def _compressed_query(hf: HFModelConfig) -> bool:
    return hf.q_lora_rank is not None


_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."

RULES: tuple[WeightRule, ...] = (
    WeightRule("embedding", ("embedding.word_embeddings.weight",),
               ("model.embed_tokens.weight",), (("vocab", "hidden"),), "vocab_rows", "first"),
    WeightRule("input_norm",
               (_L + "input_layernorm.weight", _L + "self_attention.linear_qkv.layer_norm_weight"),
               (_H + "input_layernorm.weight",), (("hidden",),), "replicated", "layer"),
    WeightRule("qkv", (_L + "self_attention.linear_qkv.weight",),
               (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight",
                _H + "self_attn.v_proj.weight"),
               (("q", "hidden"), ("kv", "hidden"), ("kv", "hidden")), "qkv", "layer", latent_attention=False),
    # multi-head latent attention: queries from hidden (or from a normed latent of q_lora dims), keys
    # and values from one normed latent of kv_lora dims; the key's RoPE dims come with that latent
    WeightRule("latent_q", (_L + "self_attention.linear_q_proj.weight",),
               (_H + "self_attn.q_proj.weight",), (("latent_q", "hidden"),), "column_parallel", "layer",
               present=lambda hf: hf.q_lora_rank is None,
               latent_attention=True),
    WeightRule("latent_q_down", (_L + "self_attention.linear_q_down_proj.weight",),
               (_H + "self_attn.q_a_proj.weight",), (("q_lora", "hidden"),), "replicated", "layer",
               present=_compressed_query, latent_attention=True, load_group="latent_down"),
    WeightRule("latent_kv_down", (_L + "self_attention.linear_kv_down_proj.weight",),
               (_H + "self_attn.kv_a_proj_with_mqa.weight",), (("kv_lora_rope", "hidden"),), "replicated",
               "layer", latent_attention=True, load_group="latent_down"),
    WeightRule("latent_q_norm",
               (_L + "self_attention.q_layernorm.weight", _L + "self_attention.linear_q_up_proj.layer_norm_weight"),
               (_H + "self_attn.q_a_layernorm.weight",), (("q_lora",),), "replicated", "layer",
               present=_compressed_query, latent_attention=True),
    WeightRule("latent_q_up", (_L + "self_attention.linear_q_up_proj.weight",),
               (_H + "self_attn.q_b_proj.weight",), (("latent_q", "q_lora"),), "column_parallel", "layer",
               present=_compressed_query, latent_attention=True),
    WeightRule("latent_kv_norm",
               (_L + "self_attention.kv_layernorm.weight", _L + "self_attention.linear_kv_up_proj.layer_norm_weight"),
               (_H + "self_attn.kv_a_layernorm.weight",), (("kv_lora",),), "replicated", "layer", latent_attention=True),
    WeightRule("latent_kv_up", (_L + "self_attention.linear_kv_up_proj.weight",),
               (_H + "self_attn.kv_b_proj.weight",), (("latent_kv", "kv_lora"),), "column_parallel", "layer",
               latent_attention=True),
    WeightRule("qkv_bias", (_L + "self_attention.linear_qkv.bias",),
               (_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"),
               (("q",), ("kv",), ("kv",)), "qkv", "layer",
               present=lambda hf: hf.attention_bias, latent_attention=False),
    WeightRule("q_norm", (_L + "self_attention.q_layernorm.weight",),
               (_H + "self_attn.q_norm.weight",), (("head_dim",),), "replicated", "layer",
               present=lambda hf: hf.qk_norm, latent_attention=False),
    WeightRule("k_norm", (_L + "self_attention.k_layernorm.weight",),
               (_H + "self_attn.k_norm.weight",), (("head_dim",),), "replicated", "layer",
               present=lambda hf: hf.qk_norm, latent_attention=False),
    WeightRule("attention_out", (_L + "self_attention.linear_proj.weight",),
               (_H + "self_attn.o_proj.weight",), (("hidden", "values"),), "row_parallel", "layer"),
    WeightRule("post_attention_norm",
               (_L + "pre_mlp_layernorm.weight", _L + "mlp.linear_fc1.layer_norm_weight"),
               (_H + "post_attention_layernorm.weight",), (("hidden",),), "replicated", "layer"),
    WeightRule("mlp_in", (_L + "mlp.linear_fc1.weight",),
               (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
               (("ffn", "hidden"), ("ffn", "hidden")), "glu", "dense_layer"),
    WeightRule("mlp_out", (_L + "mlp.linear_fc2.weight",),
               (_H + "mlp.down_proj.weight",), (("hidden", "ffn"),), "row_parallel", "dense_layer"),
    WeightRule("router", (_L + "mlp.router.weight",),
               (_H + "mlp.gate.weight",), (("experts", "hidden"),), "replicated", "moe_layer"),
    WeightRule("router_bias", (_L + "mlp.router.expert_bias",),
               (_H + "mlp.gate.e_score_correction_bias",), (("experts",),), "replicated", "moe_layer",
               present=lambda hf: hf.router_expert_bias, buffer=True),
    # the shared expert is split over tensor parallelism like a dense MLP, not like the experts
    WeightRule("shared_in", (_L + "mlp.shared_experts.linear_fc1.weight",),
               (_H + "mlp.shared_experts.gate_proj.weight", _H + "mlp.shared_experts.up_proj.weight"),
               (("shared_ffn", "hidden"), ("shared_ffn", "hidden")), "glu", "moe_layer",
               present=lambda hf: hf.shared_expert_intermediate_size > 0),
    WeightRule("shared_out", (_L + "mlp.shared_experts.linear_fc2.weight",),
               (_H + "mlp.shared_experts.down_proj.weight",), (("hidden", "shared_ffn"),), "row_parallel",
               "moe_layer", present=lambda hf: hf.shared_expert_intermediate_size > 0),
    WeightRule("expert_in",
               (_L + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
                _L + "mlp.experts.linear_fc1.weight{expert}"),
               (_H + "mlp.experts.{expert}.gate_proj.weight", _H + "mlp.experts.{expert}.up_proj.weight"),
               (("moe_ffn", "hidden"), ("moe_ffn", "hidden")), "glu", "expert"),
    WeightRule("expert_out",
               (_L + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
                _L + "mlp.experts.linear_fc2.weight{expert}"),
               (_H + "mlp.experts.{expert}.down_proj.weight",), (("hidden", "moe_ffn"),),
               "row_parallel", "expert"),
    WeightRule("final_norm", ("decoder.final_layernorm.weight",),
               ("model.norm.weight",), (("hidden",),), "replicated", "last"),
    WeightRule("output", ("output_layer.weight",),
               ("lm_head.weight",), (("vocab", "hidden"),), "vocab_rows", "last",
               tied_to="model.embed_tokens.weight"),
)

RULES_BY_NAME: dict[str, WeightRule] = {rule.name: rule for rule in RULES}
_RULE_INDEX: dict[str, int] = {rule.name: i for i, rule in enumerate(RULES)}


def _load_group_modules() -> tuple[tuple[re.Pattern[str], str], ...]:
    """Each load group's Hugging Face modules (a tensor name up to its last dot), any layer and
    expert; a module's every tensor (weight, FP8 scales, bias) belongs to its group. Checks that a
    group's rules stand next to each other in RULES and hold no experts, so that its tensors of a
    layer are consecutive in the export (experts come rule by rule, each rule's over all experts)."""
    modules = []
    for group in dict.fromkeys(rule.load_group for rule in RULES if rule.load_group):
        where = [i for i, rule in enumerate(RULES) if rule.load_group == group]
        if where != list(range(where[0], where[-1] + 1)) or any(RULES[i].is_expert for i in where):
            raise RuntimeError(f"load group {group!r}: its rules {[RULES[i].name for i in where]} must stand "
                               "next to each other in RULES and hold no experts")
        modules += [(_compile(template.rsplit(".", 1)[0] + "."), group) for i in where for template in RULES[i].hf]
    return tuple(modules)


_LOAD_GROUP_MODULES = _load_group_modules()


def load_group(hf_name: str) -> tuple[str, int, int] | None:
    """``(load group, layer, expert)`` of a Hugging Face tensor whose rule has a ``load_group``
    (see :class:`WeightRule`), else None. Tensors with the same answer must reach an engine in one
    load call; they are consecutive in the export, and :func:`~bpo_megatron.weights.buckets.buckets`
    never cuts between two neighbours that share one."""
    for pattern, group in _LOAD_GROUP_MODULES:
        found = pattern.match(hf_name)
        if found:
            groups = found.groupdict()
            return group, int(groups.get("layer") or -1), int(groups.get("expert") or -1)
    return None


def model_dims(hf: HFModelConfig) -> dict[str, int]:
    """The dimension names the rules' shapes are written in."""
    return {
        "hidden": hf.hidden_size,
        "vocab": hf.vocab_size,
        "q": hf.num_attention_heads * hf.head_dim,
        "kv": hf.num_key_value_heads * hf.head_dim,
        "head_dim": hf.head_dim,
        "values": hf.num_attention_heads * hf.value_head_dim,  # the attention output, all heads
        "latent_q": hf.num_attention_heads * hf.query_key_head_dim,
        "latent_kv": hf.num_attention_heads * (hf.qk_nope_head_dim + hf.v_head_dim),
        "q_lora": hf.q_lora_rank or 0,
        "kv_lora": hf.kv_lora_rank,
        "kv_lora_rope": hf.kv_lora_rank + hf.head_dim,
        "ffn": hf.intermediate_size,
        "moe_ffn": hf.moe_intermediate_size,
        "shared_ffn": hf.shared_expert_intermediate_size,
        "experts": hf.num_experts,
    }


def match_megatron_name(name: str, *, latent_attention: bool = False) -> tuple[WeightRule, int, int] | None:
    """The rule of a Megatron parameter of a model with (or without) multi-head latent attention
    and its local layer and local expert index (-1: none)."""
    for rule in RULES:
        found = rule.match(name) if rule.in_attention(latent_attention) else None
        if found is not None:
            return rule, found[0], found[1]
    return None


def sort_key(key: WeightKey) -> tuple[int, int, int, int]:
    """Hugging Face order: embedding, then layer by layer (rule order, experts ascending), then
    the final norm and the output layer."""
    rule = RULES_BY_NAME[key[0]]
    return _PHASE[rule.scope], key[1], _RULE_INDEX[rule.name], key[2]


def _applies(rule: WeightRule, hf: HFModelConfig, layer_is_moe: bool) -> bool:
    return rule.applies_to(hf) and {"layer": True, "dense_layer": not layer_is_moe, "moe_layer": layer_is_moe,
                                    "expert": layer_is_moe}[rule.scope]


def decoder_layer_keys(hf: HFModelConfig, layer: int, *, moe: bool) -> list[WeightKey]:
    """The weights of decoder layer ``layer`` (a Mixture-of-Experts layer or a dense one), in
    Hugging Face order."""
    keys: list[WeightKey] = []
    for rule in RULES:
        if _PHASE[rule.scope] != 1 or not _applies(rule, hf, moe):
            continue
        experts = range(hf.num_experts) if rule.is_expert else (-1,)
        keys.extend((rule.name, layer, expert) for expert in experts)
    return keys


def keys_shapes(hf: HFModelConfig, keys: list[WeightKey]) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors of ``keys`` and their shapes, in order."""
    dims = model_dims(hf)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, layer, expert in keys:
        rule = RULES_BY_NAME[name]
        shapes.update(zip(rule.hf_names(layer, expert), rule.hf_shapes(dims)))
    return shapes


def expected_keys(hf: HFModelConfig) -> list[WeightKey]:
    """Every weight the model has, in Hugging Face order; the output layer only when untied. The
    multi-token-prediction layers are not the model's (:mod:`bpo_megatron.weights.mtp`)."""
    keys: list[WeightKey] = [("embedding", -1, -1)]
    moe_layers = set(hf.moe_layers)
    for layer in range(hf.num_hidden_layers):
        keys.extend(decoder_layer_keys(hf, layer, moe=layer in moe_layers))
    keys.append(("final_norm", -1, -1))
    if not hf.tie_word_embeddings:
        keys.append(("output", -1, -1))
    return keys


def hf_tensor_shapes(hf: HFModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor of the model and its shape, in export order (the main model:
    multi-token-prediction layers are carried beside it, :mod:`bpo_megatron.weights.mtp`)."""
    return keys_shapes(hf, expected_keys(hf))


# a routed expert's tensor on disk: model.layers.{layer}.mlp.experts.{expert}.<projection>
_ROUTED_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def unexpected_experts(names, hf: HFModelConfig) -> dict[int, list[int]]:
    """Layer -> the experts that tensors among ``names`` (a checkpoint's) hold in that layer of
    the main model but the config does not have: ids at or past ``num_experts``, or any in a layer
    the config makes dense. Layers past ``num_hidden_layers`` (multi-token prediction) are not the
    main model's and are not looked at."""
    moe_layers, count = set(hf.moe_layers), hf.num_experts
    extra: dict[int, set[int]] = {}
    for name in names:
        found = _ROUTED_EXPERT.match(name)
        if found is None:
            continue
        layer, expert = int(found[1]), int(found[2])
        if layer < hf.num_hidden_layers and (layer not in moe_layers or expert >= count):
            extra.setdefault(layer, set()).add(expert)
    return {layer: sorted(experts) for layer, experts in sorted(extra.items())}


def check_hf_checkpoint(reader, hf: HFModelConfig) -> None:
    """A Hugging Face checkpoint (an open ``HFWeightsReader``) holds every tensor its config
    implies, of its shape, and no expert the config does not count: a config.json with fewer
    experts than its weights (or a dense layer where the weights have experts) builds another
    network than the one trained, and the extra experts would be dropped without a word."""
    reader.check(hf_tensor_shapes(hf))
    extra = unexpected_experts(reader.weight_map, hf)
    if not extra:
        return

    def ids(experts: list[int]) -> str:
        return f"{experts[0]}" if len(experts) == 1 else f"{experts[0]}-{experts[-1]}" if (
            experts[-1] - experts[0] == len(experts) - 1) else ", ".join(map(str, experts))

    moe_layers = set(hf.moe_layers)
    listing = "; ".join(f"layer {layer}{'' if layer in moe_layers else ' (dense in config.json)'}: "
                        f"expert{'s' if len(experts) > 1 else ''} {ids(experts)}" for layer, experts in extra.items())
    raise ValueError(f"the Hugging Face checkpoint in {reader.directory} holds experts its config.json does not count "
                     f"(num_experts, n_routed_experts in DeepSeek-V3 and GLM-4.5 configs, is {hf.num_experts}: ids "
                     f"0-{hf.num_experts - 1} in its MoE layers): {listing}. They would be left out and the model "
                     "built would not be the one these weights were trained as: use the config.json saved with "
                     "these weights")


def hf_tensor_count(hf: HFModelConfig) -> int:
    """How many Hugging Face tensors the model has: what a weight sync announces and sends. The
    multi-token-prediction layers are not among them: they are never trained, so the engines keep
    the ones they loaded from the model's directory at start (SGLang's target model skips tensors
    past ``num_hidden_layers``; its NEXTN/EAGLE draft model loads them, see :mod:`bpo_megatron.weights.mtp`)."""
    return sum(len(RULES_BY_NAME[name].hf) for name, _, _ in expected_keys(hf))


def parameter_counts(hf: HFModelConfig) -> tuple[int, int]:
    """``(total, active)`` parameters of the Hugging Face model, from the rules' shapes.

    ``active`` counts what one token uses: every weight but the experts each MoE layer leaves
    unchosen (all but ``num_experts_per_tok``). Embeddings and the output layer are included in
    both (once when they are tied). Buffers (the router's expert bias) are not parameters.
    """
    dims = model_dims(hf)
    size = {rule.name: 0 if rule.buffer else sum(math.prod(shape) for shape in rule.hf_shapes(dims))
            for rule in RULES}
    total = sum(size[name] for name, _, _ in expected_keys(hf))
    per_expert = sum(size[rule.name] for rule in RULES if rule.is_expert)
    unchosen = len(hf.moe_layers) * (hf.num_experts - hf.num_experts_per_tok) * per_expert
    return total, total - unchosen
