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
