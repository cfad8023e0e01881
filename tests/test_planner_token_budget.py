"""The planner with a token budget (``trainer.max_tokens_per_micro_batch``): memory per micro-batch
sized by the budget, and the Monte Carlo of micro-batches per rank, load imbalance and useful
tokens (bpo_megatron/planner/batches.py) against hand-computed cases; the recipes fit with theirs."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from bpo_megatron.experiment import load_experiment
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.planner import format_plan, make_plan
from bpo_megatron.planner.activations import (forward_only_activation_bytes, layer_constant_bytes, logits_bytes,
                                              micro_batch_positions, stage_activation_bytes)
from bpo_megatron.planner.batches import (LENGTH_DISTRIBUTIONS, estimate_batches, lockstep_groups, packed_pass,
                                          padded_pass)
from bpo_megatron.planner.layout import Allocation, layout_checks
from bpo_megatron.trainer.balance import CostModel

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MAIN = CONFIGS / "qwen3_30b_a3b_bpo.yaml"
DISAGGREGATED = CONFIGS / "qwen3_30b_a3b_bpo_disaggregated.yaml"
LONGEST_30B = 2048 + 16384 - 1  # input positions of a sample at both caps


def _cfg(path: Path, *overrides: str):
    return load_experiment(path, list(overrides), check_model=False)


# ------------------------------------------------------------------ memory sized by the budget
@pytest.mark.parametrize("recipe", [MAIN, DISAGGREGATED], ids=["colocated", "disaggregated"])
def test_a_budget_of_b_longest_samples_costs_what_b_padded_samples_cost(recipe):
    """Packed micro-batches of b × the longest sample hold what padded ones of b max-length samples
    hold: activations, logits and R3 per stage are the same (pipeline in flight included)."""
    padded = make_plan(_cfg(recipe, "trainer.micro_batch_size=2", "trainer.max_tokens_per_micro_batch=0"),
                       _cfg(recipe).hf_config())
    row = 18_432  # the longest sample, 18,431 positions, padded to a multiple of tp 4
    packed = make_plan(_cfg(recipe, f"trainer.max_tokens_per_micro_batch={2 * row}"), _cfg(recipe).hf_config())
    assert padded.tokens_per_micro_batch == packed.tokens_per_micro_batch == 2 * row
    for a, b in zip(padded.stages, packed.stages, strict=True):
        assert (a.activations, a.logits, a.routing, a.in_flight) == (b.activations, b.logits, b.routing, b.in_flight)
        assert a.total == b.total


def test_activations_logits_and_r3_scale_with_the_budget_padded_to_tp():
    cfg = _cfg(MAIN, "trainer.max_tokens_per_micro_batch=36863")  # not a multiple of tp 4: packs pad to 36,864
    hf = cfg.hf_config()
    plan = make_plan(cfg, hf)
    [stage] = plan.stages
    assert plan.tokens_per_micro_batch == 36_864
    layers = tuple(range(48))
    # the one stage is the first and the last (the embedding's ids, the final norm and output layer's input)
    assert stage.activations == stage_activation_bytes(hf, cfg.parallel, layers, tokens=36_864, recompute="full",
                                                       act_bytes=2, in_flight=1, first=True, last=True)
    vocab_rows = 152_064 // 4  # padded vocabulary over tp 4
    assert stage.logits == logits_bytes(vocab_rows, 36_864, 2) == 36_864 * vocab_rows * 2 + 2 * 2**28
    # R3: the micro-batch's routed experts (uint8, 48 MoE layers × top-8) and, held until recomputation
    # pops them, the int64 ids of this rank's sequence shard for its 48 routers
    assert stage.routing == 36_864 * 48 * 8 * 1 + 36_864 * 48 * 8 * 8 / 4
    assert stage.total == stage.static.total + stage.activations + stage.logits + stage.routing + 4e9
    # memory grows linearly with the budget: twice the budget, twice each per-micro-batch term, but
    # for the rebuilt layer's group offsets (16 local experts, int32), whatever the length
    double = make_plan(_cfg(MAIN, "trainer.max_tokens_per_micro_batch=73728"), hf).stages[0]
    offsets = layer_constant_bytes(hf, cfg.parallel, 0)
    assert offsets == 16 * 4
    assert double.activations - offsets == pytest.approx(2 * (stage.activations - offsets))
    assert double.routing == pytest.approx(2 * stage.routing)
    assert micro_batch_positions(ParallelConfig(tp=1), longest=10_239, micro_batch_size=3, budget=0) == 3 * 10_239
    assert micro_batch_positions(ParallelConfig(tp=4), longest=10_239, micro_batch_size=3, budget=0) == 3 * 10_240


def test_the_log_prob_pass_holds_the_r3_ids_of_the_running_micro_batch_only():
    """A forward-only pass never recomputes: the trainer drops each micro-batch's router ids once
    its forward has them (trainer/replay.py), so with train.recompute_old_logprobs the pass holds
    the ids of one micro-batch, not of the step's whole share."""
    cfg = load_experiment(CONFIGS / "qwen3_30b_a3b_grpo_tis.yaml", check_model=False)
    hf = cfg.hf_config()
    [stage] = make_plan(cfg, hf).stages
    tokens = 36_864
    expected = (forward_only_activation_bytes(hf, cfg.parallel, tuple(range(48)), tokens=tokens, act_bytes=2)
                + stage.logits + tokens * 48 * 8 + tokens * 48 * 8 * 8 / 4)
    assert stage.logprob_pass == pytest.approx(expected)
    assert stage.total == stage.static.total + max(stage.training_pass, stage.logprob_pass) + 4e9
    assert "log-prob pass instead of the above" in format_plan(make_plan(cfg, hf))
    [plain] = make_plan(_cfg(MAIN), hf).stages  # the pass does not run
    assert plain.logprob_pass == 0.0


