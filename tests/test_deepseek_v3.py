"""DeepSeek-V3 (``DeepseekV3ForCausalLM``: DeepSeek-V3/R1, Kimi-K2, Moonlight) against transformers' own model.

The tiny random DeepSeek-V3 (``bpo_megatron/testing/configs/tiny_deepseek_v3``) has what the family
adds: multi-head latent attention (a compressed query of ``q_lora_rank`` dims, and in a variant a
plain query projection as Moonlight's; one compressed key/value latent; query/key heads of 32 + 16
RoPE dims, value heads of 24), a dense first layer, a sigmoid router with a non-zero expert bias,
group-limited top-4 of 8 experts (4 groups, the best 2 kept: the limit decides choices), a scale of
2.5 and a shared expert. Conversion must give transformers' logits at fp32 and export every tensor
back bit for bit, at TP=2 / EP=2 and PP=2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from test_glm4_moe import _engine_samples, _r3_rank

from test_convert import (
    TIMEOUT,
    _batch,
    _check_export,
    _check_megatron_logits,
    _hf_model,
    _live_export,
    _safetensors,
    _save,
)

from bpo_megatron.convert import convert_hf_to_mcore
from bpo_megatron.models import HFModelConfig, ModelOptions
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.testing import MODEL_CONFIGS
from bpo_megatron.testing.models import write_config
from bpo_megatron.weights import hf_tensor_shapes

FIXTURE = MODEL_CONFIGS / "tiny_deepseek_v3" / "config.json"
# YaRN as DeepSeek-V3 configures it, at the tiny model's scale; mscale ≠ mscale_all_dim so that both
# the factor on cos and sin and the softmax scale's mscale² differ from 1
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.8}


def deepseek_dict(**overrides: Any) -> dict[str, Any]:
    raw = json.loads(FIXTURE.read_text())
    raw.update(overrides)
    return raw


@pytest.fixture(scope="module")
def deepseek_models(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    return {"q_lora": _save(deepseek_dict(), tmp_path_factory.mktemp("ds_q_lora"), seed=31),
            "plain_q": _save(deepseek_dict(q_lora_rank=None, num_hidden_layers=4),
                              tmp_path_factory.mktemp("ds_plain_q"), seed=32),
            "yarn": _save(deepseek_dict(rope_scaling=YARN), tmp_path_factory.mktemp("ds_yarn"), seed=33)}


# ------------------------------------------------------------------------------------ config
def test_config_maps_onto_the_family_neutral_description() -> None:
    hf = HFModelConfig.load(FIXTURE)
    assert hf.architecture == "DeepseekV3ForCausalLM" and hf.moe_layers == (1, 2)
    assert (hf.num_experts, hf.num_experts_per_tok, hf.n_group, hf.topk_group) == (8, 4, 4, 2)
    assert hf.shared_expert_intermediate_size == 32 and hf.first_k_dense_replace == 1
    assert (hf.router_score, hf.router_expert_bias, hf.routed_scaling_factor) == ("sigmoid", True, 2.5)
    assert hf.multi_latent_attention and not hf.qk_norm and hf.rotary_percent == 1.0
    assert (hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.head_dim, hf.v_head_dim) == (32, 32, 32, 16, 24)
    assert (hf.query_key_head_dim, hf.value_head_dim) == (48, 24)
    assert HFModelConfig.load(deepseek_dict(q_lora_rank=None)).q_lora_rank is None
    bare = HFModelConfig(**{f: getattr(hf, f) for f in hf.__dataclass_fields__ if f != "source"})
    assert HFModelConfig.load(bare.to_hf_dict()) == hf


@pytest.mark.parametrize("overrides, field", [
    ({"rope_interleave": False}, "rope_interleave"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "rope_scaling"),
    ({"rope_scaling": {**YARN, "attention_factor": 1.2}}, "attention_factor"),
    ({"rope_scaling": {**YARN, "mscale": None}}, "mscale_all_dim"),
    ({"rope_scaling": {**YARN, "truncate": False}}, "truncate"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "original_max_position_embeddings"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"attention_bias": True}, "attention_bias"),
    ({"kv_lora_rank": 0}, "kv_lora_rank"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"n_group": 4, "topk_group": 1}, "num_experts_per_tok = 2 x topk_group"),
], ids=["interleave", "linear_rope", "yarn_attention_factor", "yarn_mscale", "yarn_truncate", "yarn_original",
        "scoring", "topk_method", "bias", "no_latent", "norm_topk_prob", "group_ratio"])
def test_configs_megatron_cannot_reproduce_are_refused(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match="config.json") as info:
        HFModelConfig.load(deepseek_dict(**overrides))
    assert field in str(info.value)
    for name in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        raw = deepseek_dict()
        del raw[name]  # transformers' defaults are DeepSeek-V3's sizes, never this checkpoint's
        with pytest.raises(ValueError, match=f"required field '{name}'"):
            HFModelConfig.load(raw)


def test_transformer_config_maps_latent_attention() -> None:
    from bpo_megatron.models import transformer_config

    config = transformer_config(HFModelConfig.load(FIXTURE), ParallelConfig(), ModelOptions(params_dtype="fp32"))
    assert config.multi_latent_attention and config.qk_layernorm  # the latent norms
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim) == (32, 32, 32, 16, 24)
    assert config.rope_type == "rope" and config.rotary_base == 10000.0
    assert config.moe_layer_freq == [0, 1, 1] and config.moe_shared_expert_intermediate_size == 32
    assert (config.moe_router_num_groups, config.moe_router_group_topk, config.moe_router_topk) == (4, 2, 4)
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 0.0
    assert config.moe_router_topk_scaling_factor == 2.5


# ---------------------------------------------------------------------- latent core attention
def _reference_attention(query, key, value, bounds, scale):
    """Plain autograd: causal softmax attention within each segment, ``[t, heads, d]`` in, ``[t, heads × v]`` out."""
    outs = []
    for start, end in zip(bounds, bounds[1:]):
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))  # [heads, n, d]
        scores = (q @ k.transpose(1, 2)) * scale
        causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        outs.append((probs @ v).transpose(0, 1).flatten(1))
    return torch.cat(outs)


def _latent_core_attention_results() -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from bpo_megatron.models.latent_attention import LatentDotProductAttention, LatentFusedDotProductAttention
    from bpo_megatron.parallel.state import initialize_parallel

    initialize_parallel(ParallelConfig(), seed=0)
    gen = torch.Generator().manual_seed(0)
    heads, qk_dim, v_dim, scale = 4, 48, 24, 0.21
    bounds = [0, 5, 6, 13, 16]
    cu = torch.tensor(bounds, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    config = MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, kv_channels=qk_dim,
                                  use_cpu_initialization=True, attention_dropout=0.0, q_lora_rank=None,
                                  kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=v_dim,
                                  rope_type="rope")
    query, key = (torch.randn(16, heads, qk_dim, generator=gen) for _ in range(2))
    value = torch.randn(16, heads, v_dim, generator=gen)
    upstream = torch.randn(16, heads * v_dim, generator=gen)
    results = {}
    for cls in (LatentDotProductAttention, LatentFusedDotProductAttention):
        module = cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                     softmax_scale=scale, k_channels=qk_dim, v_channels=v_dim)
        for case in ("padded", "packed"):
            inputs = [t.clone().requires_grad_() for t in (query, key, value)]
            if case == "packed":
                out = module(*inputs, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
                out = out.squeeze(1)
            else:  # one sample per batch column: the first 7 positions twice, [s, b, heads, d]
                out = module(*(torch.stack([t[:7], t[:7]], dim=1) for t in inputs), None,
                             attn_mask_type=AttnMaskType.causal)
                out = out[:, 0] + out[:, 1]  # two copies of the one sample
            (out * upstream[:out.shape[0]]).sum().backward()
            results[(cls.__name__, case)] = (out.detach(), [t.grad for t in inputs])
    return {"results": results, "inputs": (query, key, value, upstream), "bounds": bounds, "scale": scale}


def test_latent_core_attention_equals_plain_autograd() -> None:
    """MLA's core attention on the local spec, the reference and the fused one, padded and packed:
    query/key heads of 48 dims, value heads of 24, a given softmax scale; outputs ``[.., heads × 24]`` and
    the gradients of query, key and value equal plain autograd's causal attention per sample."""
    from bpo_megatron.parallel.local_world import run_gloo_world

    (got,) = run_gloo_world(_latent_core_attention_results, 1, timeout=TIMEOUT)
    query, key, value, upstream = got["inputs"]
    for (name, case), (out, grads) in got["results"].items():
        bounds = got["bounds"] if case == "packed" else [0, 7]
        inputs = [t[:bounds[-1]].clone().requires_grad_() for t in (query, key, value)]
        want = _reference_attention(*inputs, bounds, got["scale"])
        weight = 2 if case == "padded" else 1  # the padded case ran the sample twice
        (want * weight * upstream[:want.shape[0]]).sum().backward()
        torch.testing.assert_close(out, want * weight, rtol=1e-5, atol=1e-5, msg=f"{name} {case}")
        for grad, ref in zip(grads, inputs, strict=True):
            torch.testing.assert_close(grad[:bounds[-1]], ref.grad, rtol=1e-5, atol=1e-5, msg=f"{name} {case}")


