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
    _assert_bit_exact,
    _batch,
    _check_export,
    _check_megatron_logits,
    _hf_model,
    _safetensors,
    _save,
)

from bpo_megatron.convert import convert_hf_to_mcore
from bpo_megatron.models import HFModelConfig, ModelOptions
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.testing import MODEL_CONFIGS
from bpo_megatron.weights import hf_tensor_shapes

FIXTURE = MODEL_CONFIGS / "tiny_glm4_moe" / "config.json"


def glm_dict(**overrides: Any) -> dict[str, Any]:
    raw = json.loads(FIXTURE.read_text())
    raw.update(overrides)
    return raw


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
    _check_megatron_logits(checkpoint, {}, 1, ref)  # resharded on load (the expert bias too)
    _check_export(checkpoint, tmp_path / "hf", hf_dir, ref, parallel=ParallelConfig(**layout))


def test_pp2_round_trip_without_qk_norm(glm_models, tmp_path) -> None:
    hf_dir, ref = glm_models["no_qk_norm"]
    checkpoint = convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", parallel=ParallelConfig(pp=2),
                                     progress=False, timeout=TIMEOUT)
    _check_megatron_logits(checkpoint, {"pp": 2}, 2, ref)
    _check_export(checkpoint, tmp_path / "hf", hf_dir, ref, parallel=ParallelConfig(pp=2))


def test_engine_weight_updates_by_on_disk_names_reach_every_weight(glm_models, tmp_path) -> None:
    """What a weight sync sends (the on-disk names: per-expert tensors, the shared expert, Q/K/V
    biases, the router's expert bias) lands in the live GLM engine, which then samples exactly as an
    engine started from those weights."""
    from safetensors.torch import load_file

    from bpo_megatron.rollout import GenerationRequest, SamplingParams
    from bpo_megatron.rollout.hf.engine import HFEngine

    other, _ = _save(glm_dict(), tmp_path / "other", seed=23)
    new = load_file(other / "model.safetensors")
    engine = HFEngine(glm_models["qk_norm"][0], capture_routing=True)
    assert engine.update_weights(iter(new.items())) == sum(t.numel() * t.element_size() for t in new.values())
    live = dict(engine.named_hf_weights())
    assert sorted(live) == sorted(new) and all(torch.equal(live[name], tensor) for name, tensor in new.items())
    requests = [GenerationRequest("q", (5, 9, 13), SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1))]
    fresh = HFEngine(other, capture_routing=True)
    for a, b in zip(engine.generate(requests), fresh.generate(requests), strict=True):
        assert torch.equal(a.response_tokens, b.response_tokens) and torch.equal(a.routed_experts, b.routed_experts)


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
def test_the_expert_bias_changes_which_experts_win(glm_models) -> None:
    """The fixture's bias is large enough that routing without it would differ: a trainer that
    dropped it could not reproduce the engine's choice."""
    model = _hf_model(glm_models["qk_norm"][0])
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


def _engine_samples(hf_dir: Path) -> list:
    """Responses the embedded engine samples (temperature 1) with the routing it captured, as train
    samples with advantages of both signs."""
    from bpo_megatron.rollout import GenerationRequest, SamplingParams
    from bpo_megatron.rollout.hf.engine import HFEngine
    from bpo_megatron.trainer.samples import TrainSample

    engine = HFEngine(hf_dir, capture_routing=True)
    generator = torch.Generator().manual_seed(3)
    requests = [GenerationRequest(f"q{i}", tuple(torch.randint(0, 200, (length,), generator=generator).tolist()),
                                  SamplingParams(temperature=1.0, max_new_tokens=9, n=2, seed=40 + i))
                for i, length in enumerate((3, 8, 5))]
    samples = engine.generate(requests)
    engine.shutdown()
    return [TrainSample(tokens=s.tokens, response_start=s.prompt_tokens.numel(), rollout_logprobs=s.rollout_logprobs,
                        advantage=(1.0 if i % 2 == 0 else -0.5) * (1 + i / 10), routed_experts=s.routed_experts)
            for i, s in enumerate(samples)]


def _r3_rank(hf_dir: str, samples: list, layout: dict) -> dict | None:
    """The trainer on the engine's samples: its own free routing (teacher-forced, recorded), then
    log π with the engine's routing replayed, one R3 train step and log π after it."""
    from dataclasses import replace

    from bpo_megatron import testing as th

    hf = HFModelConfig.load(hf_dir)
    actor = th.build_actor(hf, replay=True, weights=hf_dir, params_dtype="fp32", micro_batch_size=2, lr=1e-3,
                           **layout)
    free = actor.compute_logprobs([replace(s, routed_experts=None) for s in samples], record_routing=True)
    replayed = actor.compute_logprobs(samples)
    metrics = actor.train_step(samples)
    after = actor.compute_logprobs(samples)
    bias = [m.expert_bias.clone() for m in actor.model.modules() if getattr(m, "expert_bias", None) is not None]
    actor.close()
    if replayed is None:
        return None
    return {"free_routing": free.routed_experts, "replayed": replayed.logprobs, "metrics": metrics,
            "after": after.logprobs, "bias": bias}


