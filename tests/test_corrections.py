"""Engine/trainer mismatch corrections (TIS, sequence-level MIS, IcePop) on top of any loss,
against their closed forms: the gradient of every token and the metrics they report."""

from __future__ import annotations

import math

import pytest
import torch

from bpo_megatron.losses import CorrectionConfig, PolicyLossConfig, compute_policy_loss

ADV = [1.0, -0.5]
LOGP = [[-1.0, -0.7, -2.0], [-0.4, -1.3, -9.0]]
OLD = [[-1.05, -0.6, -2.1], [-0.5, -1.25, -9.0]]  # log π_old: the trainer's log-probs of the behaviour weights
# log μ = log π_old − δ: behaviour log-ratios δ = log π_old − log μ per token
DELTA = [[0.1, 1.0, -0.9], [0.5, 0.6, 0.0]]
MASK = [[1, 1, 1], [1, 1, 0]]  # the last token of row 1 is padding


def _batch():
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    old = torch.tensor(OLD, dtype=torch.float64)
    mu = old - torch.tensor(DELTA, dtype=torch.float64)
    return logp, old, mu, torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK, dtype=torch.bool)


def _seq(row: int) -> float:
    return math.exp(sum(DELTA[row][k] for k in range(3) if MASK[row][k]))


def _correction_weight(name: str, row: int, t: int) -> float:
    """The correction's weight of one token, written from the formulas."""
    rho = math.exp(DELTA[row][t])
    return {"none": 1.0, "tis": min(rho, 2.0), "icepop": rho, "mis": _seq(row)}[name]


def _kept(name: str, row: int, t: int) -> bool:
    rho = math.exp(DELTA[row][t])
    return {"none": True, "tis": True, "icepop": 0.5 <= rho <= 5.0, "mis": _seq(row) <= 2.0}[name]


def _expected_correction(name: str, row: int, t: int) -> float:
    """The factor a token's gradient carries (0: dropped)."""
    return _correction_weight(name, row, t) if _kept(name, row, t) else 0.0


@pytest.mark.parametrize("correction", ["none", "tis", "mis", "icepop"])
def test_each_tokens_gradient_is_the_loss_weight_times_the_correction(correction):
    """CISPO (w = π/π_old, no mask, cap out of reach) and token-sum aggregation: the gradient of
    token t is −Â · (π/π_old) · c_t with c_t the correction's factor."""
    logp, old, mu, adv, mask = _batch()
    cfg = PolicyLossConfig(name="cispo", cispo_cap=100.0, agg="token-sum", correction=CorrectionConfig(name=correction))
    loss, metrics = compute_policy_loss(logp, mu, adv, mask, cfg, old_logprobs=old)
    loss.backward()
    for row in range(2):
        for t in range(3):
            expected = 0.0 if not MASK[row][t] else (
                -ADV[row] * math.exp(LOGP[row][t] - OLD[row][t]) * _expected_correction(correction, row, t))
            assert float(logp.grad[row, t]) == pytest.approx(expected, abs=1e-12), (row, t)
    tokens = [(r, t) for r in range(2) for t in range(3) if MASK[r][t]]
    assert metrics["correction_weight_mean"] == pytest.approx(
        sum(_correction_weight(correction, r, t) for r, t in tokens) / 5, abs=1e-12)
    assert metrics["correction_drop_frac"] == pytest.approx(sum(not _kept(correction, r, t) for r, t in tokens) / 5)
    assert metrics["mismatch_abs_logp_diff_mean"] == pytest.approx((0.1 + 1.0 + 0.9 + 0.5 + 0.6) / 5)
    k3 = [math.exp(d) - 1 - d for r in range(2) for t, d in enumerate(DELTA[r]) if MASK[r][t]]
    assert metrics["mismatch_kl_k3"] == pytest.approx(sum(k3) / 5)
    # the loss's own statistics are taken against π_old, not μ
    diffs = [abs(LOGP[r][t] - OLD[r][t]) for r in range(2) for t in range(3) if MASK[r][t]]
    assert metrics["abs_logp_diff_mean"] == pytest.approx(sum(diffs) / 5)


def test_the_corrections_drop_what_their_bounds_say():
    """TIS drops nothing (ρ = e capped at 2); IcePop drops the token with ρ = e^−0.9 < 0.5;
    sequence MIS drops row 1 (ρ_seq = e^1.1 ≈ 3.0 > 2) and keeps row 0 (e^0.2)."""
    assert _expected_correction("tis", 0, 1) == 2.0
    assert [_expected_correction("icepop", 0, t) == 0.0 for t in range(3)] == [False, False, True]
    assert _expected_correction("mis", 1, 0) == 0.0 and _expected_correction("mis", 0, 0) == pytest.approx(
        math.exp(0.2))


