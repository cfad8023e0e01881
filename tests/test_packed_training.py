"""Packed micro-batches train exactly as padded ones: the same samples (varied lengths, R3 replay,
π_old with a mismatch correction, tokens left out by ``train_mask``) scored and trained once with
``train.max_tokens_per_micro_batch`` and once with padded micro-batches, from the same initial
weights, give the same log-probs, entropies, recorded routing, loss, loss statistics and
gradients, under tensor + sequence, expert, pipeline and data parallelism.

The data-parallel shares pack into different numbers of micro-batches (one pack of 15 positions
against two), so the rank with fewer packs must cut its pack to run as many as the other."""

from __future__ import annotations

import math

import pytest
import torch

import train_helpers as th
from bpo_megatron.losses import PolicyLossConfig
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.trainer.samples import TrainSample

TIMEOUT = 300
BUDGET = 16
# input positions (len(tokens) − 1) and prompt lengths: DP rank 0's share [3, 4, 5, 3] fits one
# pack of 16; rank 1's [11, 4, 9, 6] needs two (11 + 4 and 9 + 6), odd totals padded for TP
POSITIONS = (3, 4, 5, 3, 11, 4, 9, 6)
PROMPTS = (2, 3, 2, 2, 5, 2, 4, 3)
CASES = {
    "bpo_token_mean_tis": PolicyLossConfig(name="bpo", agg="token-mean", correction="tis"),
    "gspo_seq_mean_token_mean_icepop": PolicyLossConfig(name="gspo", agg="seq-mean-token-mean", correction="icepop"),
}
LAYOUTS = {  # name -> (world size, layout); data parallelism 2 in each
    "tp2_sp_dp2": (4, dict(tp=2)),
    "ep2_pp2_dp2": (4, dict(ep=2, pp=2)),
    # experts split over TP and DP ranks, and R3 replayed again by activation recomputation
    "tp2_sp_ep2_dp2_recompute": (4, dict(tp=2, ep=2, recompute="full")),
}


def _samples() -> list[TrainSample]:
    hf = th.tiny_moe()
    gen = torch.Generator().manual_seed(7)
    samples = []
    for i, (positions, prompt) in enumerate(zip(POSITIONS, PROMPTS)):
        response = positions + 1 - prompt
        rollout = -torch.rand(response, generator=gen) * 2 - 0.5
        old = (rollout + (torch.rand(response, generator=gen) * 2 - 1)).clamp(max=0.0)  # ratios beyond the caps too
        train_mask = None
        if i in (1, 4):  # a few response tokens left out (R3 marked their routing stale)
            train_mask = torch.rand(response, generator=gen) > 0.4
            train_mask[-1] = True
        samples.append(TrainSample(
            tokens=torch.randint(0, hf.vocab_size, (positions + 1,), generator=gen), response_start=prompt,
            rollout_logprobs=rollout, advantage=(1.0 if i % 3 else -1.5) * (0.5 + i / 8),
            routed_experts=th.random_routing(positions, hf, gen), old_logprobs=old, train_mask=train_mask))
    return samples


def _score_and_train(layout: dict) -> dict:
    """For each loss and each batching: scores (R3 replay), the trainer's own routing, one train
    step's metrics and the gradients it took (clipping off, so they are the raw ones). Gradients,
    not updated weights, are compared: Adam's first update lr · g / (|g| + ε) turns the rounding
    of a near-zero gradient into an update of up to lr."""
    samples = _samples()
    results: dict = {}
    for case, loss in CASES.items():
        for mode, budget in (("padded", 0), ("packed", BUDGET)):
            actor = th.build_actor(replay=True, loss=loss, micro_batch_size=2, grad_clip=math.inf,
                                   max_tokens_per_micro_batch=budget, **layout)
            scored = actor.compute_logprobs(samples)
            free = actor.compute_logprobs(samples, record_routing=True)
            metrics = actor.train_step(samples)
            grads = {name: p.main_grad.detach().clone() for name, p in actor.model.named_parameters()}
            results[(case, mode)] = {
                "scored": scored, "routing": None if free is None else free.routed_experts,
                "metrics": metrics, "grads": grads,
            }
            actor.close()
    return results


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-9


