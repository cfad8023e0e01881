"""Context parallelism over packed micro-batches (``parallel.cp``).

* The zigzag split of a packed row against a hand-computed example, and its inverse.
* The CP attention of the local spec against causal attention over each whole sample in plain
  torch (explicit softmax), forward and backward, at CP = 2 over gloo.
* The trainer at CP = 2 against CP = 1 on the same samples (R3 on, every policy loss × every
  aggregation, the mismatch corrections): loss, loss statistics, gradients, returned log-probs,
  entropies and recorded routing within fp32 rounding (the tolerances of
  ``test_packed_training``), with a sample longer than one rank's budget, alone and with TP = 2,
  EP = 2 or PP = 2; score centering likewise.
* The planner: CP's memory and communication terms, the budget as one rank's share, the
  suggested ``parallel.cp`` when a sample does not fit; experiments refused without packing.
"""

from __future__ import annotations

import math

import pytest
import torch

from bpo_megatron import testing as th
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.parallel.context import ContextSplit, unzigzag_index, zigzag_index
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.trainer.packing import check_fits, pack
from test_packed_training import BUDGET, CASES, POSITIONS, TIMEOUT, _train_every_loss, check_every_loss_alike

# Two samples of 8 and 4 positions at CP = 2 (chunks of 2 and 1): rank 0 keeps chunks 0 and 3
# of each, rank 1 chunks 1 and 2.
BOUNDS = [0, 8, 12]
HELD = {0: [0, 1, 6, 7, 8, 11], 1: [2, 3, 4, 5, 9, 10]}


def test_zigzag_index_keeps_a_chunk_from_each_end_of_every_sample():
    for rank, held in HELD.items():
        assert zigzag_index(BOUNDS, 2, rank).tolist() == held
    gathered = torch.tensor(HELD[0] + HELD[1])  # the ranks' rows, rank by rank
    unzigzag = unzigzag_index(BOUNDS, 2)
    assert unzigzag.tolist() == [0, 1, 6, 7, 8, 9, 2, 3, 4, 10, 11, 5]
    assert gathered[unzigzag].tolist() == list(range(12))
    # CP = 1 holds the row as it is; CP = 3 splits a segment of 12 into six chunks of 2
    assert zigzag_index([0, 6], 1, 0).tolist() == list(range(6))
    assert zigzag_index([0, 12], 3, 1).tolist() == [2, 3, 8, 9]
    with pytest.raises(ValueError, match="not a multiple of 2 × CP = 4"):
        zigzag_index([0, 6], 2, 0)


def test_each_chunk_attends_to_its_sample_up_to_its_own_end():
    split = ContextSplit.of(BOUNDS, 2, 1)  # rank 1: rows 2-3 and 4-5 of sample 0, 9 and 10 of sample 1
    assert split.query_bounds.tolist() == [0, 2, 4, 5, 6]
    # key prefixes: sample 0 up to rows 3 and 5, sample 1 up to rows 9 and 10
    prefixes = [list(range(0, 4)), list(range(0, 6)), list(range(8, 10)), list(range(8, 11))]
    assert split.key_bounds.tolist() == [0, 4, 10, 12, 15]
    gathered = torch.tensor(HELD[0] + HELD[1])
    assert gathered[split.key_source].tolist() == sum(prefixes, [])
    assert (split.max_query, split.max_key) == (2, 6)


def test_a_sample_longer_than_the_budget_fits_its_share_on_each_cp_rank():
    samples = th.samples_of_lengths((11, 3), (5, 2), seed=3, old_spread=0.0)
    with pytest.raises(ValueError, match="sample 0 has 11 input positions"):
        check_fits(samples, 8)
    check_fits(samples, 6, cp=2)  # 11 → 12 padded, 6 on each rank
    with pytest.raises(ValueError, match=r"has 11 input positions \(len\(tokens\) − 1 = 11, 6 on each of "
                                         r"parallel.cp=2 ranks\), more than .*=5: raise the budget to at least "
                                         r"its share, or parallel.cp"):
        check_fits(samples, 5, cp=2)
    # each sample padded to a multiple of 4, the row to a multiple of 4 × 2 for TP = 2: 12 + 4 = 16
    whole = pack(samples, pad_to_multiple=2)
    parts = [pack(samples, pad_to_multiple=2, cp_size=2, cp_rank=rank) for rank in range(2)]
    assert parts[0].cu_seqlens.tolist() == [0, 12, 16] and parts[0].max_seqlen == 12
    for rank, part in enumerate(parts):
        held = zigzag_index([0, 12, 16], 2, rank)
        assert part.shape == (1, 8) and torch.equal(part.split.held, held)
        rows = held[held < 11]  # sample 0's real positions on this rank
        assert torch.equal(part.input_ids[0, : len(rows)], whole.input_ids[0, rows])
        assert part.position_ids[0].tolist() == [p if p < 12 else p - 12 for p in held.tolist()]
        assert torch.equal(part.padded.loss_mask, whole.padded.loss_mask)  # the loss reads whole samples