def test_grpo_masks_against_pi_old_then_the_correction_applies():
    """GRPO + TIS: the clip mask tests r = π/π_old (with ε_high = 0.05, row 0's tokens 0 and 2,
    r = e^0.05 and e^0.1 with Â > 0, are clipped; row 1's, Â < 0 and r ≥ 0.95, are not), and the
    kept tokens carry r · min(ρ, 2)."""
    logp, old, mu, adv, mask = _batch()
    cfg = PolicyLossConfig(name="grpo", agg="token-sum", correction=CorrectionConfig(name="tis"), eps_high=0.05)
    loss, metrics = compute_policy_loss(logp, mu, adv, mask, cfg, old_logprobs=old)
    loss.backward()
    for row in range(2):
        for t in range(3):
            if not MASK[row][t]:
                assert float(logp.grad[row, t]) == 0.0
                continue
            r = math.exp(LOGP[row][t] - OLD[row][t])
            clipped = (ADV[row] > 0 and r > 1.05) or (ADV[row] < 0 and r < 0.8)
            expected = 0.0 if clipped else -ADV[row] * r * _expected_correction("tis", row, t)
            assert float(logp.grad[row, t]) == pytest.approx(expected, abs=1e-12), (row, t)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)


def test_without_behaviour_logprobs_a_correction_is_refused_and_none_changes_nothing():
    logp, old, mu, adv, mask = _batch()
    with pytest.raises(ValueError, match="train.recompute_old_logprobs=true"):
        compute_policy_loss(logp, mu, adv, mask, PolicyLossConfig(correction=CorrectionConfig(name="tis")))
    plain, metrics = compute_policy_loss(logp, mu, adv, mask, PolicyLossConfig())
    assert "correction_weight_mean" not in metrics and "mismatch_kl_k3" not in metrics
    anchored, _ = compute_policy_loss(logp, old, adv, mask, PolicyLossConfig())
    same, _ = compute_policy_loss(logp, mu, adv, mask, PolicyLossConfig(), old_logprobs=old)
    assert float(same.detach()) == float(anchored.detach()) != float(plain.detach())  # none with π_old: the loss anchored to π_old


@pytest.mark.parametrize("fields, match", [
    ({"name": "is"}, "correction='is' is unknown"),
    ({"name": "tis", "tis_cap": 0.5}, "tis_cap must be >= 1"),
    ({"name": "icepop", "icepop_low": 1.5}, "icepop_low=1.5 and icepop_high=5.0"),
])
def test_bad_correction_settings_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        CorrectionConfig(**fields)


def test_a_correction_is_given_as_its_config_in_python():
    """YAML's ``loss.correction: tis`` is expanded by the config loader (one place); in Python the
    section is its dataclass, and anything else is refused naming it."""
    with pytest.raises(TypeError, match=r"must be a CorrectionConfig, e.g. CorrectionConfig\(name='tis'\)"):
        PolicyLossConfig(correction="tis")


def test_a_correction_without_recomputed_logprobs_is_refused_before_the_run(tmp_path):
    from bpo_megatron.config import ConfigError
    from bpo_megatron.experiment import load_experiment

    demo = "configs/tiny_moe_cpu.yaml"
    with pytest.raises(ConfigError, match=r"loss.correction=tis .*train.recompute_old_logprobs=true"):
        load_experiment(demo, ["loss.correction=tis"], check_model=False)
    cfg = load_experiment(demo, ["loss.name=grpo", "loss.correction=tis", "train.recompute_old_logprobs=true"],
                          check_model=False)
    assert (cfg.loss.name, cfg.loss.correction.name, cfg.model.options.routing_replay) == ("grpo", "tis", True)  # GRPO+TIS+R3


def test_grpo_tis_r3_is_one_recipe_that_fits_its_cluster():
    from pathlib import Path

    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.planner import make_plan

    configs = Path(__file__).resolve().parents[1] / "configs"
    cfg = load_experiment(configs / "qwen3_30b_a3b_grpo_tis.yaml")
    assert (cfg.name, cfg.loss.name, cfg.loss.correction.name, cfg.loss.correction.tis_cap) == ("qwen3_30b_a3b_grpo_tis", "grpo",
                                                                                 "tis", 2.0)
    assert cfg.train.recompute_old_logprobs and cfg.model.options.routing_replay
    grpo = load_experiment(configs / "qwen3_30b_a3b_grpo.yaml")
    assert (cfg.loss.eps_low, cfg.loss.eps_high) == (grpo.loss.eps_low, grpo.loss.eps_high)
    assert make_plan(cfg, cfg.hf_config()).fits
