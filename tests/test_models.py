"""The Qwen3 / Qwen3-MoE model provider: config parsing, the Megatron mapping, built models.

Parsing and the mapping are checked in this process; models are built in gloo worlds (one process
per rank). The built model's parameter count must equal the closed-form count of the Hugging Face
model (plus vocabulary padding), which pins the architecture: QK-norm, no biases, GQA shapes,
per-expert and router shapes, tied or untied output layer. Every parallel layout loads one
world-size-1 checkpoint and must reproduce its logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import tiny_gpt as tg
from bpo_megatron.models import (
    HFModelConfig,
    ModelOptions,
    build_gpt_model,
    model_vocab_size,
    padded_vocab_size,
    transformer_config,
)
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.weights.names import parameter_counts
from bpo_megatron.testing import MODEL_CONFIGS

FIXTURES = MODEL_CONFIGS
QWEN3_30B_A3B = Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen3_30b_a3b"
WORLD_TIMEOUT_S = 60.0
BATCH, SEQ = 2, 16
LOGITS_TOL = 1e-5


def fixture_dict(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name / "config.json").read_text())


def tiny_moe(**overrides: Any) -> HFModelConfig:
    return HFModelConfig.load({**fixture_dict("tiny_qwen3_moe"), **overrides})


# --------------------------------------------------------------------------------------------
# Parsing and closed-form counts
# --------------------------------------------------------------------------------------------


def test_fixtures_parse() -> None:
    moe = HFModelConfig.load(FIXTURES / "tiny_qwen3_moe")  # a checkpoint directory
    assert moe.architecture == "Qwen3MoeForCausalLM"
    assert (moe.vocab_size, moe.hidden_size, moe.head_dim) == (200, 64, 32)  # head_dim ≠ 64/4
    assert (moe.num_attention_heads, moe.num_key_value_heads) == (4, 2)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 32)
    assert moe.norm_topk_prob is True and moe.mlp_only_layers == () and moe.moe_layers == (0, 1)

    dense = HFModelConfig.load(FIXTURES / "tiny_qwen3" / "config.json")  # the file itself
    assert dense.architecture == "Qwen3ForCausalLM"
    assert dense.tie_word_embeddings is True and dense.moe_layers == () and not dense.is_moe

    big = HFModelConfig.load(json.loads((QWEN3_30B_A3B / "config.json").read_text()))  # the parsed dict
    assert (big.num_hidden_layers, big.num_experts, big.rope_theta) == (48, 128, 1e6)
    assert big.moe_layers == tuple(range(48))


def test_moe_layer_rule_follows_transformers() -> None:
    raw = json.loads((QWEN3_30B_A3B / "config.json").read_text())
    cfg = HFModelConfig.load({**raw, "num_hidden_layers": 8, "decoder_sparse_step": 2,
                              "mlp_only_layers": [3]})
    assert cfg.moe_layers == (1, 5, 7)  # (layer + 1) % 2 == 0, minus mlp_only layer 3
    assert tiny_moe(mlp_only_layers=[0, 1]).is_moe is False


def test_optional_fields_default_like_transformers() -> None:
    raw = fixture_dict("tiny_qwen3")
    for name in ("head_dim", "tie_word_embeddings", "attention_bias", "rope_scaling"):
        raw.pop(name)
    cfg = HFModelConfig.load(raw)
    assert cfg.head_dim == 64 // 4 and cfg.tie_word_embeddings is False
    # transformers 5 writes the RoPE base inside rope_parameters
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    assert HFModelConfig.load(raw).rope_theta == 5e5


def _without(name: str):
    return lambda raw: {k: v for k, v in raw.items() if k != name}


def _with(**fields: Any):
    return lambda raw: {**raw, **fields}


INVALID_CONFIGS = {
    "unknown model_type": (_with(model_type="llama"), r"model_type='llama' is not supported"),
    "unknown architecture": (_with(architectures=["LlamaForCausalLM"]), r"architectures="),
    "missing hidden_size": (_without("hidden_size"), r"'hidden_size' is missing"),
    "missing norm_topk_prob": (_without("norm_topk_prob"), r"'norm_topk_prob' is missing"),
    "missing rope_theta": (_without("rope_theta"), r"'rope_theta' is missing"),
    "zero hidden_size": (_with(hidden_size=0), r"hidden_size=0 must be a positive integer"),
    "negative vocab": (_with(vocab_size=-5), r"vocab_size=-5 must be a positive integer"),
    "float top-k": (_with(num_experts_per_tok=1.5), r"num_experts_per_tok=1.5 must be a positive"),
    "zero eps": (_with(rms_norm_eps=0.0), r"rms_norm_eps=0.0 must be a positive number"),
    "kv heads": (_with(num_attention_heads=8, num_key_value_heads=3),
                 r"^config\.json: num_key_value_heads=3 must divide num_attention_heads=8$"),
    "top-k > experts": (_with(num_experts_per_tok=5), r"num_experts_per_tok=5 must not exceed"),
    "rope scaling": (_with(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"rope_scaling="),
    "rope parameters": (_with(rope_parameters={"rope_type": "linear", "factor": 2.0}),
                        r"rope_parameters="),
    "sliding window": (_with(use_sliding_window=True), r"use_sliding_window=True"),
    "sliding layers": (_with(layer_types=["full_attention", "sliding_attention"]),
                       r"layer_types"),
    "attention bias": (_with(attention_bias=True), r"attention_bias=True"),
    "activation": (_with(hidden_act="gelu"), r"hidden_act='gelu'"),
    "mlp_only_layers": (_with(mlp_only_layers=[2]), r"mlp_only_layers contains 2"),
    "bool field": (_with(tie_word_embeddings="no"), r"tie_word_embeddings='no'"),
}


@pytest.mark.parametrize("case", INVALID_CONFIGS, ids=list(INVALID_CONFIGS))
def test_invalid_config_names_the_field(case: str) -> None:
    mutate, message = INVALID_CONFIGS[case]
    with pytest.raises(ValueError, match=message):
        HFModelConfig.load(mutate(fixture_dict("tiny_qwen3_moe")))


def test_parameter_counts_tiny_moe_closed_form() -> None:
    # by hand: attention 3·64·128 + 2·64·64 + 2·32 (QK-norm) + 2·64 (norms) = 24768 per layer;
    # router 4·64 = 256; expert 3·64·32 = 6144; embeddings 2·200·64; final norm 64
    total = 2 * (24768 + 256 + 4 * 6144) + 2 * 200 * 64 + 64
    active = 2 * (24768 + 256 + 2 * 6144) + 2 * 200 * 64 + 64
    assert parameter_counts(tiny_moe()) == (total, active) == (124864, 100288)


def test_parameter_counts_qwen3_30b_a3b() -> None:
    total, active = parameter_counts(HFModelConfig.load(QWEN3_30B_A3B))
    assert (total, active) == (30_532_122_624, 3_353_032_704)
    assert abs(total - 30.5e9) <= 0.01 * 30.5e9
    # The published "3.3B activated" is 3.353B cut to one decimal (1.6% above 3.3B).
    assert abs(active - 3.3e9) <= 0.02 * 3.3e9 and f"{active / 1e9:.4}"[:3] == "3.3"


# --------------------------------------------------------------------------------------------
# Options, vocab padding and the TransformerConfig mapping
# --------------------------------------------------------------------------------------------


def test_model_options_defaults_and_validation() -> None:
    options = ModelOptions()
    assert options.params_dtype is None  # decided where the model is built
    assert options.resolved().params_dtype == "fp32" and options.resolved().torch_dtype == torch.float32  # CPU
    assert options.moe_aux_loss_coeff == 0.0 and options.routing_replay is False
    assert options.recompute == "none"
    assert (options.moe_token_dispatcher, options.make_vocab_size_divisible_by) == ("alltoall", 128)
    assert options.moe_dispatch == "sorted"
    for field, value in [("params_dtype", "fp8"), ("recompute", "selective"),
                         ("moe_token_dispatcher", "flex"), ("moe_dispatch", "fused"), ("moe_aux_loss_coeff", -0.1),
                         ("make_vocab_size_divisible_by", 0), ("routing_replay", 1)]:
        with pytest.raises(ValueError, match=rf"model\.{field}="):
            ModelOptions(**{field: value})


def test_an_unset_params_dtype_is_decided_by_the_rank_that_builds_the_model(monkeypatch) -> None:
    """A driver without a GPU hands the trainer ranks its config: an unset dtype must reach them
    unset and become bf16 on a rank with a GPU (decided on the driver it became fp32)."""
    import pickle

    from bpo_megatron import platform
    from bpo_megatron.experiment import load_experiment

    cfg = load_experiment(Path(__file__).parents[1] / "configs" / "tiny_moe_cpu.yaml", check_model=False)
    on_driver = cfg.model.options  # what the trainer workers are given
    assert on_driver.params_dtype is None
    with pytest.raises(ValueError, match=r"model\.params_dtype is unset.*ModelOptions\.resolved\(\)"):
        on_driver.torch_dtype  # nobody may read a dtype that was never decided
    on_rank = pickle.loads(pickle.dumps(on_driver))
    monkeypatch.setattr(platform, "has_cuda", lambda: True)
    assert on_rank.resolved().params_dtype == "bf16" and on_rank.resolved().torch_dtype == torch.bfloat16
    config = transformer_config(tiny_moe(), ParallelConfig(), on_rank)
    assert config.bf16 and config.params_dtype == config.pipeline_dtype == torch.bfloat16
    # a dtype that is set is kept, on either platform; the experiment's model section holds the options
    assert ModelOptions(params_dtype="fp32").resolved().params_dtype == "fp32"
    assert type(cfg.model.options.resolved()) is ModelOptions
    monkeypatch.setattr(platform, "has_cuda", lambda: False)
    assert on_rank.resolved().params_dtype == "fp32"
    assert ModelOptions(params_dtype="bf16").resolved().params_dtype == "bf16"
    assert (on_rank.params_dtype_on(gpu=True), on_rank.params_dtype_on(gpu=False)) == ("bf16", "fp32")


def test_padded_vocab_size_follows_megatron() -> None:
    assert padded_vocab_size(151936, 1) == 151936  # Qwen's vocab is already a multiple of 128
    assert padded_vocab_size(151936, 2) == 152064  # ... but not of 256
    assert padded_vocab_size(200, 1) == padded_vocab_size(200, 2) == 256
    assert padded_vocab_size(257, 1) == 384 and padded_vocab_size(7, 3, divisible_by=1) == 9
    assert model_vocab_size(tiny_moe(), ParallelConfig(tp=2), ModelOptions()) == 256


def test_transformer_config_maps_qwen3_moe() -> None:
    hf = tiny_moe(mlp_only_layers=[0])
    config = transformer_config(hf, ParallelConfig(tp=2, ep=2), ModelOptions(routing_replay=True))
    assert config.normalization == "RMSNorm" and config.layernorm_epsilon == 1e-6
    assert config.qk_layernorm and config.gated_linear_unit
    assert config.activation_func is torch.nn.functional.silu
    assert not config.add_bias_linear and not config.add_qkv_bias
    assert (config.num_query_groups, config.kv_channels, config.ffn_hidden_size) == (2, 32, 128)
    assert (config.num_moe_experts, config.moe_router_topk) == (4, 2)
    assert config.moe_ffn_hidden_size == 32
    assert config.moe_layer_freq == [0, 1]
    assert config.moe_router_pre_softmax is False  # norm_topk_prob: top-k, then softmax over k
    assert config.moe_router_score_function == "softmax" and config.moe_router_dtype == "fp32"
    assert config.moe_shared_expert_intermediate_size is None
    assert config.moe_router_load_balancing_type == "none" and config.moe_aux_loss_coeff == 0.0
    assert config.moe_enable_routing_replay and not config.moe_router_fusion
    assert not config.moe_grouped_gemm and not config.moe_permute_fusion
    assert config.moe_token_dispatcher_type == "alltoall"
    assert config.sequence_parallel and config.expert_tensor_parallel_size == 1
    assert (config.hidden_dropout, config.attention_dropout) == (0.0, 0.0)
    assert config.use_cpu_initialization and not config.gradient_accumulation_fusion
    assert not (config.bias_activation_fusion or config.apply_rope_fusion
                or config.masked_softmax_fusion or config.bias_dropout_fusion)
    assert config.params_dtype == torch.float32 and not config.bf16
    assert config.recompute_granularity is None


def test_transformer_config_options() -> None:
    options = ModelOptions(params_dtype="bf16", recompute="full", moe_aux_loss_coeff=1e-3,
                           moe_token_dispatcher="allgather")
    config = transformer_config(tiny_moe(norm_topk_prob=False), ParallelConfig(pp=2), options)
    assert config.moe_router_pre_softmax is True  # unnormalised: probabilities of the full softmax
    assert (config.moe_router_load_balancing_type, config.moe_aux_loss_coeff) == ("aux_loss", 1e-3)
    assert config.bf16 and config.params_dtype == config.pipeline_dtype == torch.bfloat16
    assert (config.recompute_granularity, config.recompute_method,
            config.recompute_num_layers) == ("full", "uniform", 1)
    assert config.moe_token_dispatcher_type == "allgather"
    assert config.moe_router_fusion is False  # never on without transformer-engine
    dense = transformer_config(HFModelConfig.load(FIXTURES / "tiny_qwen3"), ParallelConfig(),
                               ModelOptions())
    assert dense.num_moe_experts is None and dense.ffn_hidden_size == 128


def test_transformer_config_refusals() -> None:
    dense = HFModelConfig.load(FIXTURES / "tiny_qwen3")
    with pytest.raises(ValueError, match=r"model\.routing_replay=True needs a Mixture-of-Experts"):
        transformer_config(dense, ParallelConfig(), ModelOptions(routing_replay=True))
    with pytest.raises(ValueError, match=r"parallel\.tp=4 must divide"):
        transformer_config(tiny_moe(), ParallelConfig(tp=4), ModelOptions())
    with pytest.raises(ValueError, match=r"parallel\.ep=8 must divide"):
        transformer_config(tiny_moe(), ParallelConfig(ep=8), ModelOptions())
    with pytest.raises(ValueError, match=r"num_experts_per_tok=1 with norm_topk_prob"):
        transformer_config(tiny_moe(num_experts_per_tok=1), ParallelConfig(), ModelOptions())


# --------------------------------------------------------------------------------------------
# Rank functions (module level so that the gloo ranks can import them)
# --------------------------------------------------------------------------------------------


def _init_parallel(parallel: ParallelConfig) -> None:
    from bpo_megatron.parallel import initialize_parallel

    initialize_parallel(parallel, seed=tg.SEED)


def _summary(model: torch.nn.Module) -> dict[str, Any]:
    """What the architecture tests look at: counts, shapes, module kinds, RoPE frequencies."""
    params = dict(model.named_parameters())
    layers = model.decoder.layers
    summary: dict[str, Any] = {
        "num_params": sum(p.numel() for p in params.values()),
        "bias_params": [name for name in params if name.endswith("bias")],
        "shapes": {name: tuple(p.shape) for name, p in params.items()},
        "mlp_kinds": [type(layer.mlp).__name__ for layer in layers],
        "norm_kinds": {type(layers[0].input_layernorm).__name__,
                       type(layers[0].self_attention.q_layernorm).__name__,
                       type(model.decoder.final_layernorm).__name__},
        "qk_norm_eps": layers[0].self_attention.k_layernorm.eps,
        "inv_freq": model.rotary_pos_emb.inv_freq.clone(),
        "tied": model.share_embeddings_and_output_weights,
    }
    return summary


def _build_summaries_rank(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from megatron.core import parallel_state

    _init_parallel(ParallelConfig())
    out = {}
    for name, raw in configs.items():
        model = build_gpt_model(HFModelConfig.load(raw), ParallelConfig(), ModelOptions())
        out[name] = _summary(model)
    parallel_state.destroy_model_parallel()
    return out


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 200, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    return tokens, positions


def _pipeline_logits(model: torch.nn.Module) -> torch.Tensor | None:
    """One forward through Megatron's pipeline schedule; the last stage returns the logits."""
    return tg.schedule_logits(model, *_batch())


