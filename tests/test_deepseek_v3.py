"""What only DeepSeek-V3 (``DeepseekV3ForCausalLM``: DeepSeek-V3/R1, Kimi-K2, Moonlight) has, against
transformers' own model.

The family's contract (its tiny config onto the description and Megatron's latent-attention config,
conversion at TP=2/EP=2, PP=2 with a plain query projection as Moonlight's and TP=2 with YaRN, the
engine's weight updates, the trainer's group-limited router against the engine's capture, R3 at
TP=2/EP=2 also under full recompute, the weight sync, the planner, the recipe's count and ``train
--check``) is ``tests/test_model_families.py``. Here: the refusals, multi-head latent attention's core
attention, the multi-token-prediction layers, experts a config does not count, the expert bias and
the group limit deciding choices, packed micro-batches, SGLang's routing rows, YaRN, Moonlight's sizes
and what a run refuses up front for latent attention.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from family_kit import ROOT, TIMEOUT, YARN, assert_same_step, engine_samples, r3_rank, tiny_config_path, tiny_dict

from test_convert import _batch, _check_export, _check_megatron_logits, _hf_model

from bpo_megatron.convert import convert_hf_to_mcore
from bpo_megatron.models import HFModelConfig, ModelOptions
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.testing.models import write_config
from bpo_megatron.weights import hf_tensor_shapes

FIXTURE = tiny_config_path("deepseek_v3")


def deepseek_dict(**overrides: Any) -> dict[str, Any]:
    return tiny_dict("deepseek_v3", **overrides)


# ------------------------------------------------------------------------------------ config
def test_a_null_q_lora_rank_is_a_plain_query_projection() -> None:
    assert HFModelConfig.load(deepseek_dict(q_lora_rank=None)).q_lora_rank is None
    assert HFModelConfig.load(deepseek_dict()).q_lora_rank == 32


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
def test_the_expert_bias_and_the_group_limit_change_which_experts_win(family_models) -> None:
    """The fixture routes so that both matter: without the bias, or without the group limit, the
    router would choose differently for many tokens (a trainer that dropped either could not
    reproduce the engine's choice); with both, each token's 4 experts lie in 2 of the 4 groups."""
    model = _hf_model(family_models.checkpoint("deepseek_v3")[0])
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


MOONLIGHT = ROOT / "configs" / "models" / "moonlight_16b_a3b" / "config.json"


def test_moonlight_active_parameters_and_kv_cache_are_the_latent_sizes() -> None:
    """Moonlight-16B-A3B (the recipe's model; its total against transformers' own count, 15.96 B, "16B",
    is the contract's): 2.91 B active with the embeddings, "A3B", and an engine's KV cache per token is
    the latent and the shared rotated key of every layer, whole on every TP rank."""
    from bpo_megatron.planner.rollout import kv_bytes_per_token
    from bpo_megatron.weights.names import parameter_counts

    hf = HFModelConfig.load(MOONLIGHT)
    assert (hf.q_lora_rank, hf.kv_lora_rank, hf.routed_scaling_factor, hf.n_group) == (None, 512, 2.446, 1)
    _, active = parameter_counts(hf)
    assert active == 2_914_774_528
    assert kv_bytes_per_token(hf, tp=1, dtype_bytes=2) == kv_bytes_per_token(hf, tp=4, dtype_bytes=2) \
        == 27 * (512 + 64) * 2


MOONLIGHT_RECIPE = ROOT / "configs" / "moonlight_16b_a3b_bpo.yaml"


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
def test_packed_micro_batches_train_as_padded_ones(family_models, layout: dict) -> None:
    """Samples packed into rows of up to 64 tokens (latent attention and its RoPE per segment; the
    reference core attention, and the fused one) give the padded run's log π, loss, grad norm and log π
    after the step."""
    from bpo_megatron.parallel.local_world import run_gloo_world

    hf_dir, samples, ref = family_models.r3_reference("deepseek_v3")
    world = 2 if layout else 1
    results = [r for r in run_gloo_world(_packed_r3_rank, world, str(hf_dir), samples, layout, timeout=TIMEOUT) if r]
    assert results
    for got in results:
        assert_same_step(got, ref)


def test_sglangs_routing_rows_become_the_routing_the_trainer_replays(family_models) -> None:
    """SGLang's response format (int32 rows over every layer, zeros for the dense first layer) of the
    engine's captured routing decodes to exactly the MoE-layer routing the R3 tests replay."""
    from bpo_megatron.models.routing import RoutingLayout

    hf_dir, samples, _ = family_models.r3_reference("deepseek_v3")
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
        HFModelConfig.load(tiny_dict("glm4_moe", rope_scaling=YARN))


def test_yarn_engine_and_trainer_agree(family_models) -> None:
    """With YaRN, the embedded engine's log μ and routing are a teacher-forced transformers pass's, and
    the trainer's router picks the captured experts with log π equal to log μ."""
    from bpo_megatron.parallel.local_world import run_gloo_world
    from bpo_megatron.testing.recompute import teacher_forced

    hf_dir = family_models.checkpoint("deepseek_v3", "yarn")[0]
    samples = engine_samples(hf_dir)
    model = _hf_model(hf_dir)
    for sample in samples:
        logprobs, routing = teacher_forced(model, sample.tokens, temperature=1.0)
        want = logprobs[sample.response_start - 1:].gather(1, sample.tokens[sample.response_start:, None])[:, 0]
        torch.testing.assert_close(sample.rollout_logprobs, want, rtol=0, atol=2e-5)
        assert torch.equal(sample.routed_experts.long(), routing.long())
    (got,) = run_gloo_world(r3_rank, 1, str(hf_dir), samples, {}, timeout=TIMEOUT)
    for sample, routing, logprobs in zip(samples, got["free_routing"], got["replayed"], strict=True):
        assert torch.equal(routing.long().sort(dim=-1).values, sample.routed_experts.long().sort(dim=-1).values)
        torch.testing.assert_close(logprobs, sample.rollout_logprobs, rtol=0, atol=2e-5)


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
