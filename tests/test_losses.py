"""The policy-loss family against closed forms and independent references."""

from __future__ import annotations

import math

import pytest
import torch

from bpo_megatron.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    BatchTotals,
    PolicyLossConfig,
    compute_policy_loss,
    register_policy_loss,
)



@pytest.fixture(autouse=True)
def _float64_by_default():
    """Closed forms are compared at 1e-12, so build test tensors in float64."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


CFG = PolicyLossConfig()
EPS_HI, EPS_LO = 1.0 + CFG.eps_high, 1.0 - CFG.eps_low
NUDGE = 1e-3  # how far past a threshold the boundary tokens sit


# ---------------------------------------------------------------------------------------------
# Independent references of (w, M) per token, written from DESIGN.md §2 with plain math.
def binary_kl(q: float, p: float) -> float:
    def xlogy(x, y):
        return 0.0 if x == 0 else x * math.log(y)

    return xlogy(q, q) - xlogy(q, p) + xlogy(1 - q, 1 - q) - xlogy(1 - q, 1 - p)


def reference_weight_mask(name: str, p: float, q: float, adv: float, seq_ratio: float) -> tuple[float, int]:
    r = p / q
    pos, neg = adv > 0, adv < 0
    omega = (1 + CFG.bpo_eps - q) / (1 + CFG.bpo_eps - p)
    bpo_keep = int(not ((pos and omega > EPS_HI) or (neg and omega < EPS_LO)))
    grpo_keep = int(not ((pos and r > EPS_HI) or (neg and r < EPS_LO)))
    if name == "bpo":
        return min(omega, CFG.bpo_cap), bpo_keep
    if name == "grpo":
        return r, grpo_keep
    if name == "grpo_dualclip":
        return r, int(grpo_keep and not (neg and r > CFG.dual_clip_c))
    if name == "sapo":
        tau = CFG.sapo_tau_pos if pos else CFG.sapo_tau_neg
        gate = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
        return 4.0 * gate * (1.0 - gate) * r, 1
    if name == "bpo_mask_r_weight":
        return r, bpo_keep
    if name == "omega_weight_grpo_mask":
        return min(omega, CFG.bpo_cap), grpo_keep
    if name == "cispo":
        return min(r, CFG.cispo_cap), 1
    if name == "dppo_tv":
        dropped = (pos and p - q > CFG.dppo_delta) or (neg and q - p > CFG.dppo_delta)
        return min(r, CFG.dppo_ratio_cap), int(not dropped)
    if name == "dppo_kl":
        outside = binary_kl(q, p) > CFG.dppo_delta
        dropped = outside and ((pos and p > q) or (neg and p < q))
        return min(r, CFG.dppo_ratio_cap), int(not dropped)
    if name == "gspo":
        hi, lo = 1 + CFG.gspo_eps_high, 1 - CFG.gspo_eps_low
        return seq_ratio, int(not ((pos and seq_ratio > hi) or (neg and seq_ratio < lo)))
    raise AssertionError(name)


def solve_p(f, q: float, target: float, lo: float, hi: float) -> float:
    """Bisection for f(p, q) = target on [lo, hi] (f monotone there)."""
    f_lo = f(lo, q) - target
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if (f(mid, q) - target > 0) == (f_lo > 0):
            lo, f_lo = mid, f(mid, q) - target
        else:
            hi = mid
    return 0.5 * (lo + hi)


def boundary_tokens(name: str) -> list[tuple[float, float, float]]:
    """(p, q, Â) pairs sitting just inside and just outside every mask threshold of ``name``."""
    q = 0.4
    omega = lambda p, q: (1 + CFG.bpo_eps - q) / (1 + CFG.bpo_eps - p)  # noqa: E731
    ratio = lambda p, q: p / q  # noqa: E731
    shift = lambda p, q: p - q  # noqa: E731
    kl = lambda p, q: binary_kl(q, p)  # noqa: E731
    if name in ("bpo", "bpo_mask_r_weight"):
        measure, thresholds = omega, [(EPS_HI, +1.0), (EPS_LO, -1.0)]
    elif name in ("grpo", "cispo", "sapo", "omega_weight_grpo_mask"):
        measure, thresholds = ratio, [(EPS_HI, +1.0), (EPS_LO, -1.0)]
    elif name == "grpo_dualclip":  # the dual bound c needs a small μ for p = c·μ to be a probability
        tokens = []
        for value, adv, q_edge in ((EPS_HI, +1.0, q), (EPS_LO, -1.0, q), (CFG.dual_clip_c, -1.0, 0.2)):
            p_edge = value * q_edge
            tokens += [(p_edge - NUDGE, q_edge, adv), (p_edge + NUDGE, q_edge, adv)]
        return tokens
    elif name == "dppo_tv":
        measure, thresholds = shift, [(CFG.dppo_delta, +1.0), (-CFG.dppo_delta, -1.0)]
    elif name == "dppo_kl":
        tokens = []
        for adv, lo, hi in ((+1.0, q, 0.999), (-1.0, 1e-6, q)):  # p > q side, p < q side
            p_edge = solve_p(kl, q, CFG.dppo_delta, lo, hi)
            tokens += [(p_edge - NUDGE, q, adv), (p_edge + NUDGE, q, adv)]
        return tokens
    else:  # gspo: token-level values do not matter for the mask, the sequence ratio does
        return [(0.3, 0.3, 1.0), (0.6, 0.5, -1.0)]
    tokens = []
    for value, adv in thresholds:
        p_edge = solve_p(measure, q, value, 1e-6, 0.999)
        tokens += [(p_edge - NUDGE, q, adv), (p_edge + NUDGE, q, adv)]
    return tokens


def make_batch(name: str, seed: int = 0):
    """A [4, 6] batch: row 0 holds the boundary tokens, the rest random; ragged loss masks,
    one Â=0 row; padding positions hold NaN/inf log-probs that must not matter."""
    gen = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    p = torch.rand(B, T, generator=gen) * 0.9 + 0.05
    q = (p * torch.exp(torch.randn(B, T, generator=gen) * 0.3)).clamp(0.02, 0.98)
    adv = torch.tensor([1.0, -0.7, 1.3, 0.0])
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, :1] = False  # a prompt-like leading position
    adv_tok = adv.unsqueeze(-1).expand(B, T).clone()
    for t, (pt, qt, at) in enumerate(boundary_tokens(name)):
        p[0, t], q[0, t], adv_tok[0, t] = pt, qt, at
    lp, lq = torch.log(p), torch.log(q)
    lp[~mask] = float("nan")
    lq[~mask] = float("-inf")
    return lp, lq, adv_tok, mask


def normalisers(agg: str, mask: torch.Tensor, norm_length: int) -> torch.Tensor:
    tokens_per_seq = mask.sum(-1, keepdim=True).double()
    n_seq = float((tokens_per_seq > 0).sum())
    n_tok = float(mask.sum())
    ones = torch.ones(mask.shape)
    return {
        "token-mean": ones * n_tok,
        "token-sum": ones,
        "seq-mean-token-mean": tokens_per_seq.clamp(min=1) * n_seq * ones,
        "seq-mean-token-sum": ones * n_seq,
        "seq-mean-token-sum-norm": ones * n_seq * norm_length,
    }[agg]


def expected_grad(name, agg, lp, lq, adv, mask):
    B, T = lp.shape
    grad = torch.zeros(B, T)
    norm = normalisers(agg, mask, T)
    for b in range(B):
        m = mask[b]
        seq_ratio = math.exp(float((lp[b][m] - lq[b][m]).mean())) if m.any() else 1.0
        for t in range(T):
            if not m[t]:
                continue
            w, keep = reference_weight_mask(name, math.exp(lp[b, t]), math.exp(lq[b, t]), float(adv[b, t]), seq_ratio)
            grad[b, t] = -float(adv[b, t]) * keep * w / float(norm[b, t])
    return grad


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_gradient_is_the_closed_form(name, agg):
    lp, lq, adv, mask = make_batch(name)
    lp.requires_grad_()
    lq.requires_grad_()
    cfg = PolicyLossConfig(name=name, agg=agg)
    loss, metrics = compute_policy_loss(lp, lq, adv, mask, cfg)
    assert torch.isfinite(loss)
    loss.backward()
    want = expected_grad(name, agg, lp.detach(), lq.detach(), adv, mask)
    torch.testing.assert_close(lp.grad, want, rtol=1e-12, atol=1e-14)
    assert lq.grad is None, "rollout_logprobs must receive no gradient"
    assert metrics["num_tokens"] == float(mask.sum())


@pytest.mark.parametrize("name", ["bpo", "grpo", "dppo_tv", "dppo_kl"])
def test_boundary_tokens_fall_on_both_sides_of_the_mask(name):
    lp, lq, adv, mask = make_batch(name)
    lp.requires_grad_()
    compute_policy_loss(lp, lq, adv, mask, PolicyLossConfig(name=name, agg="token-sum"))[0].backward()
    row = lp.grad[0, :4]
    # each pair straddles one threshold, smaller p first: at the Â>0 threshold the larger p is
    # dropped, at the Â<0 threshold the smaller p is (the side that moves π further from μ)
    p = lp.detach()[0, :4].exp()
    assert p[0] < p[1] and p[2] < p[3]
    assert (row != 0).tolist() == [True, False, False, True]


@pytest.mark.parametrize("name", ["bpo_mask_r_weight", "omega_weight_grpo_mask", "grpo_dualclip"])
def test_decomposed_and_dual_clip_masks_fall_on_both_sides(name):
    lp, lq, adv, mask = make_batch(name)
    lp.requires_grad_()
    compute_policy_loss(lp, lq, adv, mask, PolicyLossConfig(name=name, agg="token-sum"))[0].backward()
    kept = (lp.grad[0] != 0).tolist()
    # pairs straddle ε_high (Â>0), ε_low (Â<0) and, for dual-clip, c (Â<0: the larger p is dropped)
    want = [True, False, False, True] + ([True, False] if name == "grpo_dualclip" else kept[4:])
    assert kept == want


def test_grpo_dualclip_is_gradient_equivalent_to_the_dual_clip_objective():
    """For Â<0: −max(min(rÂ, clip(r)Â), cÂ); for Â≥0: GRPO's −min(rÂ, clip(r)Â)."""
    gen = torch.Generator().manual_seed(8)
    lq = torch.log(torch.rand(6, 8, generator=gen) * 0.5 + 0.02)
    lp = (lq + torch.randn(6, 8, generator=gen) * 1.2).clamp(max=-1e-3).requires_grad_()
    adv = torch.tensor([1.0, -0.5, -1.5, 0.7, -2.0, 0.0])
    mask = torch.rand(6, 8, generator=gen) > 0.1
    loss, _ = compute_policy_loss(lp, lq, adv, mask, PolicyLossConfig(name="grpo_dualclip", agg="token-mean"))
    (ours,) = torch.autograd.grad(loss, lp)

    lp_ref = lp.detach().clone().requires_grad_()
    r = torch.exp(lp_ref - lq)
    a = adv.unsqueeze(-1)
    ppo = torch.minimum(r * a, r.clamp(1 - CFG.eps_low, 1 + CFG.eps_high) * a)
    objective = torch.where(a < 0, torch.maximum(ppo, CFG.dual_clip_c * a), ppo)
    (ref,) = torch.autograd.grad(-(objective * mask).sum() / mask.sum(), lp_ref)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-14)
    beyond = mask & (a < 0) & (r.detach() > CFG.dual_clip_c)
    assert beyond.any(), "the batch must hold negative-advantage tokens beyond c"
    assert not ours[beyond].any()