# -------------------------------------------------------------------------------- conversion
@pytest.mark.parametrize("name", ["q_lora", "plain_q", "yarn"])
def test_expected_names_and_shapes_are_what_transformers_writes(deepseek_models, name: str) -> None:
    directory, _ = deepseek_models[name]
    written = {n: tuple(t.shape) for n, t in _safetensors(directory).items()}
    assert hf_tensor_shapes(HFModelConfig.load(directory)) == written


def test_tp2_ep2_round_trip_gives_transformers_logits(deepseek_models, tmp_path) -> None:
    hf_dir, ref = deepseek_models["q_lora"]
    layout = {"tp": 2, "ep": 2}
    checkpoint = convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", parallel=ParallelConfig(**layout),
                                     progress=False, timeout=TIMEOUT)
    _check_megatron_logits(checkpoint, layout, 2, ref)
    _check_megatron_logits(checkpoint, {}, 1, ref)  # resharded on load
    _check_export(checkpoint, tmp_path / "hf", hf_dir, ref, parallel=ParallelConfig(**layout))


def test_pp2_tp2_round_trip_with_a_plain_query_projection(deepseek_models, tmp_path) -> None:
    hf_dir, ref = deepseek_models["plain_q"]
    checkpoint = convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", parallel=ParallelConfig(pp=2),
                                     progress=False, timeout=TIMEOUT)
    _check_megatron_logits(checkpoint, {"pp": 2}, 2, ref)
    _check_megatron_logits(checkpoint, {"tp": 2}, 2, ref)
    _check_export(checkpoint, tmp_path / "hf", hf_dir, ref, parallel=ParallelConfig(pp=2))


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_a_checkpoint_with_more_experts_than_its_config_is_refused_naming_them(family, tmp_path) -> None:
    """A DeepSeek-V3 or GLM-4.5 checkpoint whose weights hold 10 experts per MoE layer (the routers' 8 rows) under a
    config.json that counts 8 (and, in another, experts in the layer the config makes dense) is
    refused by the conversion before anything is written, and by a run's preflight, naming each
    layer's extra experts; a multi-token-prediction layer's experts (past num_hidden_layers) are
    not the main model's and are not counted."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from bpo_megatron.loop.preflight import check_pretrained_weights
    from bpo_megatron.loop.run_dir import RunRefused
    from bpo_megatron.testing.models import deepseek_v3_config, glm4_moe_config
    from bpo_megatron.weights.names import unexpected_experts

    make = {"deepseek_v3": deepseek_v3_config, "glm4_moe": glm4_moe_config}[family]
    counted = HFModelConfig.load(make())
    assert counted.num_experts == 8 and counted.moe_layers == (1, 2)
    generator = torch.Generator().manual_seed(3)
    # the config's tensors (the routers' 8 rows included), and experts 8-9 of each MoE layer beside them
    shapes = hf_tensor_shapes(counted)
    shapes |= {name.replace(".experts.7.", f".experts.{e}."): shape for name, shape in shapes.items()
               if ".mlp.experts.7." in name for e in (8, 9)}
    tensors = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    write_config(make(), hf_dir)
    with pytest.raises(ValueError) as refused:
        convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", progress=False, timeout=TIMEOUT)
    message = str(refused.value)
    assert (f"the Hugging Face checkpoint in {hf_dir} holds experts its config.json does not count (num_experts, "
            "n_routed_experts in DeepSeek-V3 and GLM-4.5 configs, is 8: ids 0-7 in its MoE layers): layer 1: experts "
            "8-9; layer 2: experts 8-9. They would be left out") in message
    assert message.endswith("use the config.json saved with these weights")
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(RunRefused, match=f"model.path={hf_dir}: the Hugging Face checkpoint .* layer 1: experts 8-9"):
        check_pretrained_weights(SimpleNamespace(model=SimpleNamespace(path=str(hf_dir))), counted)
    # experts in the dense first layer, and a multi-token-prediction layer's, by name
    names = ["model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.experts.7.up_proj.weight",
             "model.layers.3.mlp.experts.7.up_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"]
    assert unexpected_experts(names, counted) == {0: [3]}


# ------------------------------------------------------------------------- routing and R3
def test_the_expert_bias_and_the_group_limit_change_which_experts_win(deepseek_models) -> None:
    """The fixture routes so that both matter: without the bias, or without the group limit, the
    router would choose differently for many tokens (a trainer that dropped either could not
    reproduce the engine's choice); with both, each token's 4 experts lie in 2 of the 4 groups."""
    model = _hf_model(deepseek_models["q_lora"][0])
    tokens = _batch(model.config.vocab_size)
    hidden = model.model.embed_tokens(tokens).view(-1, model.config.hidden_size)
    changed = {"bias": 0.0, "groups": 0.0}
    with torch.no_grad():
        for layer in (1, 2):
            gate = model.model.layers[layer].mlp.gate
            chosen = gate(hidden)[2].sort(dim=-1).values
            assert ((chosen // 2)[:, :, None] == (chosen // 2)[:, None, :]).sum(-1).min() >= 1
            assert all(len(set(row.tolist())) <= 2 for row in chosen // 2)
            bias = gate.e_score_correction_bias.clone()
            gate.e_score_correction_bias.zero_()
            unbiased = gate(hidden)[2].sort(dim=-1).values
            gate.e_score_correction_bias.copy_(bias)
            gate.n_group = gate.topk_group = 1
            ungrouped = gate(hidden)[2].sort(dim=-1).values
            gate.n_group, gate.topk_group = 4, 2
            changed["bias"] = max(changed["bias"], (chosen != unbiased).any(-1).float().mean().item())
            changed["groups"] = max(changed["groups"], (chosen != ungrouped).any(-1).float().mean().item())
    assert min(changed.values()) > 0.2, changed


@pytest.fixture(scope="module")
def r3_reference(deepseek_models):
    from bpo_megatron.parallel.local_world import run_gloo_world

    hf_dir = deepseek_models["q_lora"][0]
    samples = _engine_samples(hf_dir)
    (result,) = run_gloo_world(_r3_rank, 1, str(hf_dir), samples, {}, timeout=TIMEOUT)
    return hf_dir, samples, result


def test_the_trainers_router_chooses_what_the_engine_captured(r3_reference) -> None:
    """Teacher-forced, Megatron's group-limited sigmoid router with the converted expert bias picks
    exactly the experts the embedded engine captured at every position of every MoE layer (100%);
    the trainer's log π with the engine's routing replayed equals the engine's log μ."""
    _, samples, got = r3_reference
    positions = 0
    for sample, routing in zip(samples, got["free_routing"], strict=True):
        engine = sample.routed_experts.long().sort(dim=-1).values
        assert torch.equal(routing.long().sort(dim=-1).values, engine)
        positions += engine.shape[0]
    assert positions == sum(s.tokens.numel() - 1 for s in samples)
    for sample, logprobs in zip(samples, got["replayed"], strict=True):
        torch.testing.assert_close(logprobs, sample.rollout_logprobs, rtol=0, atol=2e-5)


@pytest.mark.parametrize("layout", [{"tp": 2}, {"ep": 2}, {"tp": 2, "ep": 2}, {"tp": 2, "ep": 2, "recompute": "full"}],
                         ids=["tp2", "ep2", "tp2_ep2", "tp2_ep2_recompute"])
def test_r3_training_at_tp2_and_ep2_equals_one_rank(r3_reference, layout: dict) -> None:
    """Also under full recompute (the recipe's), where the replayed routing is used again in backward."""
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
        assert all(torch.equal(a, b) for a, b in zip(got["bias"], ref["bias"], strict=True))  # never trained
    moved = max((a - b).abs().max().item() for a, b in zip(ref["after"], ref["replayed"]))
    assert moved > 1e-3, "the step must change log π for the comparison to cover it"


# ------------------------------------------------------------------------------- planner
def _rank_parameter_count(config: str, layout: dict) -> int:
    from bpo_megatron.models.qwen3 import build_gpt_model
    from bpo_megatron.parallel.state import initialize_parallel

    parallel = ParallelConfig(**layout)
    initialize_parallel(parallel, seed=0)
    model = build_gpt_model(HFModelConfig.load(config), parallel, ModelOptions(params_dtype="fp32"))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None}], ids=["q_lora", "plain_q"])