def _forward_rank(raw: dict[str, Any], layout: dict[str, int], checkpoint: str,
                  save: bool) -> dict[str, Any]:
    """Build the model for ``layout``, save (world size 1) or load the shared checkpoint, and run
    one forward; returns this rank's logits shard (None off the last pipeline stage)."""
    from megatron.core import parallel_state

    parallel = ParallelConfig(**layout)
    _init_parallel(parallel)
    hf = HFModelConfig.load(raw)
    model = build_gpt_model(hf, parallel, ModelOptions())
    if save:
        tg.save_checkpoint(model, Path(checkpoint))
    else:
        tg.load_checkpoint(model, Path(checkpoint))
    model.eval()
    with torch.no_grad():
        logits = _pipeline_logits(model)
    result = {
        "logits": logits,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "sequence_parallel": model.config.sequence_parallel,
        "vocab_rows": model_vocab_size(hf, parallel, ModelOptions()),
    }
    parallel_state.destroy_model_parallel()
    return result


# --------------------------------------------------------------------------------------------
# Built models
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def summaries() -> dict[str, Any]:
    configs = {
        "moe": fixture_dict("tiny_qwen3_moe"),
        "dense": fixture_dict("tiny_qwen3"),
        "mixed": {**fixture_dict("tiny_qwen3_moe"), "mlp_only_layers": [0]},
    }
    [out] = run_gloo_world(_build_summaries_rank, 1, configs, timeout=WORLD_TIMEOUT_S)
    return out


