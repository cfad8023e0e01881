"""Tier A, the exact mechanism test, in reduced form: exact returns, the sampler, per-seed
gradients, the negative control (every loss is policy gradient at π = μ) and one condition."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest
import torch

from bpo_megatron.algo import group_advantages

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "tier_a"))  # the experiment's code
import mechanism_report as report  # noqa: E402
from mechanism import (  # noqa: E402
    CONDITIONS,
    DEFAULT_METHODS,
    METHODS,
    Condition,
    Task,
    Training,
    exact_return_and_entropy,
    main,
    make_problem,
    minibatch_loss,
    sample,
    train,
)
from bpo_megatron.losses import POLICY_LOSSES, PolicyLossConfig, compute_policy_loss, register_policy_loss

TINY = Task(prompts=2, vocab=3, length=3, targets=2, prior=1.0)


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def plain_policy_gradient():
    """A loss with w = 1 and no mask, written here, not taken from the family."""
    name = "plain_pg_mechanism_test_only"
    register_policy_loss(name, "REINFORCE with the group baseline")(
        lambda terms, cfg: (torch.ones_like(terms.logprobs), torch.ones_like(terms.mask)))
    yield PolicyLossConfig(name=name)
    POLICY_LOSSES.pop(name)


def test_exact_return_and_entropy_match_enumeration_by_hand():
    problem = make_problem(TINY, seeds=3, seed=5)
    returns, entropies = exact_return_and_entropy(problem.initial_logits, problem)
    probs = torch.softmax(problem.initial_logits.double(), dim=-1)
    for s, x in itertools.product(range(3), range(TINY.prompts)):
        j = h = 0.0
        for code, y in enumerate(itertools.product(range(3), repeat=3)):
            states = [0, 1 + y[0], 1 + 3 + 3 * y[0] + y[1]]
            p = math.prod(float(probs[s, x, state, token]) for state, token in zip(states, y))
            j += p * float(problem.rewards[s, x, code])
            h -= p * math.log(p)
        assert problem.rewards[s, x].sum() == TINY.targets
        returns[s] -= j / TINY.prompts
        entropies[s] -= h / TINY.prompts
    assert returns.abs().max() < 1e-12 and entropies.abs().max() < 1e-12


def test_the_sampler_draws_from_mu_and_reports_its_log_probs():
    task = Task(prompts=1, vocab=3, length=2, targets=1)
    problem = make_problem(task, seeds=2, seed=1)
    rollout = sample(problem.initial_logits, task, group_size=30_000, gen=torch.Generator().manual_seed(2))
    log_pi = torch.log_softmax(problem.initial_logits.double(), dim=-1)
    want = (log_pi[:, 0, 0].unsqueeze(-1) + log_pi[:, 0, 1:4]).exp().flatten(1)  # [S, 9] by response code
    seen = torch.stack([torch.bincount(codes, minlength=9) for codes in rollout.codes]).double() / 30_000
    assert (seen - want).abs().max() < 0.01  # ≈ 4 standard errors at p ≈ 0.3
    assert torch.equal(rollout.states[..., 0], torch.zeros_like(rollout.states[..., 0]))
    assert torch.equal(rollout.states[..., 1], 1 + rollout.tokens[..., 0])
    s = torch.arange(2)[:, None, None]
    torch.testing.assert_close(rollout.log_mu.double(), log_pi[s, 0, rollout.states, rollout.tokens], rtol=0, atol=1e-6)


def test_each_seed_gets_exactly_its_own_loss_gradient():
    task = Task(prompts=4, vocab=4, length=3)
    problem = make_problem(task, seeds=3, seed=3)
    gen = torch.Generator().manual_seed(4)
    behaviour = problem.initial_logits + 0.3 * torch.randn(problem.initial_logits.shape, generator=gen)
    rollout = sample(behaviour, task, group_size=4, gen=gen)
    rewards = problem.rewards.gather(-1, rollout.codes.view(3, 4, 4)).view(3, 16)
    advantages = group_advantages(rewards.reshape(-1), 4).advantages.view(3, 16)
    rows = torch.tensor([0, 5, 6, 9, 15])
    cfg = PolicyLossConfig(name="grpo")
    logits = problem.initial_logits.clone().requires_grad_()
    minibatch_loss(logits, rollout, advantages, rows, 4, cfg)[0].backward()
    for seed in range(3):  # the same seed alone, through compute_policy_loss and log_softmax
        alone = problem.initial_logits[seed].clone().requires_grad_()
        log_pi = torch.log_softmax(alone, dim=-1)[(rows // 4)[:, None], rollout.states[seed, rows],
                                                   rollout.tokens[seed, rows]]
        loss, _ = compute_policy_loss(log_pi, rollout.log_mu[seed, rows], advantages[seed, rows],
                                      torch.ones_like(log_pi, dtype=torch.bool), cfg)
        loss.backward()
        torch.testing.assert_close(logits.grad[seed], alone.grad, rtol=1e-5, atol=1e-7)


CONTROL_TRAINING = Training(seeds=6, steps=5, group_size=8, lr=0.1)


def test_negative_control_every_loss_follows_policy_gradient(plain_policy_gradient):
    """One minibatch, fresh samples, exact engine: each update is taken at π = μ, so every loss
    (BPO at ε = 0.1 and 1e3, GRPO-CH, dual-clip, CISPO, DPPO, GSPO, SAPO, the decompositions)
    gives the trajectory of plain policy gradient."""
    control = CONDITIONS["control"]
    reference = train(plain_policy_gradient, control, CONTROL_TRAINING)
    assert reference.returns[-1].mean() > reference.returns[0].mean()
    losses = [METHODS[m].loss for m in METHODS] + [PolicyLossConfig(name=n) for n in POLICY_LOSSES]
    for loss in losses:
        got = train(loss, control, CONTROL_TRAINING)
        assert (got.returns - reference.returns).abs().max() <= 1e-6, loss
        assert (got.entropies - reference.entropies).abs().max() <= 1e-6, loss
        assert got.metrics["clip_frac"] == 0.0 and got.metrics["weight_max"] == 1.0, loss


def test_the_control_is_not_vacuous_once_pi_leaves_mu(plain_policy_gradient):
    """With 8 minibatches, stale samples or engine noise the methods part ways."""
    for condition in (CONDITIONS["minibatch8"], CONDITIONS["stale4"], CONDITIONS["noise0.3"]):
        bpo, grpo = (train(METHODS[m].loss, condition, CONTROL_TRAINING) for m in ("bpo", "grpo"))
        assert (bpo.returns[-1] - grpo.returns[-1]).abs().max() > 1e-4, condition
        assert bpo.metrics["abs_logp_diff_mean"] > 0


def test_staleness_samples_from_the_policy_k_steps_before():
    # every step of the first k + 1 samples from the initial policy: after one step, k = 4 and
    # the control agree (the same responses, one update at π = μ); after two they differ
    one = Training(seeds=4, steps=1, lr=0.1)
    fresh, stale = (train(METHODS["grpo"].loss, CONDITIONS[c], one) for c in ("control", "stale4"))
    assert torch.equal(fresh.returns, stale.returns)
    two = Training(seeds=4, steps=2, lr=0.1)
    fresh, stale = (train(METHODS["grpo"].loss, CONDITIONS[c], two) for c in ("control", "stale4"))
    assert not torch.equal(fresh.returns[-1], stale.returns[-1])


def test_reduced_run_of_one_condition_every_method_learns(tmp_path):
    training = Training(seeds=16, steps=12, lr=0.1)
    condition = CONDITIONS["rare_minibatch8"]
    trajectories = {("rare_minibatch8", m): train(METHODS[m].loss, condition, training) for m in DEFAULT_METHODS}
    results = report.results_from_trajectories(trajectories, {m: METHODS[m].label for m in DEFAULT_METHODS})
    for (_, method), values in results.per_seed.items():
        gain, half = report.t_interval([b - a for a, b in zip(values["initial_J"], values["final_J"])])
        assert gain - half > 0.05, (method, gain, half)  # J rises, every method, beyond its interval
        for name in ("final_J", "auc", "final_entropy"):
            mean, half = report.t_interval(values[name])
            assert math.isfinite(mean) and 0 < half < 1, (method, name)
        assert 0 < values["final_entropy"][0] < condition.task.length * math.log(condition.task.vocab)
    assert any(results.runs[key]["clip_frac"] > 0 for key in results.runs)  # the masks acted

    report.write_results(tmp_path, results)
    again = report.read_results(tmp_path)
    assert again.labels == results.labels and again.runs.keys() == results.runs.keys()
    for key, values in results.per_seed.items():
        for name, column in values.items():
            assert again.per_seed[key][name] == pytest.approx(column, rel=1e-6), (key, name)  # 7 digits kept
    tables = report.markdown_tables(again)
    assert all(METHODS[m].label in tables for m in DEFAULT_METHODS) and "16 seeds per cell" in tables


def test_t_quantiles_and_intervals():
    for df, want in ((1, 12.7062), (4, 2.7764), (9, 2.2622), (49, 2.0096), (199, 1.9720)):
        assert report.t_quantile(0.975, df) == pytest.approx(want, abs=1e-4)
    mean, half = report.t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0 and half == pytest.approx(2.7764 * math.sqrt(2.5) / math.sqrt(5), rel=1e-4)
    with pytest.raises(ValueError, match="at least 2"):
        report.t_interval([1.0])


def test_the_command_writes_and_resummarises(tmp_path, capsys):
    args = ["--seeds", "3", "--steps", "2", "--conditions", "control", "noise0.1", "--methods", "bpo", "grpo",
            "--out-dir", str(tmp_path)]
    assert main(args) == 0
    written = (tmp_path / "tables.md").read_text()
    assert {p.name for p in tmp_path.iterdir()} >= {"per_seed.csv", "runs.csv", "curves.csv", "tables.md"}
    assert main(["--summarise-only", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "tables.md").read_text() == written
    assert "| BPO | " in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, match", [
    (dict(optimizer="lion"), "Training.optimizer='lion' is unknown"),
    (dict(seeds=1), "seeds >= 2"),
])
def test_bad_training_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Training(**kwargs)


def test_bad_task_and_condition_are_refused():
    with pytest.raises(ValueError, match="Task.targets must be in"):
        Task(vocab=2, length=2, targets=4)
    with pytest.raises(ValueError, match="minibatches >= 1"):
        Condition(minibatches=0)