def test_planner_counts_the_parameters_megatron_builds(overrides: dict, tmp_path) -> None:
    """Per rank at TP=2 with EP=2: the planner's count of the latent attention (down projections whole on
    every rank, up and output projections split by heads) is the built model's."""
    from bpo_megatron.parallel.local_world import run_gloo_world
    from bpo_megatron.planner.params import rank_parameters

    write_config(deepseek_dict(**overrides), tmp_path)
    hf = HFModelConfig.load(tmp_path)
    layout = {"tp": 2, "ep": 2}
    counts = run_gloo_world(_rank_parameter_count, 2, str(tmp_path), layout, timeout=TIMEOUT)
    [stage] = rank_parameters(hf, ParallelConfig(**layout), ModelOptions(params_dtype="fp32"))
    assert counts == [stage.total, stage.total]


MOONLIGHT = Path(__file__).resolve().parents[1] / "configs" / "models" / "moonlight_16b_a3b" / "config.json"


def test_moonlight_parameter_counts_and_kv_cache_are_transformers_and_the_latent_sizes() -> None:
    """Moonlight-16B-A3B (the recipe's model): the planner's parameters are transformers' own count
    (15.96 B, "16B"; 2.91 B active with the embeddings, "A3B"), and an engine's KV cache per token is the
    latent and the shared rotated key of every layer, whole on every TP rank."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bpo_megatron.planner.params import rank_parameters
    from bpo_megatron.planner.rollout import kv_bytes_per_token
    from bpo_megatron.weights.names import parameter_counts

    hf = HFModelConfig.load(MOONLIGHT)
    assert (hf.q_lora_rank, hf.kv_lora_rank, hf.routed_scaling_factor, hf.n_group) == (None, 512, 2.446, 1)
    total, active = parameter_counts(hf)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(MOONLIGHT.read_text())))
    assert total == sum(p.numel() for p in reference.parameters()) == 15_960_108_544
    assert active == 2_914_774_528
    [whole] = rank_parameters(hf, ParallelConfig(), ModelOptions(params_dtype="bf16"))
    assert whole.total == total
    assert kv_bytes_per_token(hf, tp=1, dtype_bytes=2) == kv_bytes_per_token(hf, tp=4, dtype_bytes=2) \
        == 27 * (512 + 64) * 2


MOONLIGHT_RECIPE = Path(__file__).resolve().parents[1] / "configs" / "moonlight_16b_a3b_bpo.yaml"


def _packed_r3_rank(hf_dir: str, samples: list, layout: dict) -> dict | None:
    """One R3 train step on packed micro-batches (the thd format: latent attention per segment)."""
    from bpo_megatron import testing as th

    actor = th.build_actor(HFModelConfig.load(hf_dir), replay=True, weights=hf_dir, params_dtype="fp32",
                           micro_batch_size=2, lr=1e-3, max_tokens_per_micro_batch=64, **layout)
    replayed = actor.compute_logprobs(samples)
    metrics = actor.train_step(samples)
    after = actor.compute_logprobs(samples)
    actor.close()
    return None if replayed is None else {"replayed": replayed.logprobs, "metrics": metrics, "after": after.logprobs}


@pytest.mark.parametrize("layout", [{}, {"tp": 2}, {"tp": 2, "model_options": {"attention": "fused"}}],
                         ids=["tp1", "tp2", "tp2_fused"])
def test_packed_micro_batches_train_as_padded_ones(r3_reference, layout: dict) -> None:
    """Samples packed into rows of up to 64 tokens (latent attention and its RoPE per segment; the
    reference core attention, and the fused one) give the padded run's log π, loss, grad norm and log π
    after the step."""
    from bpo_megatron.parallel.local_world import run_gloo_world

    hf_dir, samples, ref = r3_reference
    world = 2 if layout else 1
    results = [r for r in run_gloo_world(_packed_r3_rank, world, str(hf_dir), samples, layout, timeout=TIMEOUT) if r]
    assert results
    for got in results:
        for name in ("loss", "grad_norm"):
            assert abs(got["metrics"][name] - ref["metrics"][name]) <= 1e-5 * abs(ref["metrics"][name]), name
        for key in ("replayed", "after"):
            for a, b in zip(got[key], ref[key], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_sglangs_routing_rows_become_the_routing_the_trainer_replays(r3_reference) -> None:
    """SGLang's response format (int32 rows over every layer, zeros for the dense first layer) of the
    engine's captured routing decodes to exactly the MoE-layer routing the R3 tests replay."""
    from bpo_megatron.models.routing import RoutingLayout

    hf_dir, samples, _ = r3_reference
    layout = RoutingLayout.of(HFModelConfig.load(hf_dir))
    assert (layout.moe_layers, layout.num_hidden_layers, layout.topk, layout.num_experts) == ((1, 2), 3, 4, 8)
    for sample in samples:
        rows = torch.zeros(sample.routed_experts.shape[0], 3, 4, dtype=torch.int32)
        rows[:, 1:] = sample.routed_experts.to(torch.int32)
        decoded = layout.decode_int32(rows.numpy().astype("<i4").tobytes())
        assert torch.equal(decoded.long(), sample.routed_experts.long())