@pytest.fixture(scope="module")
def r3_reference(glm_models):
    from bpo_megatron.parallel.local_world import run_gloo_world

    hf_dir = glm_models["qk_norm"][0]
    samples = _engine_samples(hf_dir)
    (result,) = run_gloo_world(_r3_rank, 1, str(hf_dir), samples, {}, timeout=TIMEOUT)
    return hf_dir, samples, result


def test_the_trainers_router_chooses_what_the_engine_captured(r3_reference) -> None:
    """Teacher-forced, Megatron's sigmoid router with the converted expert bias picks exactly the
    experts the engine captured at every position of every MoE layer; log π equals log μ."""
    _, samples, got = r3_reference
    positions = 0
    for sample, routing in zip(samples, got["free_routing"], strict=True):
        engine = sample.routed_experts.long().sort(dim=-1).values
        assert torch.equal(routing.long().sort(dim=-1).values, engine)
        positions += engine.shape[0]
    assert positions == sum(s.tokens.numel() - 1 for s in samples)
    for sample, logprobs in zip(samples, got["replayed"], strict=True):
        torch.testing.assert_close(logprobs, sample.rollout_logprobs, rtol=0, atol=2e-5)


def test_the_expert_bias_is_not_trained(r3_reference, glm_models) -> None:
    from safetensors.torch import load_file

    hf_dir, _, got = r3_reference
    on_disk = load_file(hf_dir / "model.safetensors")
    want = [on_disk[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] for layer in (1, 2)]
    assert len(got["bias"]) == 2 and all(torch.equal(a, b) for a, b in zip(got["bias"], want))


@pytest.mark.parametrize("layout", [{"tp": 2}, {"ep": 2}, {"tp": 2, "ep": 2}], ids=["tp2", "ep2", "tp2_ep2"])
def test_r3_training_at_tp2_and_ep2_equals_one_rank(r3_reference, layout: dict) -> None:
    from bpo_megatron.parallel.local_world import run_gloo_world

    hf_dir, samples, ref = r3_reference
    results = [r for r in run_gloo_world(_r3_rank, 2, str(hf_dir), samples, layout, timeout=TIMEOUT) if r]
    for got in results:
        for name in ("loss", "grad_norm"):
            assert abs(got["metrics"][name] - ref["metrics"][name]) <= 1e-5 * abs(ref["metrics"][name]), name
        for key in ("replayed", "after"):
            for a, b in zip(got[key], ref[key], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip(got["free_routing"], ref["free_routing"], strict=True):
            assert torch.equal(a.long().sort(dim=-1).values, b.long().sort(dim=-1).values)
    moved = max((a - b).abs().max().item() for a, b in zip(ref["after"], ref["replayed"]))
    assert moved > 1e-3, "the step must change log π for the comparison to cover it"


# ---------------------------------------------------------------------- GLM-4.5-Air recipe
ROOT = Path(__file__).resolve().parents[1]
AIR = ROOT / "configs" / "models" / "glm4_5_air" / "config.json"


def test_glm_4_5_air_parameter_counts_are_transformers_and_the_published_sizes() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from bpo_megatron.models.qwen3 import model_vocab_size
    from bpo_megatron.planner.params import rank_parameters
    from bpo_megatron.weights.names import parameter_counts

    hf = HFModelConfig.load(AIR)
    assert (len(hf.moe_layers), hf.moe_layers[0], hf.rotary_percent, hf.qk_norm) == (45, 1, 0.5, False)
    total, active = parameter_counts(hf)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(AIR.read_text())))
    assert total == sum(p.numel() for p in reference.parameters()) == 106_852_245_504
    # the published "106B total, 12B active" are these counts cut to whole billions, the active one
    # without the two embeddings (106.85 B and 12.18 B)
    embeddings = 2 * hf.vocab_size * hf.hidden_size
    assert int(total // 1e9) == 106 and int((active - embeddings) // 1e9) == 12
    # one rank holding the whole model holds exactly that (151,552 rows are a multiple of 128) ...
    options = ModelOptions(params_dtype="bf16")
    [whole] = rank_parameters(hf, ParallelConfig(), options)
    assert whole.total == total
    # ... and at tp 4 ep 16, per MoE layer: QKV with its bias, the output projection, two norms (no
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
