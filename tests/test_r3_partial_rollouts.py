"""R3 under partial rollouts: the response tokens whose recorded routing is not the routing that
sampled them (SGLang re-prefills a request a weight update paused, ``Sample.routing_valid``) are
left out of training and counted; the policy loss, its gradient and its normalisation see them as
they see prompt tokens. And what π_old is under train.async (the weights at the step's start)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from bpo_megatron import testing as th
from bpo_megatron.losses import AGGREGATIONS, BatchTotals, PolicyLossConfig, compute_policy_loss
from bpo_megatron.loop.samples import training_samples
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.rollout import Sample
from bpo_megatron.trainer.samples import TrainSample

TIMEOUT = 180


# ------------------------------------------------------------------------------ the loop side
def _sample(prompt: int, versions: list[int], valid: list[bool] | None, *, routing: bool = True) -> Sample:
    length = len(versions)
    return Sample(request_id=f"p{prompt}", index=0, prompt_tokens=torch.arange(1, prompt + 1),
                  response_tokens=torch.arange(10, 10 + length), rollout_logprobs=torch.full((length,), -1.0),
                  finish_reason="stop",
                  routed_experts=torch.zeros(prompt + length - 1, 1, 2, dtype=torch.uint8) if routing else None,
                  weight_version=min(versions), token_versions=torch.tensor(versions),
                  routing_valid=None if valid is None else torch.tensor(valid))


def test_tokens_sampled_with_other_routing_are_masked_and_counted_under_r3():
    """4 responses of 4 + 2 + 3 + 5 = 14 tokens; SGLang marked 2 + 2 of them (versions before the
    last); the embedded engine's partial rollout (no marks: it keeps the routing it sampled with)
    and a one-version response train every token."""
    samples = [_sample(3, [0, 0, 1, 1], [False, False, True, True]),
               _sample(2, [0, 1], [False, True]),
               _sample(2, [0, 1, 1], None),  # the embedded engine: routing kept across the update
               _sample(4, [1] * 5, None)]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    train, metrics = training_samples(samples, rewards, 2, keep_routing=True, asynchronous=True)
    assert [None if t.train_mask is None else t.train_mask.tolist() for t in train] == [
        [False, False, True, True], [False, True], None, None]
    assert [t.num_train_tokens for t in train] == [2, 1, 3, 5]
    assert metrics["async/r3_masked_frac"] == 3 / 14

    _, nothing_masked = training_samples(samples[2:], rewards[2:], 2, keep_routing=True, asynchronous=True)
    assert nothing_masked["async/r3_masked_frac"] == 0.0
    # without R3 the trainer routes on its own: nothing to mask, no metric
    free, without_r3 = training_samples(samples, rewards, 2, keep_routing=False, asynchronous=True)
    assert all(t.train_mask is None for t in free) and "async/r3_masked_frac" not in without_r3
    # the synchronous loop's metrics stay what they were
    _, synchronous = training_samples(samples, rewards, 2, keep_routing=True, asynchronous=False)
    assert not any(key.startswith("async/") for key in synchronous)


def test_the_entropy_proxy_is_the_mean_surprisal_of_the_models_own_tokens():
    """rollout/neg_log_mu_mean: the mean −log μ over every sampled token of the batch (tokens, not
    responses, weigh alike); a tool's tokens carry no μ and are left out."""
    first = dataclasses.replace(_sample(2, [0, 0, 0], None), rollout_logprobs=torch.tensor([-0.5, -1.0, -2.5]))
    second = dataclasses.replace(_sample(2, [0], None), rollout_logprobs=torch.tensor([-4.0]))
    _, metrics = training_samples([first, second], torch.tensor([1.0, 0.0]), 2, keep_routing=False)
    assert metrics["rollout/neg_log_mu_mean"] == pytest.approx((0.5 + 1.0 + 2.5 + 4.0) / 4)
    with_tool = dataclasses.replace(first, rollout_logprobs=torch.tensor([-0.5, 0.0, -2.5]),
                                    from_environment=torch.tensor([False, True, False]))
    _, metrics = training_samples([with_tool, second], torch.tensor([1.0, 0.0]), 2, keep_routing=False)
    assert metrics["rollout/neg_log_mu_mean"] == pytest.approx((0.5 + 2.5 + 4.0) / 3)


