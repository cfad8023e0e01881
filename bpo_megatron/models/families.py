"""The model families the trainer reproduces, one :class:`ModelFamily` per Hugging Face ``model_type``.

A family turns its ``config.json`` into the fields of
:class:`~bpo_megatron.models.hf_config.HFModelConfig`, a description of the architecture in one
vocabulary (``qk_norm``, ``rotary_percent``, ``router_score``, ``router_expert_bias``,
``shared_expert_intermediate_size``, ``moe_layers`` ...), refuses what Megatron-Core cannot
reproduce, and writes the family's fields back for export. Everything downstream — the Megatron
``TransformerConfig`` and layer spec (:mod:`bpo_megatron.models.megatron_model`), the Hugging Face
name rules (:mod:`bpo_megatron.weights.names`), routing capture and replay, the planner — reads that
description, never the ``model_type``; a new family is a new entry here (plus name rules for weights
no family had before) and its test data for the contract every family passes
(``tests/test_model_families.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bpo_megatron.models.hf_config import HFModelConfig


def config_error(message: str) -> ValueError:
    return ValueError(f"config.json: {message}")


@dataclass(frozen=True)
class ModelFamily:
    """One Hugging Face ``model_type``.

    ``required``: the family's own config.json fields that must be present (beyond the common
    ones); ``parse``: the raw dict → the family's :class:`HFModelConfig` fields; ``check``: the
    family's refusals on a built config (direct construction goes through it too); ``moe_layers``:
    transformers' rule for which decoder layers are Mixture-of-Experts; ``hf_fields``: the family's
    config.json fields for :meth:`HFModelConfig.to_hf_dict`. ``rotary_default`` is the
    ``partial_rotary_factor`` transformers assumes when config.json does not give one.
    ``embedded_decode``: whether the embedded engine's functional decode step reproduces it.
    ``rope_scalings``: the ``rope_type`` values besides plain RoPE it takes (Megatron's latent
    attention computes YaRN as transformers does).
    """

    model_type: str
    architecture: str
    moe: bool  # whether the family has Mixture-of-Experts layers (its MoE fields are then required)
    required: tuple[str, ...]
    parse: Callable[[Mapping[str, Any]], dict[str, Any]]
    check: Callable[[HFModelConfig], None]
    moe_layers: Callable[[HFModelConfig], tuple[int, ...]]
    hf_fields: Callable[[HFModelConfig], dict[str, Any]]
    rotary_default: float = 1.0
    embedded_decode: bool = True
    rope_scalings: tuple[str, ...] = ()  # RoPE scalings (rope_type) the family's Megatron counterpart reproduces
    # the config.json field counting the family's multi-token-prediction layers (None: it has none);
    # they are carried beside the model, never trained (bpo_megatron.weights.mtp)
    mtp_layers_field: str | None = None


def _nonnegative_number(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise config_error(f"{name}={value!r} must be a non-negative number")


def _qwen3_attention(hf: HFModelConfig) -> None:
    if hf.rotary_percent != 1.0:
        raise config_error(f"partial_rotary_factor={hf.rotary_percent!r} is not supported for "
                           f"{hf.model_type} (transformers' Qwen3 rotates every dimension)")
    if hf.attention_bias:
        # Qwen3 puts the bias on o_proj as well; Megatron's add_qkv_bias covers only the
        # fused QKV projection, so such a checkpoint has no exact Megatron counterpart.
        raise config_error("attention_bias=True is not supported (Megatron has no bias on the "
                           "attention output projection alone)")


def _fixed(hf: HFModelConfig, **values: Any) -> None:
    """Fields the family's architecture fixes (only a directly constructed config can differ)."""
    for name, value in values.items():
        if getattr(hf, name) != value:
            raise config_error(f"{name}={getattr(hf, name)!r} is not part of {hf.model_type}; it has {value!r}")


# Qwen3 and Qwen3-MoE: QK-norm, softmax routing without bias, scale, groups or shared expert
_QWEN3_FIXED = dict(qk_norm=True, router_score="softmax", router_expert_bias=False, routed_scaling_factor=1.0,
                    n_group=1, topk_group=1, shared_expert_intermediate_size=0, first_k_dense_replace=0,
                    kv_lora_rank=0)


