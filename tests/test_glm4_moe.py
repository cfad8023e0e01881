"""What only GLM-4.5 MoE (``Glm4MoeForCausalLM``) has, against transformers' own model.

The family's contract (its tiny config onto the description and Megatron's config, conversion at
TP=2/EP=2 and PP=2 with and without QK-norm, the engine's weight updates, the trainer's router against
the engine's capture, R3 at TP=2/EP=2, the weight sync, the planner, the recipe's count and ``train
--check``) is ``tests/test_model_families.py``. Here: the refusals, where transformers 4 and 5 write
the partial rotary factor, group-limited routing, the expert bias (its dtype in a bf16 checkpoint,
that it changes the choice) and GLM-4.5-Air's sizes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from family_kit import ROOT, TIMEOUT, tiny_config_path, tiny_dict

from test_convert import _assert_bit_exact, _batch, _hf_model, _safetensors, _save

from bpo_megatron.convert import convert_hf_to_mcore
from bpo_megatron.models import HFModelConfig, ModelOptions
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.testing import MODEL_CONFIGS

FIXTURE = tiny_config_path("glm4_moe")


def glm_dict(**overrides: Any) -> dict[str, Any]:
    return tiny_dict("glm4_moe", **overrides)


# ------------------------------------------------------------------------------------ config
def test_the_partial_rotary_factor_is_read_where_transformers_4_and_5_write_it() -> None:
    """transformers 4 wrote partial_rotary_factor at the top level, 5 in rope_parameters; without one
    transformers' default for GLM is 0.5."""
    assert HFModelConfig.load(FIXTURE).rotary_percent == 0.5
    top_level = glm_dict(partial_rotary_factor=0.25, rope_parameters=None, rope_theta=10000.0)
    assert HFModelConfig.load(top_level).rotary_percent == 0.25
    assert HFModelConfig.load(glm_dict(rope_parameters={"rope_theta": 5.0})).rotary_percent == 0.5


@pytest.mark.parametrize("overrides, field", [
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"n_group": 2, "topk_group": 2}, "num_experts_per_tok = 2 x topk_group"),
    ({"n_group": 3}, "n_group=3"),
    ({"n_group": 1, "topk_group": 2}, "topk_group=2"),
    ({"first_k_dense_replace": 3}, "first_k_dense_replace"),
    ({"rope_parameters": {"rope_theta": 1.0, "partial_rotary_factor": 0.3}}, "partial_rotary_factor"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor"),
    ({"n_shared_experts": -1}, "n_shared_experts"),
], ids=["norm_topk_prob", "group_ratio", "groups_divide", "topk_group", "dense_layers", "rotary", "scale", "shared"])
def test_configs_megatron_cannot_reproduce_are_refused(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match="config.json") as info:
        HFModelConfig.load(glm_dict(**overrides))
    assert field in str(info.value)


def test_a_family_refuses_the_architecture_of_another() -> None:
    """The description is family-neutral, but each family fixes what its transformers model has:
    a Qwen3-MoE config (built directly) with a shared expert or sigmoid routing is refused."""
    import dataclasses

    qwen = HFModelConfig.load(MODEL_CONFIGS / "tiny_qwen3_moe")
    for field, value in [("shared_expert_intermediate_size", 32), ("first_k_dense_replace", 1), ("qk_norm", False),
                         ("routed_scaling_factor", 2.5)]:
        with pytest.raises(ValueError, match=f"{field}=.* is not part of qwen3_moe"):
            dataclasses.replace(qwen, **{field: value})
    with pytest.raises(ValueError, match="mlp_only_layers=.* is not part of glm4_moe"):
        dataclasses.replace(HFModelConfig.load(FIXTURE), mlp_only_layers=(2,))


def test_group_limited_routing_that_megatron_scores_alike_is_taken() -> None:
    hf = HFModelConfig.load(glm_dict(n_group=4, topk_group=1))
    assert (hf.n_group, hf.topk_group) == (4, 1)


def test_transformer_config_follows_group_limits_qk_norm_and_biases() -> None:
    """(The tiny config's own mapping is the contract's.) Group limits reach Megatron's router; a GLM
    without QK-norm or Q/K/V biases builds without them."""
    from bpo_megatron.models import transformer_config

    grouped = transformer_config(HFModelConfig.load(glm_dict(n_group=4, topk_group=1)), ParallelConfig(),
                                 ModelOptions(params_dtype="fp32"))
    assert (grouped.moe_router_num_groups, grouped.moe_router_group_topk) == (4, 1)
    plain = transformer_config(HFModelConfig.load(glm_dict(use_qk_norm=False, attention_bias=False)),
                               ParallelConfig(), ModelOptions(params_dtype="fp32"))
    assert not plain.qk_layernorm and not plain.add_qkv_bias


