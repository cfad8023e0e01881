"""The loss family: BPO and the baselines it is compared with, as (weight, mask) pairs.

With p = π(y_t), q = μ(y_t) and r = p/q (see DESIGN.md §2 and the paper, eq. 6 and §3):

=========  ==============================================  =============================================
name       weight w (stop-gradient)                         mask M = 0 when
=========  ==============================================  =============================================
bpo        min(ω, C), ω = (1+ε−q)/(1+ε−p)                   Â>0 and ω>1+ε_high, or Â<0 and ω<1−ε_low
grpo       r                                                Â>0 and r>1+ε_high, or Â<0 and r<1−ε_low
cispo      min(r, cap)                                      never
dppo_tv    min(r, c)                                        Â>0 and p−q>δ, or Â<0 and q−p>δ
dppo_kl    min(r, c)                                        KLbin(q‖p)>δ and (Â>0 and p>q, or Â<0 and p<q)
gspo       s_i = exp(mean_t(log p − log q)) per sequence    Â>0 and s_i>1+ε_high, or Â<0 and s_i<1−ε_low
=========  ==============================================  =============================================

Beyond the paper's comparison, the variants users expect from other frameworks, and the two
halves of BPO each paired with the other half of GRPO (to tell which half makes a difference):

======================  ===================================  ====================================================
name                    weight w (stop-gradient)             mask M = 0 when
======================  ===================================  ====================================================
grpo_dualclip           r                                    grpo's, or Â<0 and r>c (c = ``dual_clip_c``)
sapo                    4·σ(x)·σ(−x)·r, x = τ(r−1)            never (τ = τ_pos for Â>0, τ_neg otherwise)
bpo_mask_r_weight       r                                    bpo's (on the uncapped ω)
omega_weight_grpo_mask  min(ω, C)                            grpo's (on r)
======================  ===================================  ====================================================

BPO without its correction and mask needs no loss of its own: with ``bpo_eps=1e3``,
ω = (1001 − q)/(1001 − p) stays within 1/1000 of 1 for any p and q, inside the clip interval and
below the cap, so every token is kept with a weight of 1 to within 1e-3: plain policy gradient
with the group baseline.
"""

from __future__ import annotations

import torch

from bpo_megatron.losses.config import PolicyLossConfig
from bpo_megatron.losses.registry import register_policy_loss
from bpo_megatron.losses.terms import TokenTerms

Pair = tuple[torch.Tensor, torch.Tensor]