# ------------------------------------------------------------------------------ the loss side
@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_a_response_masked_entirely_contributes_nothing_and_no_nan(agg):
    """Row 1 has every response token masked: the loss, its gradient and its metrics are those of
    row 0 alone (its sequence counts in no denominator), all finite."""
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.7, -1.1]], dtype=torch.float64, requires_grad=True)
    mu = torch.tensor([[-1.1, -0.4, -2.2], [-0.2, -0.9, -1.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [False, False, False]])
    cfg = PolicyLossConfig(name="grpo", agg=agg)
    loss, metrics = compute_policy_loss(logp, mu, adv, mask, cfg, totals=BatchTotals.of(mask))
    loss.backward()
    alone = logp.detach()[:1].clone().requires_grad_(True)
    ref, ref_metrics = compute_policy_loss(alone, mu[:1], adv[:1], mask[:1], cfg)
    ref.backward()
    assert math.isfinite(float(loss.detach())) and float(loss.detach()) == float(ref.detach())
    assert torch.equal(logp.grad[0], alone.grad[0]) and torch.equal(logp.grad[1], torch.zeros(3, dtype=torch.float64))
    assert metrics == ref_metrics
    everything = compute_policy_loss(logp.detach(), mu, adv, torch.zeros_like(mask), cfg)
    assert float(everything[0]) == 0.0 and all(math.isfinite(v) for v in everything[1].values())


# --------------------------------------------------------------------------- the trainer side
def _batch(seed: int) -> tuple[list[TrainSample], list[TrainSample], list[TrainSample]]:
    """Four samples (prompts of 3, responses of 5), R3 routing, advantages of both signs, as three
    batches: ``masked`` (sample 0's first two response tokens masked, samples 2 and 3 masked
    entirely), ``by_prompt`` (those two tokens of sample 0 moved into its prompt, samples 2 and 3
    absent) and ``plain`` (no mask)."""
    hf = th.tiny_moe()
    gen = torch.Generator().manual_seed(seed)
    plain = []
    for i in range(4):
        tokens = torch.randint(0, hf.vocab_size, (8,), generator=gen)
        plain.append(TrainSample(tokens=tokens, response_start=3, rollout_logprobs=-torch.rand(5, generator=gen) - 1,
                                 advantage=(1.0, -0.5, 2.0, -1.0)[i],
                                 routed_experts=th.random_routing(7, hf, gen)))
    first = plain[0]
    masked = [TrainSample(**{**vars(first), "train_mask": torch.tensor([False, False, True, True, True])}),
              plain[1],
              *(TrainSample(**{**vars(s), "train_mask": torch.zeros(5, dtype=torch.bool)}) for s in plain[2:])]
    by_prompt = [TrainSample(**{**vars(first), "response_start": 5, "rollout_logprobs": first.rollout_logprobs[2:]}),
                 plain[1]]
    return masked, by_prompt, plain


def _train_on(batch_name: str, seed: int) -> dict:
    """One R3 training step from the actor's initial weights on one of :func:`_batch`'s batches."""
    masked, by_prompt, plain = _batch(seed)
    batch = {"masked": masked, "by_prompt": by_prompt, "plain": plain}[batch_name]
    actor = th.build_actor(replay=True, micro_batch_size=2, loss="grpo")
    before = th.flat_params(actor)
    metrics = actor.train_step(batch)
    after = th.flat_params(actor)
    actor.close()
    return {"before": before, "after": after, "metrics": metrics}


def _run_all(seed: int) -> dict:
    return {name: _train_on(name, seed) for name in ("masked", "by_prompt", "plain")}


@pytest.mark.timeout(TIMEOUT * 2)
def test_a_masked_token_changes_the_step_exactly_as_a_prompt_token_would():
    """The same initial weights and R3 step on (a) the batch with masked tokens and (b) the batch
    where those tokens are prompt tokens and the fully masked samples are absent: the same loss,
    loss statistics, gradient norm and updated weights, bit for bit. (c) Without the masks the
    step differs, so the masks do act."""
    (results,) = run_gloo_world(_run_all, 1, 5, timeout=TIMEOUT * 2)
    masked, by_prompt, plain = results["masked"], results["by_prompt"], results["plain"]
    assert all(torch.equal(masked["before"][k], by_prompt["before"][k]) for k in masked["before"])
    for key, value in by_prompt["metrics"].items():
        if key.endswith("_s"):  # timings
            continue
        assert masked["metrics"][key] == value or (key == "num_micro_batches"), (key, masked["metrics"][key], value)
    assert masked["metrics"]["num_tokens"] == 3 + 5
    assert all(math.isfinite(v) for v in masked["metrics"].values())
    for name, tensor in by_prompt["after"].items():
        assert torch.equal(masked["after"][name], tensor), name
    assert plain["metrics"]["num_tokens"] == 20 and plain["metrics"]["loss"] != masked["metrics"]["loss"]
    assert any(not torch.equal(plain["after"][k], masked["after"][k]) for k in masked["after"])
    assert any(not torch.equal(masked["after"][k], masked["before"][k]) for k in masked["after"])


# ------------------------------------------------------------------------------ π_old's anchor
def test_under_async_the_run_notes_that_pi_old_is_the_weights_at_the_steps_start(tmp_path):
    """A correction's ρ = π_old/μ under train.async carries staleness (decoupled PPO): the run's
    notes (printed once before it starts, and by --check) say so; the synchronous loop's do not."""
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.loop.preflight import decoupled_anchor_note, prepare, summary

    tis = ["loss.name=grpo", "loss.correction=tis", "train.recompute_old_logprobs=true"]
    demo = "configs/tiny_moe_cpu.yaml"
    stale = load_experiment(demo, [*tis, "train.async.max_staleness=2", "cluster.colocate=false",
                                   f"logging.run_dir={tmp_path / 'run'}"])
    note = decoupled_anchor_note(stale)
    assert "decoupled" in note and "weights at each step's start" in note and "ρ = π_old/μ" in note
    assert "loss.correction=tis" in note and "up to 2 updates older" in note and "mismatch_kl_k3" in note
    assert f"note: {note}" in summary(prepare(stale)).splitlines()
    assert decoupled_anchor_note(load_experiment(demo, tis, check_model=False)) is None
    assert decoupled_anchor_note(load_experiment(demo, ["train.async.max_staleness=1", "cluster.colocate=false"],
                                                 check_model=False)) is None  # no π_old recomputed


def test_compare_notes_the_methods_whose_pi_old_is_decoupled():
    """``compare --staleness``: GRPO + TIS at k > 0 anchors to the weights at the step's start,
    which results.md states under its tables; BPO (no π_old) and k = 0 are not named."""
    from bpo_megatron.commands.compare import decoupled_methods, variants
    from bpo_megatron.commands.runs_csv import EvalRow
    from bpo_megatron.experiment import load_experiment

    def rows(staleness):  # one evaluation of each run, π_old recomputed as its config says
        return [EvalRow(run=f"{variant.slug}-k{k}", method=variant.label, method_id=variant.slug, staleness=k, seed=1,
                        recompute_old_logprobs=load_experiment("configs/tiny_moe_cpu.yaml", [
                            *variant.overrides, f"train.async.max_staleness={k}", "cluster.colocate=false"],
                            check_model=False).train.recompute_old_logprobs,
                        step=0, dataset="procedural:add", eval_k=4, accuracy=0.0)
                for variant in variants(["bpo", "grpo_tis"], None) for k in staleness]

    assert decoupled_methods(rows([0, 2])) == ["GRPO + TIS"]
    assert decoupled_methods(rows([0])) == []