# -------------------------------------------------------------------------------- YaRN RoPE
def test_yarn_maps_onto_megatrons_yarn() -> None:
    from bpo_megatron.models import transformer_config
    from bpo_megatron.models.hf_config import YarnScaling

    hf = HFModelConfig.load(deepseek_dict(rope_scaling=YARN))
    assert hf.yarn == YarnScaling(factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.8)
    # transformers 5's spelling, and mscale without mscale_all_dim (the factor alone scales cos and sin)
    spelled_5 = deepseek_dict(rope_scaling=None, rope_parameters={**YARN, "rope_type": "yarn", "rope_theta": 10000.0})
    del spelled_5["rope_theta"]
    assert HFModelConfig.load(spelled_5).yarn == hf.yarn
    assert HFModelConfig.load(deepseek_dict(rope_scaling={**YARN, "mscale_all_dim": 0})).yarn.mscale_all_dim == 0.0
    bare = HFModelConfig(**{f: getattr(hf, f) for f in hf.__dataclass_fields__ if f != "source"})
    assert HFModelConfig.load(bare.to_hf_dict()) == hf
    config = transformer_config(hf, ParallelConfig(), ModelOptions(params_dtype="fp32"))
    assert (config.rope_type, config.rotary_scaling_factor, config.original_max_position_embeddings) == ("yarn", 4.0, 32)
    assert (config.mscale, config.mscale_all_dim, config.beta_fast, config.beta_slow) == (1.0, 0.8, 32.0, 1.0)
    with pytest.raises(ValueError, match="rope_scaling=.* is not supported for glm4_moe"):
        from test_glm4_moe import glm_dict
        HFModelConfig.load(glm_dict(rope_scaling=YARN))


