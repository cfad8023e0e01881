"""Refuse a Hugging Face config that describes a different network than a checkpoint holds."""

from __future__ import annotations

from bpo_megatron.models.hf_config import HFModelConfig

# Every field that changes a weight's shape or what the network computes with the same weights.
COMPARED_FIELDS: tuple[str, ...] = (
    "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
    "vocab_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "attention_bias", "qk_norm", "rotary_percent", "router_score",
    "router_expert_bias", "routed_scaling_factor", "n_group", "topk_group", "shared_expert_intermediate_size",
    "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "yarn",
)


class ConfigMismatchError(ValueError):
    """A config disagrees with the checkpoint; ``fields`` lists the fields that differ."""

    def __init__(self, message: str, fields: list[str]) -> None:
        super().__init__(message)
        self.fields = fields


def config_mismatches(reference: HFModelConfig, other: HFModelConfig) -> list[tuple[str, object, object]]:
    """``(field, reference value, other value)`` for every compared field that differs."""
    return [(name, getattr(reference, name), getattr(other, name)) for name in COMPARED_FIELDS
            if getattr(reference, name) != getattr(other, name)]


def check_same_architecture(checkpoint: HFModelConfig, given: HFModelConfig, *,
                            given_as: str = "--hf-config") -> None:
    """Raise :class:`ConfigMismatchError` naming each field where ``given`` differs."""
    differences = config_mismatches(checkpoint, given)
    if differences:
        listing = "\n".join(f"  {name}: checkpoint has {ours!r}, {given_as} has {theirs!r}"
                            for name, ours, theirs in differences)
        raise ConfigMismatchError(
            f"{given_as} does not match the checkpoint's model in {len(differences)} field(s):\n"
            f"{listing}", [name for name, _, _ in differences])
