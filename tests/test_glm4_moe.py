"""GLM-4.5 MoE (``Glm4MoeForCausalLM``) end to end, against transformers' own model.

The tiny random GLM (``bpo_megatron/testing/configs/tiny_glm4_moe``) has everything the family adds
to Qwen3-MoE: a dense first layer (``first_k_dense_replace=1``), RoPE on half of each head, Q/K/V
biases, QK-norm (on, and off in a variant), sigmoid routing with a non-zero expert bias that changes
the choice, a routing scale of 2.5 and a shared expert. Conversion must give transformers' logits at
fp32 and export every tensor back bit for bit; the embedded engine's captured routing must be the
routers' top-k of a teacher-forced pass; R3 training at TP=2 and EP=2 must equal TP=1/EP=1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from test_convert import (
    TIMEOUT,
    _batch,
    _check_export,
    _check_megatron_logits,
    _safetensors,
)

from bpo_megatron.convert import convert_hf_to_mcore
from bpo_megatron.models import HFModelConfig, ModelOptions
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.testing import MODEL_CONFIGS
from bpo_megatron.testing.models import random_checkpoint, write_config
from bpo_megatron.weights import hf_tensor_shapes

FIXTURE = MODEL_CONFIGS / "tiny_glm4_moe" / "config.json"


def glm_dict(**overrides: Any) -> dict[str, Any]:
    raw = json.loads(FIXTURE.read_text())
    raw.update(overrides)
    return raw


def _hf_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _save(raw: dict[str, Any], out: Path, seed: int) -> tuple[Path, torch.Tensor]:
    """A random GLM checkpoint of ``raw`` in ``out`` and transformers' logits on the fixed batch."""
    random_checkpoint(write_config(raw, out) / "config.json", out, seed=seed)
    (out / "tokenizer.json").write_text('{"version": "1.0"}')
    with torch.no_grad():
        return out, _hf_model(out)(_batch(raw["vocab_size"])).logits


@pytest.fixture(scope="module")
def glm_models(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    return {"qk_norm": _save(glm_dict(), tmp_path_factory.mktemp("glm_qk_norm"), seed=21),
            "no_qk_norm": _save(glm_dict(use_qk_norm=False, num_hidden_layers=4),
                                 tmp_path_factory.mktemp("glm_plain"), seed=22)}


# ------------------------------------------------------------------------------------ config
def test_config_maps_onto_the_family_neutral_description() -> None:
    hf = HFModelConfig.load(FIXTURE)
    assert hf.architecture == "Glm4MoeForCausalLM" and hf.moe_layers == (1, 2)
    assert (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size) == (8, 2, 32)
    assert hf.shared_expert_intermediate_size == 32 and hf.first_k_dense_replace == 1
    assert (hf.router_score, hf.router_expert_bias, hf.routed_scaling_factor) == ("sigmoid", True, 2.5)
    assert (hf.qk_norm, hf.attention_bias, hf.rotary_percent, hf.rope_theta) == (True, True, 0.5, 10000.0)
    # transformers 4 wrote partial_rotary_factor at the top level; transformers' default is 0.5
    top_level = glm_dict(partial_rotary_factor=0.25, rope_parameters=None, rope_theta=10000.0)
    assert HFModelConfig.load(top_level).rotary_percent == 0.25
    assert HFModelConfig.load(glm_dict(rope_parameters={"rope_theta": 5.0})).rotary_percent == 0.5
    # the export writes the family's own fields back, and they parse to the same description
    bare = HFModelConfig(**{f: getattr(hf, f) for f in hf.__dataclass_fields__ if f != "source"})
    assert HFModelConfig.load(bare.to_hf_dict()) == hf


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
    for name in ("n_shared_experts", "first_k_dense_replace", "routed_scaling_factor", "n_group"):
        raw = glm_dict()
        del raw[name]
        with pytest.raises(ValueError, match=f"required field '{name}'"):
            HFModelConfig.load(raw)


def test_group_limited_routing_that_megatron_scores_alike_is_taken() -> None:
    hf = HFModelConfig.load(glm_dict(n_group=4, topk_group=1))
    assert (hf.n_group, hf.topk_group) == (4, 1)


def test_transformer_config_maps_glm() -> None:
    from bpo_megatron.models import transformer_config

    config = transformer_config(HFModelConfig.load(FIXTURE), ParallelConfig(), ModelOptions(params_dtype="fp32"))
    assert config.qk_layernorm and config.add_qkv_bias and not config.add_bias_linear
    assert config.kv_channels == 32 and config.ffn_hidden_size == 96 and config.moe_ffn_hidden_size == 32
    assert config.moe_layer_freq == [0, 1, 1] and config.moe_shared_expert_intermediate_size == 32
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert config.moe_router_bias_update_rate == 0.0  # the engine's bias never drifts in training
    assert config.moe_router_topk_scaling_factor == 2.5 and config.moe_router_dtype == "fp32"
    assert config.moe_router_num_groups is None and config.moe_router_group_topk is None
    grouped = transformer_config(HFModelConfig.load(glm_dict(n_group=4, topk_group=1)), ParallelConfig(),
                                 ModelOptions(params_dtype="fp32"))
    assert (grouped.moe_router_num_groups, grouped.moe_router_group_topk) == (4, 1)
    plain = transformer_config(HFModelConfig.load(glm_dict(use_qk_norm=False, attention_bias=False)),
                               ParallelConfig(), ModelOptions(params_dtype="fp32"))
    assert not plain.qk_layernorm and not plain.add_qkv_bias


# -------------------------------------------------------------------------------- conversion
@pytest.mark.parametrize("name", ["qk_norm", "no_qk_norm"])
def test_expected_names_and_shapes_are_what_transformers_writes(glm_models, name: str) -> None:
    directory, _ = glm_models[name]
    written = {n: tuple(t.shape) for n, t in _safetensors(directory).items()}
    assert hf_tensor_shapes(HFModelConfig.load(directory)) == written


def test_tp2_ep2_round_trip_gives_transformers_logits(glm_models, tmp_path) -> None:
    hf_dir, ref = glm_models["qk_norm"]
    layout = {"tp": 2, "ep": 2}
    checkpoint = convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", parallel=ParallelConfig(**layout),
                                     progress=False, timeout=TIMEOUT)
    _check_megatron_logits(checkpoint, layout, 2, ref)
    _check_export(checkpoint, tmp_path / "hf", hf_dir, ref, parallel=ParallelConfig(**layout))


def test_pp2_round_trip_without_qk_norm(glm_models, tmp_path) -> None:
    hf_dir, ref = glm_models["no_qk_norm"]
    checkpoint = convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", parallel=ParallelConfig(pp=2),
                                     progress=False, timeout=TIMEOUT)
    _check_megatron_logits(checkpoint, {"pp": 2}, 2, ref)
    _check_export(checkpoint, tmp_path / "hf", hf_dir, ref, parallel=ParallelConfig(pp=2))