# -------------------------------------------------------------------------------- conversion
def test_a_bf16_checkpoint_round_trips_with_its_fp32_expert_bias(tmp_path) -> None:
    """transformers keeps and saves the router's expert bias in fp32 in a bf16 model; the export
    writes the bf16 weights in bf16 and the bias in fp32 again, bit for bit."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bpo_megatron.convert import convert_mcore_to_hf
    from bpo_megatron.testing.models import spread_weights_

    torch.manual_seed(6)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(FIXTURE.parent), dtype=torch.bfloat16)
    spread_weights_(model)
    model.save_pretrained(tmp_path / "hf")
    written = _safetensors(tmp_path / "hf")
    assert written["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert written["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    checkpoint = convert_hf_to_mcore(tmp_path / "hf", tmp_path / "ckpt", parallel=ParallelConfig(ep=2),
                                     progress=False, timeout=TIMEOUT)
    convert_mcore_to_hf(checkpoint, tmp_path / "out", progress=False, timeout=TIMEOUT)
    _assert_bit_exact(tmp_path / "out", tmp_path / "hf")


# ------------------------------------------------------------------------- routing and R3
def test_the_expert_bias_changes_which_experts_win(family_models) -> None:
    """The fixture's bias is large enough that routing without it would differ: a trainer that
    dropped it could not reproduce the engine's choice."""
    model = _hf_model(family_models.checkpoint("glm4_moe")[0])
    tokens = _batch(model.config.vocab_size)
    hidden = model.model.embed_tokens(tokens).view(-1, model.config.hidden_size)
    changed = 0.0
    with torch.no_grad():
        for layer in (1, 2):
            gate = model.model.layers[layer].mlp.gate
            biased = gate(hidden)[2].sort(dim=-1).values
            bias = gate.e_score_correction_bias.clone()
            gate.e_score_correction_bias.zero_()
            plain = gate(hidden)[2].sort(dim=-1).values
            gate.e_score_correction_bias.copy_(bias)
            changed = max(changed, (biased != plain).any(dim=-1).float().mean().item())
    assert changed > 0.2, changed


# ---------------------------------------------------------------------- GLM-4.5-Air recipe
AIR = ROOT / "configs" / "models" / "glm4_5_air" / "config.json"


def test_glm_4_5_air_has_the_published_sizes_and_the_planners_shard() -> None:
    """(Its total against transformers' own count is the contract's.)"""
    from bpo_megatron.models import model_vocab_size
    from bpo_megatron.planner.params import rank_parameters
    from bpo_megatron.weights.names import parameter_counts

    hf = HFModelConfig.load(AIR)
    assert (len(hf.moe_layers), hf.moe_layers[0], hf.rotary_percent, hf.qk_norm) == (45, 1, 0.5, False)
    total, active = parameter_counts(hf)
    # the published "106B total, 12B active" are these counts cut to whole billions, the active one
    # without the two embeddings (106.85 B and 12.18 B)
    embeddings = 2 * hf.vocab_size * hf.hidden_size
    assert int(total // 1e9) == 106 and int((active - embeddings) // 1e9) == 12
    options = ModelOptions(params_dtype="bf16")
    # at tp 4 ep 16, per MoE layer: QKV with its bias, the output projection, two norms (no
    # QK-norm), the router, the shared expert split over TP; 8 local experts
    [shard] = rank_parameters(hf, ParallelConfig(tp=4, ep=16), options)
    qkv_rows = (96 + 2 * 8) * 128 // 4
    attention = qkv_rows * 4096 + qkv_rows + 4096 * (96 * 128 // 4) + 2 * 4096
    moe_layer = attention + 128 * 4096 + 3 * 4096 * 1408 // 4
    dense_layer = attention + 3 * 4096 * 10944 // 4
    vocab_rows = model_vocab_size(hf, ParallelConfig(tp=4), options) // 4
    assert shard.dense == 2 * vocab_rows * 4096 + 4096 + dense_layer + 45 * moe_layer
    assert shard.expert == 45 * 8 * 3 * 4096 * 1408


def _free_routing_rank(hf_dir: str, rows: list) -> list:
    """The trainer's own routing of ``rows`` (teacher-forced, recorded), with replay on."""
    from bpo_megatron import testing as th
    from bpo_megatron.trainer.samples import TrainSample

    hf = HFModelConfig.load(hf_dir)
    actor = th.build_actor(hf, replay=True, weights=hf_dir, params_dtype="fp32", micro_batch_size=2)
    samples = [TrainSample(tokens=row, response_start=2, rollout_logprobs=-torch.ones(row.numel() - 2), advantage=1.0)
               for row in rows]
    routing = actor.compute_logprobs(samples, record_routing=True).routed_experts
    actor.close()
    return routing


def test_group_limited_routing_is_reproduced(tmp_path) -> None:
    """n_group=4, topk_group=1 (top-2 of 8 experts, both from the best group, groups ranked by their
    two best biased scores): Megatron's group-limited router picks what transformers' does."""
    from bpo_megatron.parallel.local_world import run_gloo_world
    from bpo_megatron.testing.recompute import teacher_forced

    hf_dir, _ = _save(glm_dict(n_group=4, topk_group=1), tmp_path / "grouped", seed=24)
    model = _hf_model(hf_dir)
    rows = list(torch.randint(0, 200, (4, 10), generator=torch.Generator().manual_seed(9)))
    want = [teacher_forced(model, row, temperature=1.0)[1] for row in rows]
    assert all(bool(((w[..., 0] // 2) == (w[..., 1] // 2)).all()) for w in want)  # one group per token
    (got,) = run_gloo_world(_free_routing_rank, 1, str(hf_dir), rows, timeout=TIMEOUT)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.long().sort(dim=-1).values, b.long().sort(dim=-1).values)
