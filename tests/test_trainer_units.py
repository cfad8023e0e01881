"""Single-process pieces of the trainer: layout validation, sample checks, micro-batch padding."""

from __future__ import annotations

import pytest
import torch

from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.trainer.replay import check_routed_experts
from bpo_megatron.trainer.samples import TrainSample, check_samples, chunk, collate, split


def sample(tokens, start, advantage=1.0, routed=None, rollout=None, train_mask=None):
    tokens = torch.tensor(tokens)
    n = tokens.numel() - start
    rollout = torch.full((n,), -1.0) if rollout is None else rollout
    return TrainSample(tokens=tokens, response_start=start, rollout_logprobs=rollout,
                       advantage=advantage, routed_experts=routed, train_mask=train_mask)


# ------------------------------------------------------------------------- ParallelConfig
def test_expert_tp_defaults():
    assert ParallelConfig(tp=2, ep=2).expert_tp == 1  # experts stay whole under EP
    assert ParallelConfig(tp=2).expert_tp == 2  # Megatron's default without EP
    assert ParallelConfig(tp=2).sequence_parallel and not ParallelConfig().sequence_parallel
    assert ParallelConfig(tp=2, pp=2).data_parallel_size(8) == 2


@pytest.mark.parametrize(
    "config, world, match",
    [
        (dict(tp=3), 4, "world size 4 is not divisible by parallel.tp × parallel.pp = 3 × 1"),
        (dict(tp=2, pp=2), 6, "not divisible by parallel.tp × parallel.pp = 2 × 2"),
        (dict(ep=4), 2, r"parallel.ep × parallel.etp = 4 × 1 must divide the 2 ranks"),
        (dict(tp=2, etp=1), 2, "parallel.etp=1 with parallel.ep=1 must equal parallel.tp=2"),
    ],
)
def test_layouts_that_do_not_fit_the_world(config, world, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**config).validate_world(world)


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(pp=3), "parallel.pp=3 must divide the model's 4 layers"),
        (dict(tp=3), "parallel.tp=3 must divide the attention heads"),
        (dict(ep=16), "parallel.ep=16 must divide the model's 8 experts"),
    ],
)
def test_layouts_that_do_not_fit_the_model(config, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**config).validate_model(num_layers=4, num_experts=8, num_attention_heads=8, num_query_groups=4)


def test_expert_parallel_needs_experts():
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model"):
        ParallelConfig(ep=2).validate_model(num_layers=2, num_experts=0, num_attention_heads=4, num_query_groups=2)


@pytest.mark.parametrize("field, value", [("tp", 0), ("pp", -1), ("ep", 1.5), ("etp", 0)])
def test_sizes_must_be_positive_integers(field, value):
    with pytest.raises(ValueError, match=f"parallel.{field} must be a positive integer"):
        ParallelConfig(**{field: value})


# ------------------------------------------------------------------------------ samples
def test_collate_aligns_targets_masks_and_rollout_logprobs():
    a = sample([5, 6, 7, 8, 9], start=2, rollout=torch.tensor([-0.1, -0.2, -0.3]))
    b = sample([1, 2, 3], start=1, advantage=-2.0, rollout=torch.tensor([-0.4, -0.5]))
    micro = collate([a, b], pad_to_multiple=4)
    assert micro.shape == (2, 4)  # 4 input positions, already a multiple of 4
    assert micro.input_ids.tolist() == [[5, 6, 7, 8], [1, 2, 0, 0]]
    assert micro.targets.tolist() == [[6, 7, 8, 9], [2, 3, 0, 0]]
    # the first response token (index 2 of a) is predicted at position 1
    assert micro.loss_mask.tolist() == [[False, True, True, True], [True, True, False, False]]
    assert micro.rollout_logprobs[0].tolist() == pytest.approx([0.0, -0.1, -0.2, -0.3])
    assert micro.rollout_logprobs[1].tolist() == pytest.approx([-0.4, -0.5, 0.0, 0.0])
    assert micro.advantages.tolist() == [1.0, -2.0] and micro.lengths.tolist() == [4, 2]
    assert collate([b], pad_to_multiple=4).shape == (1, 4)


def test_a_samples_train_mask_leaves_its_tokens_out_of_the_loss_mask_it_trains_with():
    """The response tokens a sample leaves out stay response tokens (scored, ``loss_mask``) but not
    trained (``train_mask``), and count in neither of the minibatch's denominators; a sample left
    out entirely is not a sequence of the minibatch either."""
    from bpo_megatron.trainer.shares import minibatch_totals

    a = sample([5, 6, 7, 8, 9], start=1, train_mask=torch.tensor([False, False, True, True]))
    b = sample([1, 2, 3], start=1, train_mask=torch.tensor([False, False]))
    c = sample([4, 5, 6], start=2)
    micro = collate([a, b, c])
    assert micro.loss_mask.tolist() == [[True] * 4, [True, True, False, False], [False, True, False, False]]
    assert micro.train_mask.tolist() == [[False, False, True, True], [False] * 4, [False, True, False, False]]
    assert (a.num_train_tokens, b.num_train_tokens, c.num_train_tokens) == (2, 0, 1)
    totals = minibatch_totals([a, b, c])
    assert (totals.tokens, totals.sequences) == (3.0, 2.0)
    # what a loss computed from the collated mask alone would count: the same
    from bpo_megatron.losses import BatchTotals

    assert BatchTotals.of(micro.train_mask) == totals


