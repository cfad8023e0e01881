"""Packed micro-batches (single process): the packed row, its segments and the padded layout the
loss reads, budget refusals; and the packed core attention against per-sample causal attention
computed independently. Which samples share a pack is tested in tests/test_balance.py."""

from __future__ import annotations

import math

import pytest
import torch

from bpo_megatron.config import ConfigError
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.trainer.config import TrainerConfig
from bpo_megatron.trainer.packing import check_fits, pack
from bpo_megatron.trainer.samples import TrainSample, collate

TIMEOUT = 120


def sample(tokens, start, *, advantage=1.0, routed=None, train_mask=None, old=False):
    tokens = torch.tensor(tokens)
    n = tokens.numel() - start
    rollout = -torch.arange(1, n + 1, dtype=torch.float32) / 10
    return TrainSample(tokens=tokens, response_start=start, rollout_logprobs=rollout, advantage=advantage,
                       routed_experts=routed, train_mask=train_mask, old_logprobs=rollout * 2 if old else None)


# ------------------------------------------------------------------------------ the layout
def test_a_pack_lays_samples_end_to_end_with_restarting_positions_and_a_padding_segment():
    a = sample([5, 6, 7, 8, 9], 2, old=True)  # 4 input positions
    b = sample([1, 2, 3], 1, advantage=-2.0, train_mask=torch.tensor([False, True]), old=True)  # 2
    micro = pack([a, b], pad_to_multiple=4)
    assert micro.shape == (1, 8)  # 6 positions rounded up to a multiple of 4 (TP) by a segment of 2
    assert micro.input_ids.tolist() == [[5, 6, 7, 8, 1, 2, 0, 0]]
    assert micro.targets.tolist() == [[6, 7, 8, 9, 2, 3, 0, 0]]
    assert micro.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1]]
    assert micro.cu_seqlens.dtype == torch.int32 and micro.cu_seqlens.tolist() == [0, 4, 6, 8]
    assert micro.max_seqlen == 4
    params = micro.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 4
    assert params.cu_seqlens_q is micro.cu_seqlens and params.cu_seqlens_kv is micro.cu_seqlens
    # the loss reads exactly what collate builds for the same samples
    reference = collate([a, b])
    for name, value in vars(reference).items():
        if torch.is_tensor(value):
            assert torch.equal(getattr(micro.padded, name), value), name
    assert micro.padded.routed_experts is None
    assert micro.source.tolist() == [[0, 1, 2, 3], [4, 5, 8, 8]]  # 8: a padding cell, reads 0


def test_without_padding_there_is_no_padding_segment():
    micro = pack([sample([1, 2, 3], 1), sample([4, 5, 6, 7], 2)], pad_to_multiple=1)
    assert micro.cu_seqlens.tolist() == [0, 2, 5] and micro.position_ids.tolist() == [[0, 1, 0, 1, 2]]


def test_the_index_map_round_trips_and_carries_gradients_to_the_packed_positions():
    a, b, c = sample([5, 6, 7, 8, 9], 2), sample([1, 2, 3], 1), sample([4, 3, 2, 1, 9, 8], 3)
    micro = pack([a, b, c], pad_to_multiple=2)
    padded = micro.padded
    # packed tensors laid out as collate lays them out: equal wherever a row holds a position
    real = torch.arange(padded.shape[1]) < padded.lengths[:, None]
    for name in ("input_ids", "targets", "position_ids"):
        scattered = micro.as_padded(getattr(micro, name))
        assert torch.equal(scattered[real], getattr(padded, name)[real]), name
        assert not scattered[~real].any(), name  # padding cells read zero
    values = torch.randn(1, micro.shape[1], 3, requires_grad=True)  # e.g. [1, T, K] routing-shaped too
    out = micro.as_padded(values)
    assert out.shape == (3, 5, 3)
    out.sum().backward()
    # every real position is read once, the padding segment never
    used = torch.zeros(micro.shape[1])
    used[: int(padded.lengths.sum())] = 1
    assert torch.equal(values.grad[0], used[:, None].expand(-1, 3))


def test_a_packs_routing_is_the_samples_then_a_valid_expert_set_for_padding():
    routed_a = torch.tensor([[[3, 1]], [[2, 0]]], dtype=torch.uint8)  # 2 positions, 1 MoE layer, top-2
    routed_b = torch.tensor([[[1, 2]]], dtype=torch.uint8)
    micro = pack([sample([1, 2, 3], 1, routed=routed_a), sample([4, 5], 1, routed=routed_b)],
                 pad_to_multiple=4, with_routing=True)
    assert micro.routed_experts.shape == (1, 4, 1, 2) and micro.routed_experts.dtype == torch.uint8
    assert micro.routed_experts[0, :, 0].tolist() == [[3, 1], [2, 0], [1, 2], [0, 1]]


def test_moving_a_pack_moves_its_padded_layout():
    micro = pack([sample([1, 2, 3], 1)]).to(torch.device("cpu"))
    assert micro.padded.input_ids.tolist() == [[1, 2]] and micro.cu_seqlens.tolist() == [0, 2]