@register_policy_loss("bpo", "Bellman Policy Optimization: capped smoothed mismatch weight ω")
def bpo(terms: TokenTerms, cfg: PolicyLossConfig) -> Pair:
    smoothing = 1.0 + cfg.bpo_eps
    omega = (smoothing - terms.rollout_prob) / (smoothing - terms.prob)
    # The mask tests the uncapped ω, as in the paper's definition of M.
    keep = terms.clip_mask(omega, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    return omega.clamp(max=cfg.bpo_cap), keep


@register_policy_loss("grpo", "GRPO with asymmetric (Clip-Higher) PPO clipping")
def grpo(terms: TokenTerms, cfg: PolicyLossConfig) -> Pair:
    ratio = terms.ratio
    return ratio, terms.clip_mask(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)


@register_policy_loss("cispo", "CISPO: capped importance weight, no token dropped")
def cispo(terms: TokenTerms, cfg: PolicyLossConfig) -> Pair:
    return terms.ratio.clamp(max=cfg.cispo_cap), torch.ones_like(terms.mask)


@register_policy_loss("dppo_tv", "DPPO with a binary total-variation trust region")
def dppo_tv(terms: TokenTerms, cfg: PolicyLossConfig) -> Pair:
    shift = terms.prob - terms.rollout_prob
    dropped = (terms.positive & (shift > cfg.dppo_delta)) | (terms.negative & (-shift > cfg.dppo_delta))
    return terms.ratio.clamp(max=cfg.dppo_ratio_cap), ~dropped


def binary_kl(terms: TokenTerms) -> torch.Tensor:
    """KLbin(q‖p) = q log(q/p) + (1−q) log((1−q)/(1−p)), finite-safe at p or q = 1."""
    q = terms.rollout_prob
    one_minus_p = -torch.expm1(terms.logprobs.clamp(max=0.0))
    one_minus_q = -torch.expm1(terms.rollout_logprobs.clamp(max=0.0))
    head = q * (terms.rollout_logprobs - terms.logprobs)
    tail = torch.special.xlogy(one_minus_q, one_minus_q) - torch.special.xlogy(one_minus_q, one_minus_p)
    return torch.where(terms.mask, head + tail, 0.0)


@register_policy_loss("dppo_kl", "DPPO with a binary KL trust region")
def dppo_kl(terms: TokenTerms, cfg: PolicyLossConfig) -> Pair:
    outside = binary_kl(terms) > cfg.dppo_delta
    p, q = terms.prob, terms.rollout_prob
    dropped = outside & ((terms.positive & (p > q)) | (terms.negative & (p < q)))
    return terms.ratio.clamp(max=cfg.dppo_ratio_cap), ~dropped


@register_policy_loss("gspo", "GSPO: sequence-level ratio and clipping (token form s_i·p/sg(p))")
def gspo(terms: TokenTerms, cfg: PolicyLossConfig) -> Pair:
    mask = terms.mask.to(terms.log_ratio.dtype)
    tokens = mask.sum(dim=-1).clamp(min=1.0)
    seq_log_ratio = (terms.log_ratio * mask).sum(dim=-1) / tokens
    seq_ratio = torch.exp(seq_log_ratio).unsqueeze(-1).expand_as(terms.log_ratio)
    keep = terms.clip_mask(seq_ratio, 1.0 - cfg.gspo_eps_low, 1.0 + cfg.gspo_eps_high)
    return seq_ratio, keep


@register_policy_loss("grpo_dualclip", "GRPO-ClipHigher with dual-clip: Â<0 tokens with r > c dropped as well")
def grpo_dualclip(terms: TokenTerms, cfg: PolicyLossConfig) -> Pair:
    """Dual-clip PPO (Ye et al., 2020; verl's ``clip_ratio_c``). For Â<0 the token objective is
    max(min(r·Â, clip(r)·Â), c·Â): beyond r > c it is the constant c·Â, so the token gives no
    gradient, however far the update has pushed π above μ. Â>0 tokens are GRPO's."""
    ratio, keep = grpo(terms, cfg)
    return ratio, keep & ~(terms.negative & (ratio > cfg.dual_clip_c))


@register_policy_loss("sapo", "SAPO: a sigmoid gate on r instead of the hard clip, temperature by sign of Â")
def sapo(terms: TokenTerms, cfg: PolicyLossConfig) -> Pair:
    """Soft Adaptive Policy Optimization (Gao et al., Qwen team, 2025). The token objective is
    f(r)·Â with f(r) = (4/τ)·σ(τ(r − 1)), τ = τ_pos when Â>0 and τ_neg otherwise (published
    defaults 1.0 and 1.05; τ_neg > τ_pos damps negative-advantage tokens sooner). Its gradient is
    4·σ(x)·σ(−x)·r·Â·∇log π with x = τ(r − 1): the weight is exactly 1 at r = 1 and fades
    smoothly as r leaves 1, so no token is dropped outright."""
    tau = torch.full_like(terms.ratio, cfg.sapo_tau_neg).masked_fill(terms.positive, cfg.sapo_tau_pos)
    x = tau * (terms.ratio - 1.0)
    # σ(−x) rather than 1 − σ(x): exact where σ(x) rounds to 1
    gate = 4.0 * torch.sigmoid(x) * torch.sigmoid(-x)
    return gate * terms.ratio, torch.ones_like(terms.mask)


@register_policy_loss("bpo_mask_r_weight", "BPO's mask (on ω) with GRPO's weight r: BPO less its weight")
def bpo_mask_r_weight(terms: TokenTerms, cfg: PolicyLossConfig) -> Pair:
    _, keep = bpo(terms, cfg)
    return terms.ratio, keep


@register_policy_loss("omega_weight_grpo_mask", "BPO's weight min(ω, C) with GRPO's mask (on r): BPO less its mask")
def omega_weight_grpo_mask(terms: TokenTerms, cfg: PolicyLossConfig) -> Pair:
    weight, _ = bpo(terms, cfg)
    _, keep = grpo(terms, cfg)
    return weight, keep
