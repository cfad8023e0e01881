"""The planner's activation terms (``bpo_megatron/planner/activations.py``) against what autograd
actually saves: one forward of the train actor's model (the local spec, fused attention, fp32, on
CPU) measured by ``bpo_megatron.testing.activations`` at two lengths and three layer counts, which
separates the per-token bytes of a MoE layer and of a dense layer, the per-layer constant (the
grouped experts' int32 group offsets) and the model's ends. Three shapes: grouped-query attention
(4 query heads on 2 KV heads: the query is copied out of the fused QKV output) with top-2 of 8
experts; multi-query attention (one KV head: the query is a view) with top-3 of 6 experts at another
width; and the first at TP=2 with sequence parallelism (expert TP 2). Also with full recompute,
which keeps each layer's input and the rotary angles; GLM-4.5's shape (Q/K/V biases, no
QK-norm, RoPE over half of each head, a shared expert, sigmoid routing, the first layer dense); and
DeepSeek-V3's (multi-head latent attention with and without a compressed query, group-limited routing). Every term equals the planner's for a CPU
(``gpu=False``: torch's composite RMSNorm) within 1%; the GPU's terms differ from them by the
composite norms' ``x·rstd`` alone, a closed form."""

from __future__ import annotations

import pytest

from bpo_megatron.models import HFModelConfig
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.planner.activations import (checkpoint_bytes_per_token, ends_bytes_per_token, layer_bytes_per_token,
                                              layer_constant_bytes)
from bpo_megatron.testing.models import moe_config

REL = 0.01  # the planner's terms against the measurement (they agree to the byte: any gap is a new saved tensor)
FP32 = 4
GQA = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
           head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, max_position_embeddings=1024)
MQA = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=1,
           head_dim=32, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48, max_position_embeddings=1024)
GLM = dict(GQA, use_qk_norm=False)  # the tiny GLM's biases, half-head RoPE, shared expert and sigmoid router
# the tiny DeepSeek-V3's latent attention (query/key heads of 32 + 16, values of 24) at other sizes, its
# group-limited sigmoid router and shared expert
DEEPSEEK = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                num_experts=8, num_experts_per_tok=4, moe_intermediate_size=64, max_position_embeddings=1024,
                q_lora_rank=48, kv_lora_rank=32)
# name -> (sizes, tp, recompute, model type); a world of 2 ranks runs them all (tp 1: two data-parallel replicas)
CASES = {
    "gqa_top2": (GQA, 1, "none", "qwen3_moe"),
    "mqa_top3": (MQA, 1, "none", "qwen3_moe"),
    "gqa_top2_tp2_sp": (GQA, 2, "none", "qwen3_moe"),
    "gqa_top2_recompute": (GQA, 1, "full", "qwen3_moe"),
    "gqa_top2_tp2_sp_recompute": (GQA, 2, "full", "qwen3_moe"),
    "glm_top2": (GLM, 1, "none", "glm4_moe"),
    "glm_top2_tp2_sp": (GLM, 2, "none", "glm4_moe"),
    "deepseek_top4_tp2_sp": (DEEPSEEK, 2, "none", "deepseek_v3"),
    "deepseek_plain_query": (dict(DEEPSEEK, q_lora_rank=None, qk_rope_head_dim=8), 1, "none", "deepseek_v3"),
    "deepseek_top4_tp2_sp_recompute": (DEEPSEEK, 2, "full", "deepseek_v3"),
}
TIMEOUT = 240


def _measure_cases() -> dict:
    from bpo_megatron.testing.activations import measure_activations

    return {name: measure_activations(sizes, tp=tp, recompute=recompute, model_type=model_type)
            for name, (sizes, tp, recompute, model_type) in CASES.items()}


@pytest.fixture(scope="module")
def measured() -> dict:
    return run_gloo_world(_measure_cases, 2, timeout=TIMEOUT)[0]


def _planned_model(sizes: dict, model_type: str) -> tuple[HFModelConfig, int, int]:
    """The sizes as the planner reads them, with one MoE and one dense layer: the model and the
    index of each."""
    hf = HFModelConfig.load(moe_config(model_type, sizes, layers=2, dense_layers=1))
    [moe] = hf.moe_layers
    return hf, moe, 1 - moe