def test_yarn_conversion_gives_transformers_logits(deepseek_models, tmp_path) -> None:
    hf_dir, ref = deepseek_models["yarn"]
    checkpoint = convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", parallel=ParallelConfig(tp=2),
                                     progress=False, timeout=TIMEOUT)
    _check_megatron_logits(checkpoint, {"tp": 2}, 2, ref)
    _check_export(checkpoint, tmp_path / "hf", hf_dir, ref, parallel=ParallelConfig(tp=2))


def test_yarn_engine_and_trainer_agree(deepseek_models) -> None:
    """With YaRN, the embedded engine's log μ and routing are a teacher-forced transformers pass's, and
    the trainer's router picks the captured experts with log π equal to log μ."""
    from bpo_megatron.parallel.local_world import run_gloo_world
    from bpo_megatron.testing.recompute import teacher_forced

    hf_dir = deepseek_models["yarn"][0]
    samples = _engine_samples(hf_dir)
    model = _hf_model(hf_dir)
    for sample in samples:
        logprobs, routing = teacher_forced(model, sample.tokens, temperature=1.0)
        want = logprobs[sample.response_start - 1:].gather(1, sample.tokens[sample.response_start:, None])[:, 0]
        torch.testing.assert_close(sample.rollout_logprobs, want, rtol=0, atol=2e-5)
        assert torch.equal(sample.routed_experts.long(), routing.long())
    (got,) = run_gloo_world(_r3_rank, 1, str(hf_dir), samples, {}, timeout=TIMEOUT)
    for sample, routing, logprobs in zip(samples, got["free_routing"], got["replayed"], strict=True):
        assert torch.equal(routing.long().sort(dim=-1).values, sample.routed_experts.long().sort(dim=-1).values)
        torch.testing.assert_close(logprobs, sample.rollout_logprobs, rtol=0, atol=2e-5)


