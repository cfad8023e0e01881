"""Balanced packed training at data-parallel size 2 (gloo, CPU): the same samples trained and
scored with ``trainer.max_tokens_per_micro_batch`` (shares balanced by cost, so each rank holds
samples from both halves of the batch) and with padded micro-batches (the contiguous count split)
give the same loss, loss statistics, gradients, log-probs, entropies and recorded routing, every
result in sample order; and the share-by-share path a driver takes (each rank given its share,
results put back with the same inverse map) gives what the whole-batch call gives."""

from __future__ import annotations

import math

import pytest
import torch

from bpo_megatron import testing as th
from bpo_megatron.losses import CorrectionConfig, PolicyLossConfig
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.trainer.samples import TrainSample

TIMEOUT = 300
BUDGET = 24
# input positions and prompt lengths: the count split puts 45 positions on rank 0 and 30 on
# rank 1; balanced, each rank takes samples from both halves and runs 2 packs of ≤ 24 positions
POSITIONS = (20, 3, 18, 4, 5, 17, 2, 6)
PROMPTS = (6, 2, 3, 2, 2, 5, 1, 3)
LAYOUTS = {  # name -> layout at world size 2, data parallelism 2
    "dp2": dict(),
    # experts split over the two data-parallel ranks: their all-to-alls run in lockstep
    "ep2_dp2": dict(ep=2),
}
LOSS = PolicyLossConfig(name="bpo", agg="token-mean", correction=CorrectionConfig(name="tis"))


def _samples() -> list[TrainSample]:
    return th.samples_of_lengths(POSITIONS, PROMPTS, seed=17, old_spread=0.5)


def _train_both_ways(layout: dict) -> dict:
    """Per batching: whole-batch scores (R3 replay), the routers' own choices, the driver's
    share-by-share scores, and one step's metrics and raw gradients from the same weights."""
    import torch.distributed as dist

    from bpo_megatron.trainer.balance import data_parallel_shares

    samples = _samples()
    initial = None
    runs = {}
    for mode, budget in (("padded", 0), ("packed", BUDGET)):
        actor = th.build_actor(replay=True, loss=LOSS, micro_batch_size=2, grad_clip=math.inf,
                               max_tokens_per_micro_batch=budget, **layout)
        if initial is None:
            initial = th.flat_params(actor)
        th.set_flat_params(actor, initial)
        shares = data_parallel_shares(samples, 2, budget=budget, cost=actor.cost)
        scored = actor.compute_logprobs(samples)
        free = actor.compute_logprobs(samples, record_routing=True)
        # what a driver does: each rank scores its own share
        mine = actor.logprobs_of_share([samples[i] for i in shares[dist.get_rank()]])
        metrics = actor.train_step(samples)
        runs[mode] = {
            "shares": shares, "scored": scored, "routing": free.routed_experts, "share_scored": mine,
            "metrics": metrics, "grads": {n: p.main_grad.detach().clone() for n, p in actor.model.named_parameters()},
        }
        actor.close()
    return runs


@pytest.mark.timeout(TIMEOUT * 2)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_balanced_packed_training_equals_padded_training_in_sample_order(name):
    from bpo_megatron.trainer.balance import in_sample_order

    ranks = run_gloo_world(_train_both_ways, 2, LAYOUTS[name], timeout=TIMEOUT)
    padded0, packed0 = ranks[0]["padded"], ranks[0]["packed"]
    assert padded0["shares"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the count split, as before
    shares = packed0["shares"]
    assert sorted(map(len, shares)) == [4, 4] and all(any(i < 4 for i in s) and any(i >= 4 for i in s) for s in shares)
    worst = {"metric": 0.0, "grad": 0.0, "logprob": 0.0}
    for rank, runs in enumerate(ranks):
        padded, packed = runs["padded"], runs["packed"]
        where = f"{name} rank {rank}"
        assert packed["shares"] == shares  # every rank chose the same shares
        assert packed["metrics"]["num_micro_batches"] == 2.0, where  # 2 packs on each rank
        for key, value in padded["metrics"].items():
            if key.endswith("_s") or key in ("num_micro_batches", "step"):
                continue
            diff = abs(packed["metrics"][key] - value)
            dev = 0.0 if diff <= 1e-9 else diff / max(abs(value), abs(packed["metrics"][key]))
            assert dev <= 1e-6, (where, key, packed["metrics"][key], value)
            worst["metric"] = max(worst["metric"], dev)
        for param, grad in padded["grads"].items():
            dev = float((packed["grads"][param] - grad).abs().max()) / max(float(grad.abs().max()), 1e-12)
            assert dev <= 1e-6, (where, param, dev)
            worst["grad"] = max(worst["grad"], dev)
        for key in ("logprobs", "entropies"):
            for i, (mine, theirs) in enumerate(zip(getattr(packed["scored"], key), getattr(padded["scored"], key),
                                                   strict=True)):
                assert mine.shape == (POSITIONS[i] + 1 - PROMPTS[i],), (where, key, i)
                dev = float((mine - theirs).abs().max())
                assert dev <= 1e-6, (where, key, i, dev)
                worst["logprob"] = max(worst["logprob"], dev)
        for i, (mine, theirs) in enumerate(zip(packed["routing"], padded["routing"], strict=True)):
            assert mine.shape[0] == POSITIONS[i] and torch.equal(mine, theirs), (where, "routing", i)
    # the driver's path: each rank's share results, put back by the same shares, are the whole-batch results
    for mode in ("padded", "packed"):
        per_share = [ranks[r][mode]["share_scored"] for r in range(2)]
        for key in ("logprobs", "entropies"):
            ordered = in_sample_order([getattr(s, key) for s in per_share], ranks[0][mode]["shares"])
            for i, (got, want) in enumerate(zip(ordered, getattr(ranks[0][mode]["scored"], key), strict=True)):
                assert torch.equal(got, want), (name, mode, key, i)
    print(f"\n{name}: packed+balanced vs padded: metrics {worst['metric']:.1e} rel, gradients "
          f"{worst['grad']:.1e} of the tensor max, log-probs/entropies {worst['logprob']:.1e} abs; shares {shares}")
    assert padded0["metrics"]["grad_norm"] > 0 and padded0["metrics"]["loss"] != 0.0