def test_sapo_is_gradient_equivalent_to_the_soft_gate_objective():
    """SAPO: −f(r)·Â with f(r) = (4/τ)·σ(τ(r − 1)), τ by sign of Â."""
    gen = torch.Generator().manual_seed(9)
    lq = torch.log(torch.rand(5, 7, generator=gen) * 0.9 + 0.05)
    lp = (lq + torch.randn(5, 7, generator=gen) * 0.6).clamp(max=-1e-3).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 2.0, -1.2, 0.0])
    mask = torch.rand(5, 7, generator=gen) > 0.2
    cfg = PolicyLossConfig(name="sapo", agg="seq-mean-token-mean", sapo_tau_pos=1.3, sapo_tau_neg=2.1)
    loss, metrics = compute_policy_loss(lp, lq, adv, mask, cfg)
    (ours,) = torch.autograd.grad(loss, lp)

    lp_ref = lp.detach().clone().requires_grad_()
    r = torch.exp(lp_ref - lq)
    a = adv.unsqueeze(-1)
    tau = torch.where(a > 0, 1.3, 2.1)
    f = 4.0 / tau * torch.sigmoid(tau * (r - 1.0))
    per_seq = (-(f * a) * mask).sum(-1) / mask.sum(-1)
    (ref,) = torch.autograd.grad(per_seq.mean(), lp_ref)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-14)
    assert metrics["clip_frac"] == 0.0