def test_parallel_cp_is_validated_with_the_world():
    assert ParallelConfig(cp=2, tp=2).data_parallel_size(8) == 2
    with pytest.raises(ValueError, match="world size 3 is not divisible by parallel.tp × parallel.pp × parallel.cp = "
                                         "1 × 1 × 2"):
        ParallelConfig(cp=2).validate_world(3)
    with pytest.raises(ValueError, match="parallel.cp must be a positive integer"):
        ParallelConfig(cp=0)


def test_an_experiment_with_cp_needs_packed_micro_batches_that_hold_a_share_of_the_longest_sample():
    from bpo_megatron.config import ConfigError
    from bpo_megatron.experiment import load_experiment
    from conftest import DEMO

    with pytest.raises(ConfigError, match=r"parallel.cp=2 splits packed samples over its ranks: set "
                                          r"trainer.max_tokens_per_micro_batch"):
        load_experiment(DEMO, ["parallel.cp=2", "parallel.ep=1"])
    with pytest.raises(ConfigError, match="world size 2 is not divisible by parallel.tp × parallel.pp × parallel.cp"):
        load_experiment(DEMO, ["parallel.cp=2", "parallel.tp=2", "parallel.ep=1"])
    cfg = load_experiment(DEMO, ["parallel.cp=2", "parallel.ep=1", "trainer.max_tokens_per_micro_batch=4096"])
    assert cfg.data_parallel_size == 1
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens - 1
    share = -(-longest // 4) * 2  # padded to a multiple of 4, split in two
    with pytest.raises(ConfigError, match=f"input positions, {share} on each of parallel.cp=2 ranks; raise the "
                                          "budget or parallel.cp"):
        load_experiment(DEMO, ["parallel.cp=2", "parallel.ep=1", f"trainer.max_tokens_per_micro_batch={share - 1}"])
    load_experiment(DEMO, ["parallel.cp=2", "parallel.ep=1", f"trainer.max_tokens_per_micro_batch={share}"])


# ------------------------------------------------------------------------------ attention
def _reference_attention(q, k, v, bounds, scale):
    """Causal attention within each segment, explicit softmax in float64 ([t, heads, d]; GQA)."""
    out = []
    repeat = q.shape[1] // k.shape[1]
    for start, end in zip(bounds, bounds[1:]):
        qs, ks, vs = q[start:end].double(), k[start:end].double(), v[start:end].double()
        ks, vs = ks.repeat_interleave(repeat, dim=1), vs.repeat_interleave(repeat, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        n = end - start
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
    return torch.cat(out).float()


def _cp_attention_against_reference() -> dict:
    import torch.distributed as dist

    from bpo_megatron.models.context_attention import ContextParallelSeqParams, context_parallel_attention
    from bpo_megatron.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(ParallelConfig(cp=2), seed=0)
    rank = dist.get_rank()
    bounds = [0, 8, 20, 24]  # three samples: 8, 12 and 4 positions
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(24, heads, 8, generator=gen) for heads in (4, 2, 2))
    weight = torch.randn(24, 4, 8, generator=gen)
    scale = 8 ** -0.5
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = _reference_attention(*full, bounds, scale)
    (expected * weight).sum().backward()

    split = ContextSplit.of(bounds, 2, rank)
    local = [x[split.held].clone().requires_grad_() for x in (q, k, v)]
    params = ContextParallelSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(bounds, dtype=torch.int32),
                                      cu_seqlens_kv=torch.tensor(bounds, dtype=torch.int32), max_seqlen_q=12,
                                      max_seqlen_kv=12, split=split)
    out = context_parallel_attention(*local, params, scale=scale)
    (out.reshape(-1, 4, 8) * weight[split.held]).sum().backward()
    destroy_parallel()
    return {"out": float((out.reshape(-1, 4, 8) - expected[split.held]).abs().max()),
            "grads": [float((mine.grad - ref.grad[split.held]).abs().max()) for mine, ref in zip(local, full)],
            "scale": [float(ref.grad.abs().max()) for ref in full]}


@pytest.mark.timeout(TIMEOUT)
def test_cp_attention_equals_causal_attention_over_whole_samples_forward_and_backward():
    for report in run_gloo_world(_cp_attention_against_reference, 2, timeout=TIMEOUT):
        assert report["out"] < 1e-6, report
        # keys and values get the gradient of every rank's queries (summed over the CP group)
        for dev, scale in zip(report["grads"], report["scale"]):
            assert scale > 0.1 and dev < 1e-6 * scale, report


# ------------------------------------------------------------------------------ training
# CP = 2 budgets one rank's positions: 8 of them take the 11-position sample (6 a rank), which a
# budget of 8 refuses at CP = 1
CP_BUDGET = 8
assert max(POSITIONS) > CP_BUDGET >= max(-(-n // 4) * 2 for n in POSITIONS)
LAYOUTS = {  # name -> (world size, layout shared by both runs)
    "cp2": (2, {}),
    "cp2_tp2_sp": (4, dict(tp=2)),
    "cp2_ep2": (4, dict(ep=2)),
    "cp2_pp2": (4, dict(pp=2)),
}


@pytest.mark.timeout(TIMEOUT * 2)
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "cp2" else pytest.mark.ci) for n in LAYOUTS])
def test_cp2_trains_and_scores_every_loss_as_cp1(name):
    world, layout = LAYOUTS[name]
    modes = (("cp1", BUDGET, 2), ("cp2", CP_BUDGET, 2, {"cp": 2}))
    ranks = run_gloo_world(_train_every_loss, world, layout, modes=modes, timeout=TIMEOUT * 2)
    check_every_loss_alike(ranks, f"{name}: CP = 2 against CP = 1, {len(CASES)} losses on {world} ranks")