def test_collate_pads_routing_with_a_valid_expert_set():
    routed = torch.tensor([[[3, 1]], [[2, 0]]])  # 2 positions, 1 MoE layer, top-2
    micro = collate([sample([1, 2, 3], 1, routed=routed)], pad_to_multiple=4, with_routing=True)
    assert micro.routed_experts.shape == (1, 4, 1, 2)
    assert micro.routed_experts[0, :, 0].tolist() == [[3, 1], [2, 0], [0, 1], [0, 1]]


def test_split_and_chunk():
    assert split(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert chunk(list(range(5)), 2) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize(
    "bad, match",
    [
        (sample([1, 2, 3], 0), "response_start=0 must leave at least one prompt"),
        (sample([1, 2, 3], 3), "response_start=3 must leave"),
        (sample([1, 2, 300], 1), r"token ids must lie in \[0, 200\)"),
        (sample([1, 2, 3], 1, rollout=torch.zeros(3)), r"rollout_logprobs has shape \(3,\), expected \(2,\)"),
        (sample([1, 2, 3], 1, rollout=torch.tensor([-1.0, float("nan")])), "must be finite log-probabilities"),
        (sample([1, 2, 3], 1, rollout=torch.tensor([-1.0, 0.5])), "must be finite log-probabilities"),
        (sample([1, 2, 3], 1, advantage=float("inf")), "advantage must be finite"),
        (sample([1, 2, 3], 1, train_mask=torch.tensor([True])), r"train_mask must be bool, one per response token"),
        (sample([1, 2, 3], 1, train_mask=torch.tensor([1, 0])), r"train_mask must be bool"),
    ],
)
def test_bad_samples_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        check_samples([sample([4, 5, 6], 1), bad], vocab_size=200)


def test_duplicate_experts_in_one_top_k_are_refused():
    routed = torch.tensor([[[1, 1]], [[0, 2]]])
    with pytest.raises(ValueError, match="repeat an expert"):
        check_routed_experts([sample([1, 2, 3], 1, routed=routed)], num_moe_layers=1, topk=2, num_experts=4)


def test_routing_from_an_engine_is_checked_for_shape_only_after_arrival():
    """The driver and the ranks see every sample again (π_old, each minibatch): they check its
    routing's shape and dtype, never its ids (an engine's routing was checked on arrival). Routing
    on the meta device has a shape but no values: reading them fails."""
    routed = torch.empty((2, 1, 2), dtype=torch.uint8, device="meta")
    check_routed_experts([sample([1, 2, 3], 1, routed=routed)], num_moe_layers=1, topk=2, num_experts=4,
                         contents=False)
    with pytest.raises((NotImplementedError, RuntimeError)):
        check_routed_experts([sample([1, 2, 3], 1, routed=routed)], num_moe_layers=1, topk=2, num_experts=4)
    with pytest.raises(ValueError, match=r"shape \(2, 1, 3\), expected \(2, 1, 2\)"):
        check_routed_experts([sample([1, 2, 3], 1, routed=torch.zeros((2, 1, 3), dtype=torch.uint8, device="meta"))],
                             num_moe_layers=1, topk=2, num_experts=4, contents=False)


@pytest.mark.parametrize("recompute, queued", [(False, 0), (True, 3)])
def test_replayed_ids_are_queued_for_backward_only_when_recomputation_will_take_them(recompute, queued):
    """Megatron's RouterReplay queues each micro-batch's int64 ids for activation recomputation;
    without it (forward-only log-prob passes, training with recompute none) nothing would take
    them off before the pass ends, so the whole share's ids would pile up: none stay queued."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from bpo_megatron.trainer.replay import RoutingReplay, _Router

    replay = RoutingReplay.__new__(RoutingReplay)
    replay._tp_rank, replay._tp_size, replay._sp = 0, 1, False
    replay._routers = [_Router(0, RouterReplay())]
    routed = torch.tensor([[[3, 1]], [[2, 0]]])
    micro = collate([sample([1, 2, 3], 1, routed=routed)], with_routing=True)
    for _ in range(3):
        replay.load(micro, recompute=recompute)
        assert replay._routers[0].replay.target_topk_idx.tolist() == [[3, 1], [2, 0]]
    assert len(replay._routers[0].replay.replay_backward_list) == queued