def test_sapo_gate_values():
    # r = 1: weight 1 for either sign; r = 2, τ = 1: 4σ(1)σ(−1)·2; the Â<0 side (τ_neg = 1.05) is lower
    lq = torch.log(torch.tensor([[0.2, 0.2, 0.2, 0.2]]))
    lp = torch.log(torch.tensor([[0.2, 0.4, 0.2, 0.4]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    _, metrics = compute_policy_loss(lp, lq, adv, torch.ones(1, 4), PolicyLossConfig(name="sapo", agg="token-sum"))
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    pos, neg = 4 * sig(1.0) * sig(-1.0) * 2, 4 * sig(1.05) * sig(-1.05) * 2
    assert neg < pos < 2.0
    assert metrics["weight_mean"] == pytest.approx((1.0 + pos + 1.0 + neg) / 4, rel=1e-12)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_on_policy_every_loss_is_plain_policy_gradient(name):
    """At π = μ every ratio is 1: each loss's weight is 1 and nothing is masked, so its gradient
    is −Â·∇log π (what makes the mechanism experiment's one-update control a test)."""
    gen = torch.Generator().manual_seed(10)
    lp = torch.log(torch.rand(4, 5, generator=gen) * 0.9 + 0.05).requires_grad_()
    adv = torch.tensor([1.0, -0.8, 0.3, -1.7])
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2, 3:] = False
    loss, metrics = compute_policy_loss(lp, lp.detach(), adv, mask, PolicyLossConfig(name=name, agg="token-sum"))
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, torch.where(mask, -adv.unsqueeze(-1), 0.0), rtol=0, atol=0)
    assert metrics["clip_frac"] == 0.0 and metrics["weight_max"] == 1.0


def test_bpo_with_a_large_eps_is_policy_gradient_without_mask():
    """``bpo_eps=1e3`` is BPO without correction or mask: ω ∈ [1000/1001, 1001/1000] for any
    p, q, inside the clip interval and below the cap, even far off-policy."""
    lp, lq, adv, mask = make_batch("grpo", seed=11)
    lp.requires_grad_()
    loss, metrics = compute_policy_loss(lp, lq, adv, mask, PolicyLossConfig(name="bpo", bpo_eps=1e3, agg="token-sum"))
    (grad,) = torch.autograd.grad(loss, lp)
    plain = torch.where(mask, -adv, 0.0)
    torch.testing.assert_close(grad, plain, rtol=1e-3, atol=0)
    assert metrics["clip_frac"] == 0.0
    assert abs(metrics["weight_max"] - 1.0) <= 1e-3


def test_gspo_sequence_clip_on_both_sides():
    hi, lo = 1 + CFG.gspo_eps_high, 1 - CFG.gspo_eps_low
    log_ratios = [math.log(hi) - 1e-4, math.log(hi) + 1e-4, math.log(lo) + 1e-4, math.log(lo) - 1e-4]
    lq = torch.full((4, 3), math.log(0.3))
    lp = (lq + torch.tensor(log_ratios).unsqueeze(-1)).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    compute_policy_loss(lp, lq, adv, torch.ones(4, 3), PolicyLossConfig(name="gspo"))[0].backward()
    assert (lp.grad.abs().sum(-1) > 0).tolist() == [True, False, True, False]


def test_grpo_is_gradient_equivalent_to_the_ppo_clip_objective():
    """Paper eq. 6: −Â·M·sg(r)·log π has the gradient of −min(rÂ, clip(r)Â)."""
    gen = torch.Generator().manual_seed(3)
    lq = torch.log(torch.rand(5, 7, generator=gen) * 0.9 + 0.05)
    lp = (lq + torch.randn(5, 7, generator=gen) * 0.4).clamp(max=-1e-3).requires_grad_()
    adv = torch.randn(5, generator=gen)
    mask = torch.rand(5, 7, generator=gen) > 0.2
    loss, _ = compute_policy_loss(lp, lq, adv, mask, PolicyLossConfig(name="grpo", agg="token-mean"))
    (ours,) = torch.autograd.grad(loss, lp)

    lp_ref = lp.detach().clone().requires_grad_()
    r = torch.exp(lp_ref - lq)
    a = adv.unsqueeze(-1)
    ppo = -torch.minimum(r * a, r.clamp(1 - CFG.eps_low, 1 + CFG.eps_high) * a)
    (ref,) = torch.autograd.grad((ppo * mask).sum() / mask.sum(), lp_ref)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-14)