def test_a_budget_below_the_longest_sample_fails_the_layout_check():
    cfg = _cfg(MAIN)
    small = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_tokens_per_micro_batch=16_384))
    failed = [c.message for c in layout_checks(small, cfg.hf_config(), Allocation.of(cfg)) if not c.ok]
    assert failed == ["trainer.max_tokens_per_micro_batch=16384 cannot hold the longest sample, "
                      "data.max_prompt_tokens + rollout.max_new_tokens − 1 = 18431 positions"]


# ------------------------------------------------------------------ micro-batches, imbalance, useful tokens
COSTS = [9, 7, 6, 5, 4, 3, 2, 1]  # 37 positions
LINEAR = CostModel(attention_span=1e18)  # a cost equal to the positions (to 1e-16), for hand computation


def test_hand_computed_packed_pass():
    # the trainer's shares, 4 samples each (LPT with equal counts): 9→0, 7→1, 6→1 (13), 5→0 (14), 4→1 (17),
    # 3→0 (17), 2→0 (tie: lowest; 19), 1→1 (18); M = 2 on both (ceil(19 / 10)): rank 0 spreads
    # [9, 5, 3, 2] over 2 bins as [5, 3, 2] = 10, [9]; rank 1 [6, 4] = 10, [7, 1] (costliest first)
    alone = packed_pass(COSTS, dp=2, budget=10, pad=1, groups=[[0], [1]], cost=LINEAR)
    assert (alone.micro_batches, alone.real, alone.paid) == (2, 37, [19, 18])
    assert alone.useful == 1.0 and alone.imbalance == pytest.approx(19 / 18.5)
    # in lockstep the j-th micro-batches (largest first: 10 | 10, then 9 | 8) pay the larger
    lockstep = packed_pass(COSTS, dp=2, budget=10, pad=1, groups=[[0, 1]], cost=LINEAR)
    assert lockstep.paid == [19, 19] and lockstep.useful == pytest.approx(37 / 38) and lockstep.imbalance == 1.0
    # padded to multiples of 4: bins of 10, 9 | 10, 8 pay 12, 12 | 12, 8
    assert packed_pass(COSTS, dp=2, budget=10, pad=4, groups=[[0], [1]], cost=LINEAR).paid == [24, 20]


