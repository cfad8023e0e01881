"""Mismatch corrections between the rollout engine and the trainer, composable with every loss.

The engine samples with its own numerics (kernels, precision, routing): its log-probabilities
log μ differ from the trainer's log-probabilities of the *same* weights, log π_old, which the
trainer recomputes before it updates (``train.recompute_old_logprobs``). With a correction the
loss's own weight and mask are taken against π_old, and the correction reweights or masks each
token by the behaviour ratio ρ = π_old/μ, so the update estimates the gradient under the policy
that actually sampled:

==========  =====================================================  ====================================
name        correction weight (stop-gradient)                      dropped
==========  =====================================================  ====================================
tis         min(ρ_t, tis_cap)  (truncated importance sampling)     never
mis         ρ_seq = Π_t ρ_t of the whole response                  the whole response when ρ_seq > mis_cap
icepop      ρ_t                                                    tokens with ρ_t outside
                                                                    [icepop_low, icepop_high]
==========  =====================================================  ====================================

Each token's loss becomes ``−Â · M_loss · M_corr · sg(w_loss · w_corr) · log π``. ``none`` (the
default) leaves the loss as it is.

π_old is recomputed with the weights at the step's start. Under ``train.async`` those are newer
than the weights that sampled the responses (decoupled PPO): ρ then measures the responses'
staleness as well as the engine/trainer mismatch, and so do the ``mismatch_*`` metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from bpo_megatron.losses.terms import TokenTerms

if TYPE_CHECKING:
    from bpo_megatron.losses.config import PolicyLossConfig

# (behaviour terms: log π_old as logprobs, log μ as rollout_logprobs; cfg) -> (weight, keep) [B, T]
Correction = Callable[[TokenTerms, "PolicyLossConfig"], "tuple[torch.Tensor, torch.Tensor]"]
CORRECTIONS: dict[str, Correction] = {}


def correction(name: str) -> Callable[[Correction], Correction]:
    def register(fn: Correction) -> Correction:
        CORRECTIONS[name] = fn
        return fn
    return register


@correction("none")
def no_correction(behaviour: TokenTerms, cfg: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones_like(behaviour.ratio), torch.ones_like(behaviour.mask)


@correction("tis")
def truncated_importance_sampling(behaviour: TokenTerms, cfg: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return behaviour.ratio.clamp(max=cfg.correction.tis_cap), torch.ones_like(behaviour.mask)


@correction("mis")
def masked_importance_sampling(behaviour: TokenTerms, cfg: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level: one ratio per response (log-space sum, clamped so it stays finite)."""
    limit = behaviour.max_log_ratio
    log_seq = behaviour.log_ratio.sum(dim=-1, keepdim=True).clamp(-limit, limit)
    seq_ratio = torch.exp(log_seq).expand_as(behaviour.log_ratio)
    return seq_ratio, seq_ratio <= cfg.correction.mis_cap


@correction("icepop")
def icepop(behaviour: TokenTerms, cfg: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = behaviour.ratio
    return ratio, (ratio >= cfg.correction.icepop_low) & (ratio <= cfg.correction.icepop_high)