def test_gspo_is_gradient_equivalent_to_the_sequence_objective():
    """GSPO: −min(s·Â, clip(s)·Â) with s = exp(mean_t log r), averaged over sequences."""
    gen = torch.Generator().manual_seed(4)
    lq = torch.log(torch.rand(6, 5, generator=gen) * 0.9 + 0.05)
    lp = (lq + torch.randn(6, 5, generator=gen) * 0.004).clamp(max=-1e-3).requires_grad_()
    adv = torch.randn(6, generator=gen)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[0, 3:] = False
    loss, _ = compute_policy_loss(lp, lq, adv, mask, PolicyLossConfig(name="gspo"))
    (ours,) = torch.autograd.grad(loss, lp)

    lp_ref = lp.detach().clone().requires_grad_()
    log_r = torch.where(mask, lp_ref - lq, 0.0)
    s = torch.exp(log_r.sum(-1) / mask.sum(-1))
    clipped = s.clamp(1 - CFG.gspo_eps_low, 1 + CFG.gspo_eps_high)
    objective = -torch.minimum(s * adv, clipped * adv).mean()
    (ref,) = torch.autograd.grad(objective, lp_ref)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-14)


def test_bpo_weight_values():
    # p=0.5, q=0.3, ε=0.1: ω = 0.8/0.6;  p=0.99, q=0.1: ω = 1.0/0.11 -> capped at C=3
    lp = torch.log(torch.tensor([[0.5, 0.99]])).requires_grad_()
    lq = torch.log(torch.tensor([[0.3, 0.1]]))
    loss, metrics = compute_policy_loss(lp, lq, torch.tensor([-2.0]), torch.ones(1, 2), PolicyLossConfig(agg="token-sum"))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[2.0 * 0.8 / 0.6, 2.0 * 3.0]]))
    assert metrics["weight_max"] == pytest.approx(3.0)
    assert metrics["weight_mean"] == pytest.approx((0.8 / 0.6 + 3.0) / 2)
    # with Â>0 both tokens have ω > 1.28 and are dropped
    _, metrics = compute_policy_loss(lp, lq, torch.tensor([2.0]), torch.ones(1, 2), PolicyLossConfig())
    assert metrics["clip_frac"] == 1.0 and metrics["clip_frac_pos"] == 1.0 and metrics["clip_frac_neg"] == 0.0