def test_engine_weight_updates_by_on_disk_names_reach_every_weight(deepseek_models, tmp_path) -> None:
    """What a weight sync sends (the on-disk names: the latent attention's projections and norms,
    per-expert tensors, the shared expert, the router's expert bias) lands in the live DeepSeek-V3 engine,
    which then samples exactly as an engine started from those weights."""
    from safetensors.torch import load_file

    from bpo_megatron.rollout import GenerationRequest, SamplingParams
    from bpo_megatron.rollout.hf.engine import HFEngine

    other, _ = _save(deepseek_dict(), tmp_path / "other", seed=34)
    new = load_file(other / "model.safetensors")
    assert "model.layers.0.self_attn.kv_b_proj.weight" in new
    engine = HFEngine(deepseek_models["q_lora"][0], capture_routing=True)
    assert engine.update_weights(iter(new.items())) == sum(t.numel() * t.element_size() for t in new.values())
    live = dict(engine.named_hf_weights())
    assert sorted(live) == sorted(new) and all(torch.equal(live[name], tensor) for name, tensor in new.items())
    requests = [GenerationRequest("q", (5, 9, 13), SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1))]
    fresh = HFEngine(other, capture_routing=True)
    for a, b in zip(engine.generate(requests), fresh.generate(requests), strict=True):
        assert torch.equal(a.response_tokens, b.response_tokens) and torch.equal(a.routed_experts, b.routed_experts)