def _score_centering_at_cp(model_dir) -> dict:
    """Score centering (the sampler's top-k ids split with the tokens, their log-probs gathered
    back): the step's metrics and gradients at CP = 1 and CP = 2 from the same weights."""
    from bpo_megatron.losses import PolicyLossConfig
    from test_score_centering_training import K, _samples

    results = {}
    for cp, budget in ((1, BUDGET), (2, CP_BUDGET)):
        actor = th.build_actor(cp=cp, micro_batch_size=2, grad_clip=math.inf, weights=model_dir,
                               max_tokens_per_micro_batch=budget,
                               loss=PolicyLossConfig(score_centering=True, score_centering_top_k=K))
        metrics = actor.train_step(_samples(model_dir, perturb=0.8))
        results[cp] = (metrics, {n: p.main_grad.detach().clone() for n, p in actor.model.named_parameters()})
        actor.close()
    return results


@pytest.mark.timeout(TIMEOUT)
def test_score_centering_at_cp2_trains_as_at_cp1(tiny_checkpoint):
    model_dir = tiny_checkpoint("tiny_qwen3_moe", seed=4)
    for results in run_gloo_world(_score_centering_at_cp, 2, model_dir, timeout=TIMEOUT):
        (one, g1), (two, g2) = results[1], results[2]
        assert 0 < one["score_centering_head_mass"] <= 1 and one["score_centering_rho"] > 0
        for key in ("loss", "score_centering_rho", "score_centering_head_mass", "grad_norm"):
            assert two[key] == pytest.approx(one[key], rel=1e-6, abs=1e-9), key
        worst = max(float((g2[n] - g1[n]).abs().max()) / max(float(g1[n].abs().max()), 1e-12) for n in g1)
        assert worst < 4e-6  # test_packed_training's GRAD_RTOL


# ------------------------------------------------------------------------------ the planner
def test_the_plan_splits_samples_over_cp_and_counts_the_gathered_keys():
    from bpo_megatron.models import HFModelConfig
    from bpo_megatron.planner import make_plan
    from test_planner import QWEN3_30B, _recipe

    hf = HFModelConfig.load(QWEN3_30B)
    one, two = make_plan(_recipe(), hf), make_plan(_recipe("parallel.cp=2"), hf)
    assert (one.dp, two.dp, two.optimizer_dp) == (8, 4, 8)
    [a], [b] = one.stages, two.stages
    # the distributed optimizer shards over dp × cp: the same states a rank
    assert a.static == b.static and a.logits == b.logits
    # the budget counts one rank's positions (36864, a multiple of tp 4); with recompute full the one
    # rebuilt layer keeps the key prefixes and values: 2 B × 2 × 4 KV heads × 128 × (2 + ½) / tp 4 a token
    assert two.tokens_per_micro_batch == one.tokens_per_micro_batch == 36_864
    assert b.activations - a.activations == pytest.approx(36_864 * 2 * 2 * 4 * 128 * 2.5 / 4)
    # every other CP rank's 36864 keys and values, 48 layers
    assert (one.context_gather, two.context_gather) == (0.0, 36_864 * 2 * 2 * 4 * 128 / 4 * 48)
    assert two.fits


def test_the_plan_checks_one_rank_share_and_suggests_cp_when_a_sample_does_not_fit(capsys):
    from bpo_megatron.cli import main
    from test_planner import RECIPE_30B

    long = ["rollout.max_new_tokens=200000", "--gpu-memory-gb", "56"]
    # 2048 + 200000 − 1 positions: a budget of 50512 holds the share of each of 4 CP ranks, not the sample
    assert main(["plan", str(RECIPE_30B), *long, "trainer.max_tokens_per_micro_batch=50512"]) == 2
    out = "".join(capsys.readouterr())
    assert "rollout.max_new_tokens=200000 − 1 = 202047 input positions; raise the budget or parallel.cp" in out
    assert main(["plan", str(RECIPE_30B), *long, "trainer.max_tokens_per_micro_batch=202048"]) == 1
    out = capsys.readouterr().out
    assert ("no token budget fits: not even one of the longest sample (202047 positions) does; parallel.cp=4 fits "
            "it, 50512 positions a rank") in out
    assert main(["plan", str(RECIPE_30B), *long, "parallel.cp=4", "trainer.max_tokens_per_micro_batch=50512"]) == 0
    out = capsys.readouterr().out
    assert "tp 4 × pp 1 × cp 4 × dp 2" in out and "(202047 over cp 4: 50512 a rank)" in out
    assert "context parallel: each sample split over cp 4 ranks" in out and "verdict: FITS" in out