@pytest.mark.parametrize("name, fixture", [("moe", "tiny_qwen3_moe"), ("dense", "tiny_qwen3")])
def test_built_model_matches_hf_parameter_count(summaries, name: str, fixture: str) -> None:
    hf = HFModelConfig.load(FIXTURES / fixture)
    out = summaries[name]
    padding_rows = padded_vocab_size(hf.vocab_size, 1) - hf.vocab_size
    padding = padding_rows * hf.hidden_size * (1 if hf.tie_word_embeddings else 2)
    assert out["num_params"] == parameter_counts(hf)[0] + padding
    assert out["bias_params"] == []
    assert out["tied"] is hf.tie_word_embeddings
    assert out["norm_kinds"] == {"RMSNorm"}  # torch.nn.RMSNorm for block, QK and final norms
    assert out["qk_norm_eps"] == hf.rms_norm_eps
    head_dim = hf.head_dim
    qkv_rows = (hf.num_attention_heads + 2 * hf.num_key_value_heads) * head_dim
    shapes = out["shapes"]
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == (qkv_rows, hf.hidden_size)
    assert shapes["decoder.layers.0.self_attention.linear_proj.weight"] == (
        hf.hidden_size, hf.num_attention_heads * head_dim)
    assert shapes["decoder.layers.0.self_attention.q_layernorm.weight"] == (head_dim,)
    # RoPE with base rope_theta over head_dim, as transformers computes it
    expected = 1.0 / hf.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    torch.testing.assert_close(out["inv_freq"], expected)