# ------------------------------------------------------------------------------ refusals
def test_a_sample_over_the_budget_is_refused_naming_the_setting_the_sample_and_its_length():
    samples = [sample([1, 2, 3], 1), sample(list(range(12)), 4)]
    check_fits(samples, 11)
    with pytest.raises(ValueError, match=r"sample 1 has 11 input positions .* trainer.max_tokens_per_micro_batch=10"):
        check_fits(samples, 10)


@pytest.mark.parametrize("value", [-1, 1.5, True, "8"])
def test_the_budget_must_be_a_non_negative_integer(value):
    with pytest.raises(ValueError, match="trainer.max_tokens_per_micro_batch must be a non-negative integer"):
        TrainerConfig(max_tokens_per_micro_batch=value)


def test_an_experiment_whose_longest_sample_does_not_fit_is_refused_before_it_starts():
    from bpo_megatron.experiment import load_experiment

    fits = load_experiment(None, ["data.max_prompt_tokens=100", "rollout.max_new_tokens=29",
                                  "trainer.max_tokens_per_micro_batch=128"], check_model=False)
    assert fits.trainer.max_tokens_per_micro_batch == 128
    with pytest.raises(ConfigError, match=r"trainer.max_tokens_per_micro_batch=128 .* = 129 input positions"):
        load_experiment(None, ["data.max_prompt_tokens=100", "rollout.max_new_tokens=30",
                               "trainer.max_tokens_per_micro_batch=128"], check_model=False)


# ------------------------------------------------------------------------------ attention
def _reference_attention(q, k, v, bounds):
    """softmax(q kᵀ / √d) v per sample with a causal mask, key/value groups repeated per head."""
    repeat = q.shape[1] // k.shape[1]
    out = []
    for start, end in zip(bounds, bounds[1:]):
        qs, ks, vs = q[start:end], k[start:end].repeat_interleave(repeat, 1), v[start:end].repeat_interleave(repeat, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(q.shape[-1])
        causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, vs).reshape(end - start, -1))
    return torch.cat(out)


def _attention_results() -> dict:
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from bpo_megatron.models.packed_attention import PackedDotProductAttention
    from bpo_megatron.parallel import ParallelConfig
    from bpo_megatron.parallel.state import initialize_parallel

    initialize_parallel(ParallelConfig(), seed=0)
    heads, groups, dim = 4, 2, 32
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, num_query_groups=groups,
                               kv_channels=dim, use_cpu_initialization=True, attention_dropout=0.0)
    attention = PackedDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                          attention_type="self")
    gen = torch.Generator().manual_seed(0)
    bounds = [0, 5, 6, 13, 16]  # segments of 5, 1, 7 and 3 positions
    q = torch.randn(16, heads, dim, generator=gen)
    k, v = torch.randn(16, groups, dim, generator=gen), torch.randn(16, groups, dim, generator=gen)
    cu = torch.tensor(bounds, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    packed = attention(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    # without packed parameters: the parent's padded-batch attention, [s, b, heads, d]
    rows = torch.randn(7, 2, heads, dim, generator=gen), torch.randn(7, 2, groups, dim, generator=gen)
    values = torch.randn(7, 2, groups, dim, generator=gen)
    unpacked = attention(rows[0], rows[1], values, None, attn_mask_type=AttnMaskType.causal)
    unpacked_reference = torch.stack([_reference_attention(rows[0][:, b], rows[1][:, b], values[:, b], [0, 7])
                                      for b in range(2)], dim=1)
    # RoPE on a packed row: per segment, the angles of each sample's own positions 0, 1, …
    rope = RotaryEmbedding(kv_channels=dim, rotary_percent=1.0, rotary_base=10000)
    freqs = rope(7, packed_seq=True)
    roped = apply_rotary_pos_emb(q, freqs, config=config, cu_seqlens=cu)
    alone = torch.cat([apply_rotary_pos_emb(q[a:b].unsqueeze(1), rope(b - a), config=config).squeeze(1)
                       for a, b in zip(bounds, bounds[1:])])
    whole = apply_rotary_pos_emb(q[:7], rope(7, packed_seq=True), config=config,
                                 cu_seqlens=torch.tensor([0, 7], dtype=torch.int32))  # one segment = max_seqlen
    return {"packed": packed, "reference": _reference_attention(q, k, v, bounds), "unpacked": unpacked,
            "unpacked_reference": unpacked_reference, "roped": roped, "alone": alone, "whole": whole,
            "whole_alone": apply_rotary_pos_emb(q[:7].unsqueeze(1), rope(7), config=config).squeeze(1)}


def test_packed_core_attention_is_causal_attention_within_each_sample():
    (got,) = run_gloo_world(_attention_results, 1, timeout=TIMEOUT)
    assert got["packed"].shape == (16, 1, 4 * 32)  # [t, 1, heads × d]: what Attention reshapes for thd
    torch.testing.assert_close(got["packed"].reshape(16, -1), got["reference"], rtol=0, atol=1e-6)
    assert got["unpacked"].shape == (7, 2, 4 * 32)
    torch.testing.assert_close(got["unpacked"], got["unpacked_reference"], rtol=0, atol=1e-6)
    assert torch.equal(got["roped"], got["alone"]) and torch.equal(got["whole"], got["whole_alone"])
