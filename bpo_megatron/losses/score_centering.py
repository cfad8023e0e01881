"""Score centering: an additive per-token term that cancels the drift between sampler and trainer.

Marek & Ryabinin, "Score Centering Stabilizes Off-policy Reinforcement Learning" (arXiv
2609.20807). Its abstract names the idea: a persistent bias between sampler and trainer (*drift*)
accumulates with every step, and an additive correction term cancels it; the body of the paper was
not available to us. What follows is derived here for the losses of this family. Where their
settings meet ours it gives the coefficients the peers ship: NeMo-RL's modes none/TIS/IcePop
(importance weights of the current π over μ, no clip in the coefficient: the π_old rows below at
π_old = π with w·M = 1; its documentation attributes the top-k estimator and tail model below to
the paper), SkyRL's PPO + TIS composition in the marin-community fork (the π_old + tis row, clip
included), prime-rl's IPO composition (the μ row, over the sampler's whole support).

**The drift.** At a position whose prefix is fixed the token ``y`` is drawn from the sampler's
distribution μ (after temperature and any top-k/top-p filter, renormalised), and the loss's update
there is ``Â · g(y) · ∇log π(y)``, with the stop-gradient coefficient

    g(y) = w(y) · M(y) · f(y) · K(y)

``w, M``: the loss's own weight and mask of the token against its *anchor* a (a = μ, the ratio
π/μ, without ``train.recompute_old_logprobs``; a = π_old, the ratio π/π_old, with it); ``f, K``:
the correction's weight and keep of π_old(y)/μ(y) (``loss.correction``; f = K = 1 for none). Then
``E_μ[Â g ∇log π] = E_μ[Â] · d + Cov_μ(Â, g ∇log π)`` with the drift ``d = Σ_v μ(v) g(v) ∇log π(v)``
the part of every update that does not depend on which token was good. Score centering subtracts
``Â · d`` at every position the loss trains — also where the loss or the correction drops the
sampled token: their masks are inside g, and the expectation runs over every token the sampler
could have drawn — so that ``E_μ[g(y) ∇log π(y) − d] = 0`` and the update keeps the covariance
only. Under a full importance weight (g = π/μ, no mask) d = Σ_v π(v)∇log π(v) = 0: such a loss has
no drift to cancel, and any other choice of ``d`` would add one.

**The top-k estimate.** The engine returns its top-k ids H and their log μ; the trainer scores H
(``head_logprobs``: log π, normalised over the whole vocabulary; ``old_head_logprobs``: log π_old,
with the π_old anchor, from the recompute pass). Off H the sampler and the anchor are modelled as
the trainer rescaled,

    μ(v) = ρ · π(v),  a(v) = ρ_a · π(v),   ρ = (1 − Σ_H μ) / (1 − Σ_H π),  ρ_a = (1 − Σ_H a) / (1 − Σ_H π)

(each mass floored at ``EPS``; ρ_a = ρ for the μ anchor), so every ratio is constant off H
(π/μ = 1/ρ, π/a = 1/ρ_a, a/μ = ρ_a/ρ) and so is a ``g`` that sees only ratios: ``g_T``. With
``Σ_v π(v)∇log π(v) = 0`` the tail's share of d folds onto H:

    d = Σ_{v∈H} c_v ∇log π(v),   c_v = μ(v) · g(v) − α · π(v),   α = ρ · g_T

``g(v)`` is the loss's (and the correction's) own function evaluated at candidate v, and ``g_T``
the same function at a tail token (ratios above, probability → 0). Per anchor:

======================  =======================================  ===========================================
anchor                  g(v), v ∈ H                              g_T (off H)
======================  =======================================  ===========================================
μ (no recompute)        w(π_v, μ_v) · M(π_v, μ_v)                 w · M at ratio π/μ = 1/ρ
π_old, correction none  w(π_v, o_v) · M(π_v, o_v)                 w · M at ratio π/π_old = 1/ρ_o
π_old + tis             w · M · min(o_v/μ_v, C)                   w · M at 1/ρ_o, times min(ρ_o/ρ, C)
π_old + icepop          w · M · (o_v/μ_v) · 1[lo ≤ o_v/μ_v ≤ hi]  w · M at 1/ρ_o, times (ρ_o/ρ) · 1[band]
======================  =======================================  ===========================================

(o = π_old.) For the μ anchor this gives, per loss:

* plain policy gradient (w = 1, no mask; BPO with ``bpo_eps`` = 1e3): ``c_v = μ_v − ρ·π_v``;
* GRPO-ClipHigher (w = π/μ): ``c_v = π_v · (M_v − M_T)`` — zero but where the clip drops a
  candidate: the weight alone leaves no drift, and the term cancels the one the clip makes by
  dropping candidates; CISPO: ``c_v = min(π_v, C·μ_v) − min(1, C·ρ)·π_v``;
* BPO: ``c_v = μ_v · min(ω_v, C) · M_v − ρ · π_v``, ω_v = (1 + ε − μ_v)/(1 + ε − π_v).

BPO (and its two halves) and DPPO weigh or mask by the probabilities themselves, not only their
ratio, so their g is not constant off H; there ``g_T`` is taken at the small-probability limit
(ω → 1, π − μ → 0, KLbin → 0), and what is left of the drift is exactly
``Σ_{v∉H} μ(v)·(g(v) − g_T)·∇log π(v)`` — small, as every token off H has μ(v) ≤ min_H μ (for BPO
|ω − 1| = |1 − ρ|·π(v)/(1 + ε − π(v)) there), and zero when H covers the sampler's support.

With the π_old anchor the trainer's recompute pass scores H beside the sampled tokens
(``loop.samples.with_old_logprobs``: ``TrainSample.old_head_logprobs``).

**Refused** (``PolicyLossConfig``, so the config check exits 2): GSPO and MIS weigh a token by a
ratio of its whole response, later tokens included — drawn after it, so the expectation over one
position's token with the rest of the response fixed is not one under the sampling distribution,
and the derivation above does not apply. Under the sampler's top-k/top-p filters the engine's
log μ of the sampled token is the distribution before them and its top-k log q after them, so a
ratio against μ (the μ anchor's, a correction's) would not weigh the candidates as the sampled
token: the experiment's checks admit filters only with the π_old anchor and no correction.

**The term.** Everything in c is stop-gradient; only ``log π(v)``, ``v ∈ H``, carries gradient
(normalised over the whole vocabulary: that carries the tail). It is added per token, with the
loss's aggregation, as ``Â_t·(C_t − sg(C_t))`` with ``C_t = Σ_H sg(c_v)·log π(v)``: its value is
zero (the loss reads as without it), its gradient the centering. It vanishes when sampler, anchor
and trainer agree (ρ = 1, every candidate's ratio 1, every loss's weight 1 and mask kept there).
A filtered sampler gives μ = 0 (log μ = −inf) to the candidates it dropped: they carry no mass,
and a head that covers the kept support leaves no tail (ρ → 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bpo_megatron.losses.corrections import CORRECTIONS
from bpo_megatron.losses.registry import POLICY_LOSSES
from bpo_megatron.losses.terms import TokenTerms

if TYPE_CHECKING:
    from bpo_megatron.losses.config import PolicyLossConfig

EPS = 1e-6  # the floor of the tail masses in ρ and ρ_a
# log-probability of the tail token g_T is evaluated at: the small-probability limit (π → 0 at the
# tail's ratios) of the losses that weigh by probabilities, exact in fp64 (e^-60 ≈ 1e-26)
TAIL_LOGPROB = -60.0
# weights that depend on the whole response, not on one position's token (see the module)
SEQUENCE_LEVEL_LOSSES = frozenset({"gspo"})
SEQUENCE_LEVEL_CORRECTIONS = frozenset({"mis"})


def _tail_mass(probs: torch.Tensor) -> torch.Tensor:
    return (1.0 - probs.sum(-1, keepdim=True)).clamp(min=EPS)


def _coefficient(current: torch.Tensor, anchor: torch.Tensor, sampler: torch.Tensor, advantages: torch.Tensor,
                 cfg: PolicyLossConfig, *, recomputed: bool) -> torch.Tensor:
    """g = w·M·f·K of candidate tokens whose log π, log a and log μ are given (same shape; Â broadcast),
    from the loss's and the correction's own functions. Candidates with μ = 0 get g = 0."""
    drawable = torch.isfinite(sampler) & torch.isfinite(anchor)

    def terms(logprobs: torch.Tensor, reference: torch.Tensor) -> TokenTerms:
        return TokenTerms(logprobs=logprobs, rollout_logprobs=torch.where(drawable, reference, 0.0),
                          advantages=advantages, mask=drawable, max_log_ratio=cfg.max_log_ratio)

    weight, keep = POLICY_LOSSES[cfg.name].weight_and_mask(terms(current, anchor), cfg)
    if recomputed:
        correction_weight, correction_keep = CORRECTIONS[cfg.correction.name](terms(anchor, sampler), cfg)
        weight, keep = weight * correction_weight, keep & correction_keep
    return torch.where(drawable & keep, weight, 0.0)


def coefficients(head_logprobs: torch.Tensor, sampler_head_logprobs: torch.Tensor, advantages: torch.Tensor,
                 cfg: PolicyLossConfig, old_head_logprobs: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(c, ρ)``: the centering coefficients ``c_v`` ``[..., k]`` (fp64) and the tail ratio ρ ``[...]``
    from the trainer's (``head_logprobs``), the sampler's and, with the π_old anchor, π_old's
    (``old_head_logprobs``) log-probs of the sampler's top-k ids, and the advantages ``[...]``
    (see the module)."""
    with torch.no_grad():
        log_p = head_logprobs.detach().double().clamp(max=0.0)
        log_q = sampler_head_logprobs.detach().double().clamp(max=0.0)
        recomputed = old_head_logprobs is not None
        log_a = old_head_logprobs.detach().double().clamp(max=0.0) if recomputed else log_q
        p, q = log_p.exp(), log_q.exp()
        advantage = advantages.detach().double()[..., None]
        trainer_tail = 1.0 - p.sum(-1, keepdim=True)
        rho = _tail_mass(q) / trainer_tail.clamp(min=EPS)
        rho_anchor = _tail_mass(log_a.exp()) / trainer_tail.clamp(min=EPS) if recomputed else rho
        head = q * _coefficient(log_p, log_a, log_q, advantage.expand_as(log_p), cfg, recomputed=recomputed)
        tail = torch.full_like(rho, TAIL_LOGPROB)
        g_tail = _coefficient(tail, tail + rho_anchor.log(), tail + rho.log(), advantage, cfg, recomputed=recomputed)
        # a head holding (nearly) all the trainer's mass leaves no tail to fold in (Σ_H π ∇log π ≈ 0)
        alpha = torch.where(trainer_tail > EPS, rho * g_tail, 0.0)
        return head - alpha * p, rho.squeeze(-1).to(torch.float32)  # the caller casts c to its dtype


def centering_term(head_logprobs: torch.Tensor, sampler_head_logprobs: torch.Tensor, advantages: torch.Tensor,
                   active: torch.Tensor, cfg: PolicyLossConfig, old_head_logprobs: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``Â_t·(C_t − sg(C_t))`` ``[B, T]`` (zero value, the centering's gradient; 0 where
    ``active`` — the positions the loss trains — is False) and ρ ``[B, T]``; ``head_logprobs``
    ``[B, T, k]`` carries the gradient."""
    c, rho = coefficients(head_logprobs, sampler_head_logprobs, advantages, cfg, old_head_logprobs)
    c = torch.where(active[..., None], c, 0.0)  # padding's log-probs may be anything
    work = torch.promote_types(head_logprobs.dtype, torch.float32)
    safe = torch.where(active[..., None], head_logprobs.to(work), 0.0)  # padding may hold -inf
    centred = (c.to(work) * safe).sum(-1)
    return torch.where(active, advantages.to(work) * (centred - centred.detach()), 0.0), rho