@pytest.mark.parametrize("case", [name for name, (_, _, recompute, _) in CASES.items() if recompute == "none"])
def test_layer_terms_are_what_autograd_saves(measured, case):
    """Per token: a MoE layer and a dense layer as the planner counts them for a CPU; per layer:
    the MoE layer's group offsets (its stacked expert weights are parameters), none for a dense layer; the ends
    (token ids, final norm, output layer's input)."""
    sizes, tp, _, model_type = CASES[case]
    (hf, moe, dense), parallel, got = _planned_model(sizes, model_type), ParallelConfig(tp=tp), measured[case]
    assert got.moe_layer_per_token == pytest.approx(layer_bytes_per_token(hf, parallel, moe, FP32, gpu=False), rel=REL)
    assert got.dense_layer_per_token == pytest.approx(layer_bytes_per_token(hf, parallel, dense, FP32, gpu=False),
                                                      rel=REL)
    assert got.moe_layer_constant == pytest.approx(layer_constant_bytes(hf, parallel, moe), rel=REL)
    assert got.dense_layer_constant == layer_constant_bytes(hf, parallel, dense) == 0
    assert got.ends_per_token == pytest.approx(
        ends_bytes_per_token(hf, parallel, FP32, first=True, last=True, recompute="none", gpu=False), rel=REL)
    assert got.ends_constant == 0


def test_a_moe_layer_of_the_grouped_query_shape_byte_for_byte(measured):
    """By hand, fp32 at TP=1 (h 128, 4 query and 2 KV heads of 32, top-2 of 8 experts of 64): per
    token, the attention half keeps 6,704 bytes (the two layer norms' inputs, rstd and x·rstd
    2 · 1,028; the QKV input 512; the fused QKV output 1,024; the query's copy 512; the q and k
    norms' rstd and x·rstd (4 + 2) · 132; RoPE's cos and sin 512; the rotated q and k 768; the
    attention output 512; its log-sum-exp 16) and the MoE half 4,720 (the router's input 512; its
    probabilities, top-k ids and weights 72; two routed rows of 4 · (128 + 6 · 64) + 20); per layer
    and micro-batch, the 8 experts' int32 group offsets (the stacked weights are parameters, no copy)."""
    got = measured["gqa_top2"]
    assert got.moe_layer_per_token == 6_704 + 4_720 == 11_424
    assert got.moe_layer_constant == 8 * 4


@pytest.mark.parametrize("case", [name for name, (_, _, recompute, _) in CASES.items() if recompute == "full"])
def test_full_recompute_keeps_each_layers_input_and_the_rotary_angles_once(measured, case):
    sizes, tp, _, model_type = CASES[case]
    (hf, _, _), parallel, got = _planned_model(sizes, model_type), ParallelConfig(tp=tp), measured[case]
    kept = checkpoint_bytes_per_token(hf, parallel, FP32)
    assert got.moe_layer_per_token == pytest.approx(kept, rel=REL)
    assert got.dense_layer_per_token == pytest.approx(kept, rel=REL)
    assert got.moe_layer_constant == got.dense_layer_constant == 0  # the checkpointed forward keeps no offsets
    assert got.ends_per_token == pytest.approx(
        ends_bytes_per_token(hf, parallel, FP32, first=True, last=True, recompute="full", gpu=False), rel=REL)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_gpu_keeps_less_than_a_cpu_by_the_composite_norms_normalised_inputs(tp):
    """Not measured here (no GPU): torch's fused RMSNorm on CUDA saves its input and rstd
    (``_fused_rms_norm`` in derivatives.yaml), where the CPU's composite also keeps ``x·rstd``:
    per layer the input and pre-MLP norms' ``b·h`` each and the q and k norms' ``b·d`` per head;
    per model the final norm's ``b·h``, all split over TP."""
    (hf, _, _), parallel, b = _planned_model(GQA, "qwen3_moe"), ParallelConfig(tp=tp), 2
    h, d, q, kv = 128, 32, 4, 2
    for layer in (0, 1):
        gap = layer_bytes_per_token(hf, parallel, layer, b, gpu=False) - layer_bytes_per_token(hf, parallel, layer, b)
        assert gap == b * (2 * h + (q + kv) * d) / tp
    ends = {gpu: ends_bytes_per_token(hf, parallel, b, first=True, last=True, recompute="none", gpu=gpu)
            for gpu in (False, True)}
    assert ends[False] - ends[True] == b * h / tp


def test_a_glm_moe_layer_byte_for_byte(measured):
    """By hand, the GQA shape as GLM-4.5 builds it (fp32, TP=1): per token the attention half keeps
    5,144 bytes — the two layer norms 2 · 1,028, the QKV input 512, its output 1,024 (biases add
    none), no query copy and no q/k norms (without QK-norm nothing keeps the copy: RoPE saves only
    its constant cos and sin), RoPE's cos and sin over the 16 rotated dims 256, the rotated q and k
    768, the attention output 512 and its log-sum-exp 16 — and the MoE half 6,036: the router's
    input 512, its probabilities, ids and weights 72, the sigmoid scores and the renormalisation's
    denominator 36, two routed rows of 4 · (128 + 6 · 64) + 20, and the shared expert's 5 · 4 · 64."""
    got = measured["glm_top2"]
    assert got.moe_layer_per_token == 5_144 + 6_036 == 11_180