def test_weight_sync_streams_every_hf_tensor_from_a_tp2_ep2_trainer(deepseek_models) -> None:
    """The trainer's weight export (what a weight sync sends) at TP=2 with EP=2 yields every on-disk
    tensor of the checkpoint once, bit for bit, on every rank (the latent projections whole: the down
    projections from any rank, the up and output projections gathered over TP)."""
    from bpo_megatron.parallel.local_world import run_gloo_world

    hf_dir, _ = deepseek_models["q_lora"]
    ranks = run_gloo_world(_live_export, 2, str(hf_dir), {"tp": 2, "ep": 2}, True, timeout=TIMEOUT)
    original = _safetensors(hf_dir)
    for rank in ranks:
        assert sorted(rank["names"]) == sorted(original)
        assert all(torch.equal(tensor, original[name]) for name, tensor in rank["tensors"].items())
        # a layer's latent down projections come one after the other (a load group: SGLang fuses them
        # only when one load call brings both, tests/test_weight_load_groups.py)
        for layer in range(HFModelConfig.load(hf_dir).num_hidden_layers):
            q_a = rank["names"].index(f"model.layers.{layer}.self_attn.q_a_proj.weight")
            assert rank["names"][q_a + 1] == f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"



@pytest.mark.parametrize("override, refusal", [
    ("rollout.sglang.quantization=fp8", "rollout.sglang.quantization=fp8 is not supported for DeepseekV3ForCausalLM"),
    ("parallel.cp=2", "parallel.cp=2 is not supported for DeepseekV3ForCausalLM"),
])
def test_fp8_serving_and_context_parallelism_are_refused_for_latent_attention(override, refusal, capsys) -> None:
    from bpo_megatron.cli import main

    code = main(["train", str(MOONLIGHT_RECIPE), override, "--check"])
    assert code != 0
    assert refusal in capsys.readouterr().err