def test_metrics_values():
    p = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    q = torch.tensor([[0.5, 0.25, 0.5, 0.9]])
    lp, lq = p.log(), q.log()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    _, m = compute_policy_loss(lp, lq, adv, mask, PolicyLossConfig(name="grpo"))
    # ratios 1, 2, 1 over the mask: token 2 (Â>0, r=2) is dropped
    assert m["clip_frac"] == pytest.approx(1 / 3)
    assert m["clip_frac_pos"] == pytest.approx(1 / 2)
    assert m["clip_frac_neg"] == 0.0
    assert m["weight_mean"] == pytest.approx(4 / 3)
    assert m["weight_max"] == pytest.approx(2.0)
    assert m["abs_logp_diff_mean"] == pytest.approx(math.log(2) / 3)
    assert m["kl_k3"] == pytest.approx((2 - 1 - math.log(2)) / 3)
    # by μ: token 1 (Â>0, μ = 0.5: mid) kept, token 2 (Â>0, μ = 0.25: mid) dropped, token 3
    # (Â<0, μ = 0.5) kept; token 4 is off the mask; no token has μ < 0.2 or μ ≥ 0.9
    assert m["clip_frac_pos_mu_mid"] == pytest.approx(1 / 2) and m["clip_frac_neg_mu_mid"] == 0.0
    assert not {"clip_frac_pos_mu_low", "clip_frac_pos_mu_high", "clip_frac_neg_mu_low",
                "clip_frac_neg_mu_high"} & set(m)


