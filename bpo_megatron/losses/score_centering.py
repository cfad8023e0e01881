"""Score centering: an additive per-token term that cancels the drift between sampler and trainer.

At a position whose prefix is fixed, the policy-gradient estimate ``Â_t · w_t · ∇log π(y_t)`` with
``y_t ~ q`` (the sampler's distribution) has expectation ``E_q[Â]·E_q[w∇log π] + Cov_q(Â, w∇log π)``.
The first part is *drift*: when ``q ≠ π`` the mean score ``E_q[w∇log π]`` is not zero, and every
step pulls the trainer towards the sampler by it, compounding across steps (Marek & Ryabinin,
"Score Centering Stabilizes Off-policy Reinforcement Learning", arXiv 2609.20807). Score centering
subtracts an estimate of that mean score from every token's update:

    −∇ℓ_t = Â_t · (w_t ∇log π(y_t) − Σ_{v∈H} c_v ∇log π(v))

where ``H`` is the sampler's top-k set at the position (its ids and log q, returned by the engine)
and the sampler's mass outside ``H`` is modelled as the trainer's, rescaled:
``q(v) = ρ·π(v)`` off ``H`` with ``ρ = max(1 − Σ_H q, ε) / max(1 − Σ_H π, ε)``. Then the tail's share
of the mean score folds into ``H`` (``Σ_v π(v)∇log π(v) = 0``) and

    c_v = q(v)·f(π(v)/q(v)) − α·π(v),   α = ρ·f(1/ρ)

with ``f`` the importance weight of the token-level correction in use (``loss.correction``):

=========  ========================  ==============================  ====================
mode       f(r)                      q·f(π/q)                        α
=========  ========================  ==============================  ====================
none       1                         q                               ρ
tis        min(r, C)                 min(π, C·q)                     min(1, C·ρ)
icepop     r·1[a ≤ r ≤ b]            π·1[a ≤ π/q ≤ b]                1[a ≤ 1/ρ ≤ b]
mis        1 per candidate            q                               ρ
=========  ========================  ==============================  ====================

A token-level correction that rejects the sampled token (IcePop outside its band: ``f = 0``)
leaves the term in place — that zero is part of the mean score being subtracted — while a token
the policy loss's own mask drops (its trust region) gets no term. ``mis`` weighs whole responses,
not candidates: the term takes ``f = 1`` and is dropped with the responses the correction drops
(like the policy-gradient term; the paper defines token-level modes only). Everything in ``c`` is
stop-gradient (π is the trainer's current probability, detached); only ``log π(v)``, ``v ∈ H``,
carries gradient, normalised over the whole vocabulary (that is what carries the tail). The term
is added per token, with the loss's own mask, before the loss's aggregation, as
``Â_t·(C_t − sg(C_t))`` with ``C_t = Σ_H sg(c_v)·log π(v)``: its value is zero (the loss reads
as without it), its gradient the centering. It vanishes when sampler and trainer agree (``q = π``
gives ``ρ = 1`` and ``c = 0`` in every mode), and is exact when the sampler's tail is the trainer's
rescaled. ``q`` is the distribution the sampler drew from: after temperature and any top-k/top-p
filtering, renormalised (tokens filtered out have ``q = 0``, and a head that covers the kept
support leaves no tail: ``ρ → 0``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from bpo_megatron.losses.corrections import CORRECTIONS

if TYPE_CHECKING:
    from bpo_megatron.losses.config import CorrectionConfig

EPS = 1e-6  # the floor of both tail masses in ρ
# corrections whose dropped tokens lose the term too (sequence-level: they drop whole responses)
FOLLOWS_CORRECTION_MASK = frozenset({"mis"})

# (π over H, q over H, ρ [..., 1], the correction's bounds) -> (q·f(π/q) over H, α [..., 1])
Coefficients = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "CorrectionConfig"],
                        "tuple[torch.Tensor, torch.Tensor]"]
MODES: dict[str, Coefficients] = {}


def mode(*names: str) -> Callable[[Coefficients], Coefficients]:
    def register(fn: Coefficients) -> Coefficients:
        for name in names:
            MODES[name] = fn
        return fn
    return register


@mode("none", "mis")
def _plain(p: torch.Tensor, q: torch.Tensor, rho: torch.Tensor, cfg: CorrectionConfig):
    return q, rho


@mode("tis")
def _truncated(p: torch.Tensor, q: torch.Tensor, rho: torch.Tensor, cfg: CorrectionConfig):
    cap = cfg.tis_cap
    return torch.minimum(p, cap * q), torch.clamp(cap * rho, max=1.0)


@mode("icepop")
def _icepop(p: torch.Tensor, q: torch.Tensor, rho: torch.Tensor, cfg: CorrectionConfig):
    low, high = cfg.icepop_low, cfg.icepop_high
    ratio = torch.where(q > 0, p / q, torch.inf)
    inverse = torch.where(rho > 0, 1.0 / rho, torch.inf)
    head = torch.where((ratio >= low) & (ratio <= high), p, 0.0)
    return head, ((inverse >= low) & (inverse <= high)).to(p.dtype)


missing = set(CORRECTIONS) - set(MODES)
assert not missing, f"score centering has no coefficients for the corrections {sorted(missing)}"


def coefficients(head_logprobs: torch.Tensor, sampler_head_logprobs: torch.Tensor,
                 correction: CorrectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(c, ρ)``: the centering coefficients ``c_v`` ``[..., k]`` and the tail ratio ``ρ`` ``[...]``
    from the trainer's and the sampler's log-probs of the sampler's top-k ids (see the module)."""
    with torch.no_grad():
        p = head_logprobs.detach().double().clamp(max=0.0).exp()
        q = sampler_head_logprobs.detach().double().clamp(max=0.0).exp()
        trainer_tail = 1.0 - p.sum(-1, keepdim=True)
        rho = (1.0 - q.sum(-1, keepdim=True)).clamp(min=EPS) / trainer_tail.clamp(min=EPS)
        head, alpha = MODES[correction.name](p, q, rho, correction)
        # a head holding (nearly) all the trainer's mass leaves no tail to fold in (Σ_H π ∇log π ≈ 0)
        alpha = torch.where(trainer_tail > EPS, alpha, 0.0)
        return head - alpha * p, rho.squeeze(-1).to(torch.float32)  # c in fp64: the caller casts it to its dtype


def centering_term(head_logprobs: torch.Tensor, sampler_head_logprobs: torch.Tensor, advantages: torch.Tensor,
                   active: torch.Tensor, correction: CorrectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``Â_t·(C_t − sg(C_t))`` ``[B, T]`` (zero value, the centering's gradient; 0 where
    ``active`` is False) and ``ρ`` ``[B, T]``; ``head_logprobs`` ``[B, T, k]`` carries the gradient."""
    c, rho = coefficients(head_logprobs, sampler_head_logprobs, correction)
    c = torch.where(active[..., None], c, 0.0)  # padding's log-probs may be anything
    work = torch.promote_types(head_logprobs.dtype, torch.float32)
    safe = torch.where(active[..., None], head_logprobs.to(work), 0.0)  # padding may hold -inf
    centred = (c.to(work) * safe).sum(-1)
    return torch.where(active, advantages.to(work) * (centred - centred.detach()), 0.0), rho