def test_moe_layer_shapes(summaries) -> None:
    shapes = summaries["moe"]["shapes"]
    mlp = "decoder.layers.1.mlp"
    assert shapes[f"{mlp}.router.weight"] == (4, 64)
    # the grouped experts (the default): one stacked parameter per projection, [experts, out, in]
    assert shapes[f"{mlp}.experts.fc1_weight"] == (4, 2 * 32, 64)  # gate+up
    assert shapes[f"{mlp}.experts.fc2_weight"] == (4, 64, 32)
    assert shapes["output_layer.weight"] == (256, 64)  # untied, padded vocabulary
    assert summaries["moe"]["mlp_kinds"] == ["SortedDispatchMoELayer"] * 2  # Megatron's MoELayer, sorted dispatch
    assert summaries["dense"]["mlp_kinds"] == ["MLP", "MLP"]
    assert "output_layer.weight" not in summaries["dense"]["shapes"]  # tied to the embedding


def test_mlp_only_layers_build_dense(summaries) -> None:
    out = summaries["mixed"]
    assert out["mlp_kinds"] == ["MLP", "SortedDispatchMoELayer"]
    assert out["shapes"]["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * 128, 64)
    hf = tiny_moe(mlp_only_layers=[0])
    assert out["num_params"] == parameter_counts(hf)[0] + 2 * (256 - 200) * 64


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """World size 1 writes the checkpoint every layout loads, and its logits are the reference."""
    checkpoint = tmp_path_factory.mktemp("tiny_qwen3_moe_checkpoint")
    [out] = run_gloo_world(_forward_rank, 1, fixture_dict("tiny_qwen3_moe"), {}, str(checkpoint),
                           True, timeout=WORLD_TIMEOUT_S)
    out["checkpoint"] = str(checkpoint)
    return out


LAYOUTS = {"tp2_sp": {"tp": 2}, "ep2": {"ep": 2}, "tp2_ep2": {"tp": 2, "ep": 2}, "pp2": {"pp": 2}}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_parallel_forward_matches_single_rank(reference, layout: str) -> None:
    parallel = ParallelConfig(**LAYOUTS[layout])
    ranks = run_gloo_world(_forward_rank, 2, fixture_dict("tiny_qwen3_moe"), LAYOUTS[layout],
                           reference["checkpoint"], False, timeout=WORLD_TIMEOUT_S)
    padded = ranks[0]["vocab_rows"]
    assert padded == 256 and reference["logits"].shape == (BATCH, SEQ, padded)
    if parallel.pp > 1:
        assert ranks[0]["logits"] is None  # only the last stage has an output layer
        ranks = ranks[1:]
    for out in ranks:
        assert out["logits"].shape == (BATCH, SEQ, padded // parallel.tp)
        assert out["sequence_parallel"] is (parallel.tp > 1)
    if parallel.tp > 1:  # the two ranks hold the two vocabulary shards
        shards = [out["logits"] for out in sorted(ranks, key=lambda out: out["tp_rank"])]
        full_logits = [torch.cat(shards, dim=-1)]
    else:  # each rank holds the full vocabulary
        full_logits = [out["logits"] for out in ranks]
    for logits in full_logits:
        torch.testing.assert_close(logits, reference["logits"], rtol=LOGITS_TOL, atol=LOGITS_TOL)