def test_masked_shares_by_sign_and_rollout_probability_against_a_direct_count():
    lp, lq, adv, mask = make_batch("bpo", seed=11)
    _, m = compute_policy_loss(lp, lq, adv, mask, PolicyLossConfig(name="bpo"))
    # the mask of BPO recomputed from its definition: |ω − 1| beyond the band on the advantage's side
    p, q, a = lp.exp(), lq.exp(), adv
    omega = (1 - q + CFG.bpo_eps) / (1 - p + CFG.bpo_eps)
    dropped = torch.where(a > 0, omega > 1 + CFG.eps_high, omega < 1 - CFG.eps_low) & mask.bool()
    total = 0
    for sign, side in (("pos", a > 0), ("neg", a < 0)):
        for name, in_bin in (("low", q < 0.2), ("mid", (q >= 0.2) & (q < 0.9)), ("high", q >= 0.9)):
            tokens = side & in_bin & mask.bool()
            key = f"clip_frac_{sign}_mu_{name}"
            if tokens.any():
                assert m[key] == pytest.approx(float((dropped & tokens).sum() / tokens.sum())), key
                total += int(tokens.sum())
            else:
                assert key not in m
    assert total == int(((a != 0) & mask.bool()).sum())


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_split_batch_with_totals_sums_to_the_whole(agg):
    lp, lq, adv, mask = make_batch("bpo", seed=5)
    cfg = PolicyLossConfig(agg=agg, norm_length=6)
    whole, _ = compute_policy_loss(lp, lq, adv, mask, cfg)
    totals = BatchTotals.of(mask)
    parts = sum(
        compute_policy_loss(lp[s], lq[s], adv[s], mask[s], cfg, totals=totals)[0]
        for s in (slice(0, 1), slice(1, 4))
    )
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-14)


def test_advantages_per_response_equal_broadcast_per_token():
    lp, lq, _, mask = make_batch("bpo", seed=6)
    adv = torch.tensor([0.5, -1.0, 2.0, 0.0])
    a = compute_policy_loss(lp, lq, adv, mask, CFG)[0]
    b = compute_policy_loss(lp, lq, adv.unsqueeze(-1).expand(4, 6), mask, CFG)[0]
    assert float(a) == float(b)


def test_fully_masked_rows_and_zero_advantage_give_zero_gradient():
    lp = torch.log(torch.full((2, 3), 0.5)).requires_grad_()
    lq = lp.detach().clone()
    mask = torch.tensor([[0, 0, 0], [1, 1, 0]])
    loss, metrics = compute_policy_loss(lp, lq, torch.tensor([1.0, 0.0]), mask, CFG)
    loss.backward()
    assert loss.item() == 0.0 and not lp.grad.any()
    assert metrics["num_tokens"] == 2.0