def test_hand_computed_padded_pass():
    # contiguous shares [9, 7, 6, 5] | [4, 3, 2, 1]; micro-batches of 2 pay 2 × their longest: 18, 12 | 8, 4
    alone = padded_pass(COSTS, dp=2, micro_batch_size=2, pad=1, groups=[[0], [1]], cost=LINEAR)
    assert (alone.micro_batches, alone.paid) == (2, [30, 12])
    assert alone.useful == pytest.approx(37 / 42) and alone.imbalance == pytest.approx(30 / 21)
    lockstep = padded_pass(COSTS, dp=2, micro_batch_size=2, pad=1, groups=[[0, 1]], cost=LINEAR)
    assert lockstep.paid == [30, 30] and lockstep.useful == pytest.approx(37 / 60) and lockstep.imbalance == 1.0
    rounded = padded_pass(COSTS, dp=2, micro_batch_size=2, pad=4, groups=[[0], [1]], cost=LINEAR)
    assert rounded.paid == [2 * 12 + 2 * 8, 2 * 4 + 2 * 4]


def test_identical_samples_are_balanced_and_packs_that_divide_the_budget_waste_nothing():
    costs = [100] * 64
    for groups in ([[r] for r in range(8)], [[0, 1, 2, 3], [4, 5, 6, 7]]):
        packed = packed_pass(costs, dp=8, budget=400, pad=4, groups=groups, cost=LINEAR)
        assert (packed.micro_batches, packed.imbalance, packed.useful) == (2, 1.0, 1.0)  # 8 samples a rank, 4 a pack
        padded = padded_pass(costs, dp=8, micro_batch_size=3, pad=1, groups=groups, cost=LINEAR)
        assert (padded.micro_batches, padded.imbalance, padded.useful) == (3, 1.0, 1.0)  # 3 + 3 + 2 samples
    # a budget the samples do not divide: 3 a pack, 3 packs a rank, nothing paid for padding
    ragged = packed_pass(costs, dp=8, budget=350, pad=1, groups=[[r] for r in range(8)], cost=LINEAR)
    assert (ragged.micro_batches, ragged.useful, ragged.imbalance) == (3, 1.0, 1.0)


def test_every_rank_runs_as_many_micro_batches_even_when_one_holds_long_samples():
    # equal counts: rank 0 [9, 9, 1], rank 1 [9, 1, 1]; two 9s need 2 packs, so rank 1 runs 2 too: [9], [1, 1]
    result = packed_pass([9, 9, 9, 1, 1, 1], dp=2, budget=10, pad=1, groups=[[0], [1]], cost=LINEAR)
    assert result.micro_batches == 2 and result.paid == [19, 11] and result.imbalance == pytest.approx(19 / 15)
    # samples over half the budget cannot share: 3 of 6 on a rank need 3 micro-batches
    assert packed_pass([6] * 6, dp=2, budget=10, pad=1, groups=[[0], [1]], cost=LINEAR).micro_batches == 3


def test_lockstep_groups_follow_megatrons_rank_order():
    # tp 4 × dp 8, ep 8: an expert group is 8 consecutive ranks, two DP ranks of 4
    assert lockstep_groups(ParallelConfig(tp=4, ep=8), 32, moe=True) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # tp 4 × pp 3 × dp 2, ep 8: a stage's 8 ranks are one expert group
    assert lockstep_groups(ParallelConfig(tp=4, pp=3, ep=8), 24, moe=True) == [[0, 1]]
    assert lockstep_groups(ParallelConfig(ep=8), 8, moe=True) == [list(range(8))]
    assert lockstep_groups(ParallelConfig(ep=4), 8, moe=True) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lockstep_groups(ParallelConfig(tp=2), 8, moe=False) == [[0], [1], [2], [3]]  # dense: no all-to-all


def test_the_paper_distribution_draws_within_its_stated_bounds():
    rng = random.Random(1)
    draw = LENGTH_DISTRIBUTIONS["paper"].draw
    drawn = [draw(rng, 2048, 16_384) for _ in range(20_000)]
    assert all(50 <= p <= 300 and 256 <= r <= 16_384 for p, r in drawn)
    assert sum(r == 16_384 for _, r in drawn) / len(drawn) == pytest.approx(0.3, abs=0.015)
    # below the cap, log-uniform: half of them under the geometric mean √(256 · 16384) = 2048
    below = [r for _, r in drawn if r < 16_384]
    assert sum(r < 2048 for r in below) / len(below) == pytest.approx(0.5, abs=0.02)
    assert LENGTH_DISTRIBUTIONS["max"].draw(rng, 2048, 16_384) == (2048, 16_384)