# ----------------------------------------------------------------------------------- Qwen3
def _qwen3_check(hf: HFModelConfig) -> None:
    _qwen3_attention(hf)
    _fixed(hf, **_QWEN3_FIXED)


def _qwen3_moe_parse(raw: Mapping[str, Any]) -> dict[str, Any]:
    mlp_only = raw.get("mlp_only_layers") or []
    if not isinstance(mlp_only, (list, tuple)):
        raise config_error(f"mlp_only_layers={mlp_only!r} must be a list of layer indices")
    return {
        "num_experts": _alias(raw, "num_experts", "num_local_experts"),
        "num_experts_per_tok": raw["num_experts_per_tok"],
        "moe_intermediate_size": raw["moe_intermediate_size"],
        "norm_topk_prob": raw["norm_topk_prob"],
        "decoder_sparse_step": raw.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(mlp_only),
        "router_aux_loss_coef": raw.get("router_aux_loss_coef", 0.001),
    }


def _qwen3_moe_check(hf: HFModelConfig) -> None:
    _qwen3_attention(hf)
    _fixed(hf, **_QWEN3_FIXED)
    _nonnegative_number("router_aux_loss_coef", hf.router_aux_loss_coef)
    if not isinstance(hf.decoder_sparse_step, int) or isinstance(hf.decoder_sparse_step, bool) \
            or hf.decoder_sparse_step <= 0:
        raise config_error(f"decoder_sparse_step={hf.decoder_sparse_step!r} must be a positive integer")
    for layer in hf.mlp_only_layers:
        if not isinstance(layer, int) or isinstance(layer, bool) or not (0 <= layer < hf.num_hidden_layers):
            raise config_error(f"mlp_only_layers contains {layer!r}; entries must be layer "
                               f"indices in [0, {hf.num_hidden_layers})")


def _qwen3_moe_layers(hf: HFModelConfig) -> tuple[int, ...]:
    return tuple(layer for layer in range(hf.num_hidden_layers)
                 if layer not in hf.mlp_only_layers and hf.num_experts > 0
                 and (layer + 1) % hf.decoder_sparse_step == 0)


def _qwen3_moe_fields(hf: HFModelConfig) -> dict[str, Any]:
    return {"num_experts": hf.num_experts, "num_experts_per_tok": hf.num_experts_per_tok,
            "moe_intermediate_size": hf.moe_intermediate_size, "norm_topk_prob": hf.norm_topk_prob,
            "decoder_sparse_step": hf.decoder_sparse_step, "mlp_only_layers": list(hf.mlp_only_layers),
            "router_aux_loss_coef": hf.router_aux_loss_coef}