def test_the_balancers_cost_counts_latent_attentions_products_per_query_key_pair() -> None:
    """The scores take the query/key head dims (32 + 16), the weighted values the value head dims (24): per
    query-key pair 4 heads · 72 products per layer, against the active matrix weights per token."""
    from bpo_megatron.trainer.balance import CostModel
    from bpo_megatron.weights.names import parameter_counts

    hf = HFModelConfig.load(FIXTURE)
    _, active = parameter_counts(hf)
    assert CostModel.of(hf).attention_span == pytest.approx((active - 200 * 64) / (4 * (48 + 24) * 3), rel=1e-12)


def test_latent_attention_is_refused_up_front_where_megatron_core_does_not_build_it(monkeypatch, capsys) -> None:
    """megatron-core 0.19's MLA does not build on the local spec: refused at the config check,
    naming the version, before any model (this CI's newest-megatron leg would otherwise fail at
    the build)."""
    from bpo_megatron.cli import main
    from bpo_megatron.megatron import compat

    monkeypatch.setattr(compat, "megatron_minor", lambda: 19)
    monkeypatch.setattr(compat, "megatron_version", lambda: "0.19.2")
    assert main(["train", str(MOONLIGHT_RECIPE), "--check"]) == 2
    assert ("DeepseekV3ForCausalLM (multi-head latent attention) is built with megatron-core 0.16 only; "
            "megatron-core 0.19.2 is installed") in capsys.readouterr().err