def test_the_estimate_is_deterministic_and_exact_for_samples_at_the_caps():
    cfg = _cfg(MAIN)
    groups = lockstep_groups(cfg.parallel, 32, moe=True)
    cost = CostModel.of(cfg.hf_config())
    assert estimate_batches(cfg, dp=8, groups=groups, lengths="paper", cost=cost) == estimate_batches(
        cfg, dp=8, groups=groups, lengths="paper", cost=cost)
    worst = estimate_batches(cfg, dp=8, groups=groups, lengths="max", steps=1, cost=cost)
    mb, lp = worst.minibatch, worst.logprob
    assert worst.mean_positions == LONGEST_30B
    # 64 samples a rank: 64 padded rows of 18,432 (18,431 padded to tp 4), or 32 packs of two (36,862 → 36,864)
    assert (mb.padded.micro_batches, mb.packed.micro_batches, lp.padded.micro_batches, lp.packed.micro_batches) == (
        64, 32, 512, 256)
    assert mb.padded.useful == LONGEST_30B / 18_432 and mb.packed.useful == 2 * LONGEST_30B / 36_864
    assert mb.padded.imbalance == pytest.approx(1.0) and mb.packed.imbalance == pytest.approx(1.0)
    # without a budget, only the padded micro-batches
    assert estimate_batches(_cfg(MAIN, "trainer.max_tokens_per_micro_batch=0"), dp=8, groups=groups, cost=cost,
                            lengths="max", steps=1).minibatch.packed is None


def test_packing_pays_less_than_padding_for_the_paper_lengths():
    cfg = _cfg(MAIN)
    estimate = make_plan(cfg, cfg.hf_config(), lengths="paper").batches
    mb = estimate.minibatch
    # one sample per padded micro-batch: no padding inside one, but two DP ranks of an expert group
    # wait for the longer of their samples; packs are balanced across them
    assert mb.padded.micro_batches == 64 and mb.padded.useful < 0.75
    assert mb.packed.micro_batches < 20 and mb.packed.useful > 0.99 and mb.packed.imbalance < 1.01
    # at least the samples' total over the budget, at most one pack a sample
    assert 64 * estimate.mean_positions / 36_864 <= mb.packed.micro_batches <= 64


# ------------------------------------------------------------------ the recipes
@pytest.mark.parametrize("recipe", sorted(CONFIGS.glob("qwen3_*.yaml")), ids=lambda p: p.stem)
def test_recipes_pack_under_a_budget_that_holds_their_longest_sample(recipe):
    cfg = load_experiment(recipe, [])  # validates, the model's config included
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens - 1
    budget = cfg.trainer.max_tokens_per_micro_batch
    assert longest <= budget and budget % cfg.parallel.tp == 0
    assert make_plan(cfg, cfg.hf_config()).fits


def test_the_one_gpu_recipe_takes_a_budget_its_gpu_holds():
    """The one-GPU recipe packs 32,768 positions a micro-batch (2–3 a step instead of 8–9 at 8,192):
    its plan fits 80 GB with that budget, which is under what memory allows (≈ 39.7k by the
    measured activation terms) and a multiple of 4,096."""
    from bpo_megatron.planner.plan import largest_budget

    cfg = _cfg(CONFIGS / "qwen3_moe_1gpu.yaml")
    plan = make_plan(cfg, cfg.hf_config())
    budget = cfg.trainer.max_tokens_per_micro_batch
    assert budget == plan.tokens_per_micro_batch == 32_768 and budget % 4096 == 0
    assert plan.fits and plan.train_peak <= 80e9
    largest = largest_budget(plan)
    assert budget <= largest < budget + 2 * 4096
    assert f"memory allows trainer.max_tokens_per_micro_batch up to {largest}" in format_plan(plan)