@pytest.mark.timeout(TIMEOUT * 2)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_packed_micro_batches_train_exactly_as_padded_ones(name):
    world, layout = LAYOUTS[name]
    ranks = run_gloo_world(_score_and_train, world, layout, timeout=TIMEOUT)
    scored_ranks = 0
    for rank, results in enumerate(ranks):
        for case in CASES:
            padded, packed = results[(case, "padded")], results[(case, "packed")]
            where = f"{name} rank {rank} {case}"
            # every rank ran as many micro-batches: rank 0 cut its one pack of 15 positions in two
            assert packed["metrics"]["num_micro_batches"] == 2.0, where
            for key, value in padded["metrics"].items():
                if key.endswith("_s") or key == "num_micro_batches":
                    continue
                assert _close(packed["metrics"][key], value), (where, key, packed["metrics"][key], value)
            for param, grad in padded["grads"].items():
                scale = float(grad.abs().max())
                diff = float((packed["grads"][param] - grad).abs().max())
                assert diff <= 1e-6 * scale + 1e-12, (where, param, diff, scale)
            if padded["scored"] is None:  # not the last pipeline stage
                continue
            scored_ranks += 1
            for key in ("logprobs", "entropies"):
                for i, (mine, theirs) in enumerate(zip(getattr(packed["scored"], key), getattr(padded["scored"], key),
                                                       strict=True)):
                    assert mine.shape == (POSITIONS[i] + 1 - PROMPTS[i],), (where, key, i)
                    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6, msg=f"{where} {key} sample {i}")
            for i, (mine, theirs) in enumerate(zip(packed["routing"], padded["routing"], strict=True)):
                assert mine.shape[0] == POSITIONS[i] and torch.equal(mine, theirs), (where, "routing", i)
    assert scored_ranks >= 2
    # the step did train, and the correction and the masks acted
    metrics = ranks[0][("bpo_token_mean_tis", "packed")]["metrics"]
    trained = sum(p + 1 - q for p, q in zip(POSITIONS, PROMPTS)) - sum(
        int((~s.train_mask).sum()) for s in _samples() if s.train_mask is not None)
    assert metrics["num_tokens"] == trained and metrics["grad_norm"] > 0


# ------------------------------------------------------------------------------ refusals
def _refusals() -> dict:
    """Samples the budget cannot take, given as the whole batch (every rank sees them) and as
    one rank's share (the other rank's share fits): every rank refuses, none waits for another."""
    import torch.distributed as dist

    from bpo_megatron.trainer.actor import minibatch_totals

    actor = th.build_actor(replay=True, max_tokens_per_micro_batch=10)
    short = _samples()[:4]  # 3, 4, 5 and 3 positions
    long = _samples()[4:]  # 11, 4, 9 and 6 positions
    rank = dist.get_rank()
    before = th.flat_params(actor)
    errors = {}
    calls = {
        "whole batch": lambda: actor.train_step(short + long),
        "whole batch scored": lambda: actor.compute_logprobs(short + long),
        "share": lambda: actor.train_share(short if rank == 0 else long, minibatch_totals(short + long)),
        # rank 0's one sample cannot fill the 3 packs of rank 1's three 6-position samples
        "too few samples": lambda: actor.logprobs_of_share(short[1:2] if rank == 0 else [long[3], long[3], long[3]]),
    }
    for name, call in calls.items():
        try:
            call()
        except ValueError as exc:
            errors[name] = str(exc)
    unchanged = all(torch.equal(before[k], v) for k, v in th.flat_params(actor).items())
    actor.close()
    return {"errors": errors, "unchanged": unchanged}


@pytest.mark.timeout(TIMEOUT)
def test_samples_the_budget_cannot_take_are_refused_by_every_rank_before_any_compute():
    ranks = run_gloo_world(_refusals, 2, timeout=TIMEOUT)
    for rank, got in enumerate(ranks):
        errors = got["errors"]
        assert set(errors) == {"whole batch", "whole batch scored", "share", "too few samples"}, (rank, errors)
        for key in ("whole batch", "whole batch scored"):
            assert "sample 4 has 11 input positions" in errors[key] and "max_tokens_per_micro_batch=10" in errors[key]
        assert got["unchanged"], rank
        assert "3 micro-batches but another holds only 1 samples" in errors["too few samples"], errors
    assert "sample 0 has 11 input positions" in ranks[1]["errors"]["share"]  # its share's first sample
    assert "a sample of 11 input positions on another data-parallel rank" in ranks[0]["errors"]["share"]