# ------------------------------------------------- DeepSeek-V3's MoE layers (also GLM-4.5 MoE's)
def _sigmoid_moe_parse(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE fields DeepSeek-V3 and GLM-4.5 share: a sigmoid router with an expert-score bias,
    group limits and a scale, a shared expert, the first layers dense."""
    shared = raw["n_shared_experts"]
    moe_ffn = raw["moe_intermediate_size"]
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise config_error(f"n_shared_experts={shared!r} must be a non-negative integer")
    return {
        "num_experts": _alias(raw, "n_routed_experts", "num_local_experts"),
        "num_experts_per_tok": raw["num_experts_per_tok"],
        "moe_intermediate_size": moe_ffn,
        "norm_topk_prob": raw["norm_topk_prob"],
        "first_k_dense_replace": raw["first_k_dense_replace"],
        "shared_expert_intermediate_size": moe_ffn * shared if isinstance(moe_ffn, int) else moe_ffn,
        "router_score": "sigmoid",
        "router_expert_bias": True,  # e_score_correction_bias: every router of these families has one
        "routed_scaling_factor": raw["routed_scaling_factor"],
        "n_group": raw["n_group"],
        "topk_group": raw["topk_group"],
    }


def _sigmoid_moe_check(hf: HFModelConfig) -> None:
    _fixed(hf, router_score="sigmoid", router_expert_bias=True, decoder_sparse_step=1, mlp_only_layers=())
    if not hf.norm_topk_prob:
        raise config_error("norm_topk_prob=false is not supported: Megatron's sigmoid router always "
                           f"renormalises the top-k scores (released {hf.model_type} checkpoints set "
                           "norm_topk_prob=true)")
    if not isinstance(hf.first_k_dense_replace, int) or isinstance(hf.first_k_dense_replace, bool) or not (
            0 <= hf.first_k_dense_replace < hf.num_hidden_layers):
        raise config_error(f"first_k_dense_replace={hf.first_k_dense_replace!r} must be an integer in "
                           f"[0, num_hidden_layers={hf.num_hidden_layers})")
    check_group_routing(hf)


def _sigmoid_moe_layers(hf: HFModelConfig) -> tuple[int, ...]:
    return tuple(range(hf.first_k_dense_replace, hf.num_hidden_layers)) if hf.num_experts > 0 else ()


def _sigmoid_moe_fields(hf: HFModelConfig) -> dict[str, Any]:
    shared = hf.shared_expert_intermediate_size // hf.moe_intermediate_size
    return {"n_routed_experts": hf.num_experts, "num_experts_per_tok": hf.num_experts_per_tok,
            "moe_intermediate_size": hf.moe_intermediate_size, "n_shared_experts": shared,
            "norm_topk_prob": hf.norm_topk_prob, "first_k_dense_replace": hf.first_k_dense_replace,
            "routed_scaling_factor": hf.routed_scaling_factor, "n_group": hf.n_group,
            "topk_group": hf.topk_group,
            # a config built without a config.json carries no multi-token-prediction layers; an export
            # writes the count it carries (bpo_megatron.weights.mtp)
            "num_nextn_predict_layers": 0}


_SIGMOID_MOE_REQUIRED = ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "n_shared_experts",
                         "first_k_dense_replace", "routed_scaling_factor", "n_group", "topk_group")


# ------------------------------------------------------------------------------- GLM-4.5 MoE
def _glm4_moe_parse(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {**_sigmoid_moe_parse(raw), "qk_norm": raw.get("use_qk_norm", False)}  # transformers' default


def _glm4_moe_check(hf: HFModelConfig) -> None:
    _fixed(hf, kv_lora_rank=0)
    _sigmoid_moe_check(hf)


def _glm4_moe_fields(hf: HFModelConfig) -> dict[str, Any]:
    return {**_sigmoid_moe_fields(hf), "use_qk_norm": hf.qk_norm}


# ------------------------------------------------------------------------------- DeepSeek-V3
_MLA_REQUIRED = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def _deepseek_v3_parse(raw: Mapping[str, Any]) -> dict[str, Any]:
    if raw.get("rope_interleave", True) is not True:
        # Megatron's MLA rotates the RoPE dims as interleaved pairs (and refuses rotary_interleaved
        # with MLA), so a checkpoint whose pairs are split in halves has no Megatron counterpart
        raise config_error(f"rope_interleave={raw['rope_interleave']!r} is not supported: Megatron's latent "
                           "attention rotates interleaved pairs only (DeepSeek-V3 checkpoints set true)")
    for name, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(name, want) != want:
            raise config_error(f"{name}={raw[name]!r}: transformers' DeepseekV3 always routes as {name}="
                               f"{want!r}, so this checkpoint's model would compute something else")
    return {**_sigmoid_moe_parse(raw), "qk_norm": False,
            # transformers takes head_dim to be the RoPE dims of a head
            "head_dim": raw["qk_rope_head_dim"], "q_lora_rank": raw["q_lora_rank"],
            "kv_lora_rank": raw["kv_lora_rank"], "qk_nope_head_dim": raw["qk_nope_head_dim"],
            "v_head_dim": raw["v_head_dim"]}


def _deepseek_v3_check(hf: HFModelConfig) -> None:
    _fixed(hf, qk_norm=False, rotary_percent=1.0)
    if hf.attention_bias:
        raise config_error("attention_bias=True is not supported for deepseek_v3 (transformers puts it on the "
                           "down projections and o_proj, where Megatron's latent attention has none)")
    if not hf.multi_latent_attention:
        raise config_error("kv_lora_rank must be positive: deepseek_v3 attention is latent attention")
    _sigmoid_moe_check(hf)


def _deepseek_v3_fields(hf: HFModelConfig) -> dict[str, Any]:
    return {**_sigmoid_moe_fields(hf), "q_lora_rank": hf.q_lora_rank, "kv_lora_rank": hf.kv_lora_rank,
            "qk_rope_head_dim": hf.head_dim, "qk_nope_head_dim": hf.qk_nope_head_dim,
            "v_head_dim": hf.v_head_dim, "rope_interleave": True}


def check_group_routing(hf: HFModelConfig) -> None:
    """Group-limited routing (``n_group`` groups, the best ``topk_group`` kept): transformers scores
    a group by the sum of its two best (biased) expert scores, Megatron by the sum of its best
    ``topk / topk_group``; only configs where those agree are taken. One group keeps every expert
    (no limit), which Megatron expresses by leaving its group options unset."""
    for name in ("n_group", "topk_group"):
        value = getattr(hf, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise config_error(f"{name}={value!r} must be a positive integer")
    if hf.n_group == 1:
        if hf.topk_group != 1:
            raise config_error(f"topk_group={hf.topk_group} must be 1 when n_group=1")
        return
    if hf.num_experts % hf.n_group or hf.topk_group > hf.n_group:
        raise config_error(f"n_group={hf.n_group} must divide the {hf.num_experts} experts and be at least "
                           f"topk_group={hf.topk_group}")
    if hf.num_experts_per_tok != 2 * hf.topk_group:
        raise config_error(
            f"n_group={hf.n_group}, topk_group={hf.topk_group} with num_experts_per_tok="
            f"{hf.num_experts_per_tok}: transformers scores each group by its top-2 experts, Megatron by its "
            f"top num_experts_per_tok/topk_group; they agree only when num_experts_per_tok = 2 x topk_group")


def _alias(raw: Mapping[str, Any], name: str, alias: str) -> Any:
    """``raw[name]``, also read under the name transformers 5 may write it as."""
    if alias in raw and name in raw and raw[name] != raw[alias]:
        raise config_error(f"{name}={raw[name]!r} disagrees with {alias}={raw[alias]!r}")
    if name not in raw and alias not in raw:
        raise config_error(f"required field {name!r} is missing")
    return raw[name] if name in raw else raw[alias]


def _none(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _no_fields(hf: HFModelConfig) -> dict[str, Any]:
    return {}


FAMILIES: dict[str, ModelFamily] = {family.model_type: family for family in (
    ModelFamily("qwen3", "Qwen3ForCausalLM", moe=False, required=(), parse=_none, check=_qwen3_check,
                moe_layers=lambda hf: (), hf_fields=_no_fields),
    ModelFamily("qwen3_moe", "Qwen3MoeForCausalLM", moe=True,
                required=("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"),
                parse=_qwen3_moe_parse, check=_qwen3_moe_check, moe_layers=_qwen3_moe_layers,
                hf_fields=_qwen3_moe_fields),
    ModelFamily("glm4_moe", "Glm4MoeForCausalLM", moe=True, required=_SIGMOID_MOE_REQUIRED,
                parse=_glm4_moe_parse, check=_glm4_moe_check, moe_layers=_sigmoid_moe_layers,
                hf_fields=_glm4_moe_fields, rotary_default=0.5, mtp_layers_field="num_nextn_predict_layers"),
    # the multi-token-prediction layers (num_nextn_predict_layers) are not part of the Megatron model: RL
    # trains and samples the main model only (transformers builds none either); their tensors travel
    # beside it through conversion and checkpoints (bpo_megatron.weights.mtp)
    ModelFamily("deepseek_v3", "DeepseekV3ForCausalLM", moe=True, required=_SIGMOID_MOE_REQUIRED + _MLA_REQUIRED,
                parse=_deepseek_v3_parse, check=_deepseek_v3_check, moe_layers=_sigmoid_moe_layers,
                hf_fields=_deepseek_v3_fields, rope_scalings=("yarn",), mtp_layers_field="num_nextn_predict_layers"),
)}


def family_of(model_type: Any) -> ModelFamily:
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise config_error(f"model_type={model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    return family