@pytest.mark.parametrize("recipe", [MAIN, DISAGGREGATED], ids=["colocated", "disaggregated"])
def test_both_30b_recipes_fit_with_the_budget_and_print_the_estimate(recipe, capsys):
    from bpo_megatron.cli import main

    assert main(["plan", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "packed micro-batches of ≤ 36864 input positions (trainer.max_tokens_per_micro_batch" in out
    assert "packed into micro-batches of ≤ 36864 positions that hold the longest sample (18431)" in out
    assert "micro-batches per DP rank, lengths paper" in out and "packed (≤ 36864)" in out
    assert "R3 routed experts and router ids (the micro-batches in flight)" in out
    assert "verdict: FITS" in out and "FAIL" not in out
    assert main(["plan", str(recipe), "--lengths", "max"]) == 0
    assert "lengths max: every sample at the caps, 2048 + 16384 tokens" in capsys.readouterr().out


def test_the_largest_budget_is_where_training_memory_meets_the_gpu():
    cfg = _cfg(MAIN)
    from bpo_megatron.planner.plan import largest_budget

    plan = make_plan(cfg, cfg.hf_config())
    largest = largest_budget(plan)
    assert largest % 4 == 0 and largest > 36_864

    def peak(budget: int) -> float:
        return make_plan(_cfg(MAIN, f"trainer.max_tokens_per_micro_batch={budget}"), cfg.hf_config()).train_peak

    assert peak(largest) <= 80e9 < peak(largest + 4)
    assert f"memory allows trainer.max_tokens_per_micro_batch up to {largest} (the longest sample needs 18431)" in (
        format_plan(plan))
    # on a GPU that cannot hold even the static memory and one longest sample, none
    small = make_plan(cfg, cfg.hf_config(), Allocation(nodes=4, gpus_per_node=8, gpu_memory_gb=40))
    assert largest_budget(small) is None
    assert "no token budget fits" in format_plan(small)


# ------------------------------------------------------------------ the planner runs the trainer's balancer
def _trainer_packs(positions: list[int], budget: int, span: float) -> list[int]:
    """On each rank of a gloo world: what the trainer does with a minibatch of these lengths, the
    driver's shares (``data_parallel_shares``) and this rank's packs agreed with the others
    (``packs_in_lockstep`` over the world); the packs' positions, costliest first."""
    import torch
    import torch.distributed as dist

    from bpo_megatron.trainer.balance import data_parallel_shares, packs_in_lockstep
    from bpo_megatron.trainer.samples import TrainSample

    torch.set_num_threads(1)
    samples = [TrainSample(tokens=torch.zeros(n + 1, dtype=torch.long), response_start=1,
                           rollout_logprobs=torch.full((n,), -1.0), advantage=1.0) for n in positions]
    cost = CostModel(attention_span=span)
    share = data_parallel_shares(samples, dist.get_world_size(), budget=budget, cost=cost)[dist.get_rank()]
    bins = packs_in_lockstep([samples[i] for i in share], budget, cost, group=dist.group.WORLD)
    return [sum(positions[share[i]] for i in b) for b in bins]


def test_the_planner_and_the_trainer_pack_the_paper_lengths_alike():
    """`plan --lengths paper` counts the micro-batches the trainer runs: on minibatches drawn as the
    planner draws them (the 30B recipe's caps and model), the trainer's own balancer over 4 gloo
    ranks makes as many packs per rank, of the same positions, as the planner's estimate."""
    from bpo_megatron.parallel.local_world import run_gloo_world

    cfg = _cfg(MAIN)
    cost = CostModel.of(cfg.hf_config())
    draw, rng = LENGTH_DISTRIBUTIONS["paper"].draw, random.Random(0)
    budget, dp = cfg.trainer.max_tokens_per_micro_batch, 4
    for count in (64, 24):
        positions = [sum(draw(rng, cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens)) - 1 for _ in range(count)]
        planned = packed_pass(positions, dp=dp, budget=budget, pad=1, groups=[[r] for r in range(dp)], cost=cost)
        ranks = run_gloo_world(_trainer_packs, dp, positions, budget, cost.attention_span, timeout=120)
        assert {len(packs) for packs in ranks} == {planned.micro_batches} and planned.micro_batches >= 2
        assert [sum(packs) for packs in ranks] == planned.paid  # each rank its own group: it pays its packs