def test_new_loss_is_a_few_lines():
    name = "unit_weight_test_only"

    @register_policy_loss(name, "plain policy gradient")
    def _pg(terms, cfg):
        return torch.ones_like(terms.logprobs), torch.ones_like(terms.mask)

    try:
        lp = torch.log(torch.tensor([[0.2, 0.4]])).requires_grad_()
        compute_policy_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2), PolicyLossConfig(name=name, agg="token-sum"))[0].backward()
        torch.testing.assert_close(lp.grad, -torch.ones(1, 2))
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss(name, "again")(_pg)
    finally:
        POLICY_LOSSES.pop(name)


# ---------------------------------------------------------------------------------------------
# Bad input: a ValueError that names the argument.
def _good():
    lp = torch.log(torch.full((2, 3), 0.5))
    return lp, lp.clone(), torch.ones(2), torch.ones(2, 3)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: (a[0][:, :2], *a[1:]), "rollout_logprobs shape"),
        (lambda a: (a[0], a[1][:1], *a[2:]), "rollout_logprobs shape"),
        (lambda a: (*a[:3], torch.ones(2, 4)), "loss_mask shape"),
        (lambda a: (a[0], a[1], torch.ones(3), a[3]), "advantages must have shape"),
        (lambda a: (a[0][0], a[1][0], a[2], a[3][0]), r"logprobs must have shape \[B, T\]"),
        (lambda a: (a[0].index_fill(1, torch.tensor([1]), float("nan")), *a[1:]), "logprobs has 2 non-finite"),
        (lambda a: (a[0], a[1].index_fill(1, torch.tensor([2]), float("inf")), *a[2:]), "rollout_logprobs has 2 non-finite"),
        (lambda a: (a[0] + 1.0, *a[1:]), "logprobs has 6 values > 0"),
        (lambda a: (a[0], a[1] + 1.0, *a[2:]), "rollout_logprobs has 6 values > 0"),
        (lambda a: (*a[:3], torch.full((2, 3), 2.0)), "loss_mask must hold only 0/1"),
        (lambda a: (a[0], a[1], torch.tensor([1.0, float("nan")]), a[3]), "advantages has non-finite"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(mutate, match):
    with pytest.raises(ValueError, match=match):
        compute_policy_loss(*mutate(_good()), CFG)


BAD_VALUES = [  # (logprobs, rollout_logprobs, advantages, old_logprobs) of a bad call -> its error
    (lambda a: (a[0].index_fill(1, torch.tensor([1]), float("nan")), *a[1:]), r"^logprobs has 2 non-finite .*\[0, 1\]"),
    (lambda a: (a[0], a[1].index_fill(1, torch.tensor([2]), float("inf")), *a[2:]), "^rollout_logprobs has 2 non-finite"),
    (lambda a: (a[0] + 1.0, *a[1:]), r"^logprobs has 6 values > 0 under loss_mask \(first at \[0, 0\]: 0.3069\)"),
    (lambda a: (a[0], a[1] + 1.0, *a[2:]), "^rollout_logprobs has 6 values > 0"),
    (lambda a: (a[0], a[1], torch.tensor([1.0, float("nan")]), a[3]), "^advantages has non-finite"),
    (lambda a: (*a[:3], a[3] + 1.0), "^old_logprobs has 6 values > 0"),
]


@pytest.mark.parametrize("mutate, match", BAD_VALUES)
def test_deferred_value_checks_read_once_and_raise_the_first_bad_calls_error(mutate, match):
    """A trainer's micro-batches leave the value checks to one DeferredChecks: the loss calls read
    nothing back from the device, and the one read before the update raises what the first bad
    call would have raised at once."""
    from bpo_megatron.bench.ops import _count
    from bpo_megatron.losses import DeferredChecks, policy_loss

    def good():
        lp = torch.log(torch.full((2, 3), 0.5))
        return lp, lp.clone(), torch.ones(2), lp.clone()

    def call(args, deferred=None):
        logprobs, rollout, advantages, old = args
        return policy_loss(logprobs, rollout, advantages, torch.ones(2, 3, dtype=torch.bool), CFG,
                           totals=BatchTotals(tokens=18.0, sequences=6.0), old_logprobs=old, deferred=deferred)

    with pytest.raises(ValueError, match=match):
        call(mutate(good()))  # at once, without deferring
    deferred = DeferredChecks()
    counts = _count(lambda: [call(args, deferred) for args in (good(), mutate(good()), good())])
    assert counts["scalar_reads"] == counts["data_shaped"] == counts["tolist_cpu"] == 0
    with pytest.raises(ValueError, match=match):
        deferred.raise_first()
    fine = DeferredChecks()
    call(good(), fine)
    assert _count(fine.raise_first)["scalar_reads"] == 1  # and no error


def test_nonfinite_values_off_the_mask_are_ignored():
    lp, lq, adv, _ = _good()
    lp[0, 2] = float("nan")
    lq[1, 0] = float("-inf")
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    loss, _ = compute_policy_loss(lp.requires_grad_(), lq, adv, mask, CFG)
    assert torch.isfinite(loss)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="ppo2"), "PolicyLossConfig.name='ppo2' is unknown"),
        (dict(agg="mean"), "PolicyLossConfig.agg='mean' is unknown"),
        (dict(bpo_eps=0.0), "PolicyLossConfig.bpo_eps must be > 0"),
        (dict(bpo_cap=-1.0), r"PolicyLossConfig.bpo_cap must be >= 1"),
        (dict(bpo_cap=0.5), r"PolicyLossConfig.bpo_cap must be >= 1 \(it caps the importance weight"),
        (dict(cispo_cap=0.9), r"PolicyLossConfig.cispo_cap must be >= 1"),
        (dict(dppo_ratio_cap=0.0), r"PolicyLossConfig.dppo_ratio_cap must be >= 1"),
        (dict(eps_low=1.0), r"PolicyLossConfig.eps_low must be in \[0, 1\)"),
        (dict(norm_length=0), "PolicyLossConfig.norm_length must be a positive"),
        (dict(dual_clip_c=1.0), r"PolicyLossConfig.dual_clip_c must be > 1 \(it bounds the ratio"),
        (dict(name="grpo_dualclip", dual_clip_c=0.5), r"PolicyLossConfig.dual_clip_c must be > 1"),
        (dict(sapo_tau_pos=0.0), "PolicyLossConfig.sapo_tau_pos must be > 0"),
        (dict(name="sapo", sapo_tau_neg=-1.05), "PolicyLossConfig.sapo_tau_neg must be > 0"),
    ],
)
def test_bad_config_is_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossConfig(**kwargs)


def test_off_policy_extremes_stay_finite():
    lp = torch.log(torch.tensor([[0.9, 1e-30]])).requires_grad_()
    lq = torch.log(torch.tensor([[1e-30, 0.9]]))
    for name in POLICY_LOSSES:
        loss, metrics = compute_policy_loss(lp, lq, torch.tensor([-1.0]), torch.ones(1, 2), PolicyLossConfig(name=name))
        assert math.isfinite(loss.item()), name
        assert all(math.isfinite(v) for v in metrics.values()), (name, metrics)


def test_a_step_averages_each_metric_over_the_updates_that_report_it():
    from bpo_megatron.loop.diagnostics import mean_over_minibatches

    updates = [{"grad_norm": 1.0, "clip_frac": 0.1, "weight_max": 2.0, "clip_frac_pos_mu_low": 0.5},
               {"grad_norm": 3.0, "clip_frac": 0.3, "weight_max": 1.5}]
    assert mean_over_minibatches(updates) == {"grad_norm": 2.0, "clip_frac": pytest.approx(0.2), "weight_max": 2.0,
                                              "clip_frac_pos_mu_low": 0.5, "grad_norm_max": 3.0}
