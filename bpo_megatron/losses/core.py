"""compute_policy_loss: the one entry point of the loss family."""

from __future__ import annotations

import torch

from bpo_megatron.losses.aggregation import AGGREGATIONS, BatchTotals
from bpo_megatron.losses.config import PolicyLossConfig
from bpo_megatron.losses.corrections import CORRECTIONS
from bpo_megatron.losses.registry import POLICY_LOSSES
from bpo_megatron.losses.score_centering import centering_term
from bpo_megatron.losses.statistics import LossStatistics
from bpo_megatron.losses.terms import TokenTerms
from bpo_megatron.losses.validation import (
    DeferredChecks,
    check_logprobs,
    check_values,
    refuses_logprobs,
    validate_policy_loss_inputs,
)


def policy_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PolicyLossConfig,
    *,
    totals: BatchTotals | None = None,
    old_logprobs: torch.Tensor | None = None,
    head_logprobs: torch.Tensor | None = None,
    sampler_head_logprobs: torch.Tensor | None = None,
    old_head_logprobs: torch.Tensor | None = None,
    deferred: DeferredChecks | None = None,
) -> tuple[torch.Tensor, LossStatistics]:
    """Like :func:`compute_policy_loss`, but the statistics stay tensors (no host sync for them)
    so a trainer can merge them over micro-batches and ranks before reading them. With
    ``deferred`` the checks of the input values are left to it (its one read before the update)
    and the call reads nothing back from the device."""
    advantages, mask = validate_policy_loss_inputs(logprobs, rollout_logprobs, advantages, loss_mask,
                                                   deferred=deferred)
    if old_logprobs is None and cfg.correction.active:
        raise ValueError(f"loss.correction={cfg.correction.name} needs the trainer's recomputed log-probs of the behaviour "
                         "weights (old_logprobs): set train.recompute_old_logprobs=true")
    if cfg.score_centering and (head_logprobs is None or sampler_head_logprobs is None):
        raise ValueError("loss.score_centering needs the sampler's top-k log-probs of every response token "
                         "(sampler_head_logprobs) and the trainer's log-probs of those ids (head_logprobs)")
    if cfg.score_centering and not (head_logprobs.shape == sampler_head_logprobs.shape
                                    and head_logprobs.shape[:-1] == logprobs.shape):
        raise ValueError(f"score centering: head_logprobs {tuple(head_logprobs.shape)} and sampler_head_logprobs "
                         f"{tuple(sampler_head_logprobs.shape)} must both be logprobs' shape {tuple(logprobs.shape)} "
                         "plus the top-k dimension")
    if cfg.score_centering and old_logprobs is not None and old_head_logprobs is None:
        raise ValueError("loss.score_centering with old_logprobs (the loss anchored to π_old) needs π_old's log-probs of "
                         "the sampler's top-k ids too (old_head_logprobs): the centering's coefficients weigh each "
                         "candidate as the loss weighs it (losses/score_centering.py)")
    if cfg.score_centering and old_head_logprobs is not None and (old_logprobs is None or
                                                                 old_head_logprobs.shape != head_logprobs.shape):
        raise ValueError(f"score centering: old_head_logprobs {tuple(old_head_logprobs.shape)} go with old_logprobs and "
                         f"must have head_logprobs' shape {tuple(head_logprobs.shape)}")
    work = torch.promote_types(logprobs.dtype, torch.float32)

    def terms_of(current: torch.Tensor, anchor: torch.Tensor) -> TokenTerms:
        return TokenTerms(logprobs=current.detach().to(work), rollout_logprobs=anchor.detach().to(work),
                          advantages=advantages.detach().to(work), mask=mask, max_log_ratio=cfg.max_log_ratio)

    behaviour = None
    if old_logprobs is not None:
        if old_logprobs.shape != logprobs.shape:
            raise ValueError(f"old_logprobs shape {tuple(old_logprobs.shape)} does not match logprobs "
                             f"{tuple(logprobs.shape)}")
        old = old_logprobs.detach()
        check_values(lambda: check_logprobs("old_logprobs", old, mask), lambda: refuses_logprobs(old, mask), deferred)
        behaviour = terms_of(old_logprobs, rollout_logprobs)  # π_old against μ
    terms = terms_of(logprobs, rollout_logprobs if old_logprobs is None else old_logprobs)
    with torch.no_grad():
        own_weight, own_keep = weight, keep = POLICY_LOSSES[cfg.name].weight_and_mask(terms, cfg)
        correction = None
        if behaviour is not None:
            correction = CORRECTIONS[cfg.correction.name](behaviour, cfg)
            weight, keep = weight * correction[0], keep & correction[1]
        active = mask & keep
        coefficient = torch.where(active, terms.advantages * weight, 0.0)
    # where(), not a product: padding may hold NaN/-inf log-probs and dropped tokens huge
    # weights; either must contribute exactly 0 to the loss and its gradient.
    token_losses = torch.where(active, -coefficient * logprobs.to(work), 0.0)
    centering = None
    if cfg.score_centering:
        # an additive term at every position the loss trains, with its aggregation: the loss's and
        # the correction's masks are inside its coefficients (losses/score_centering.py)
        term, rho = centering_term(head_logprobs, sampler_head_logprobs, terms.advantages, mask, cfg,
                                   old_head_logprobs)
        token_losses = token_losses + term
        centering = (rho, sampler_head_logprobs.detach().float().exp().sum(-1))
    norm_length = cfg.norm_length or logprobs.shape[-1]
    totals = totals or BatchTotals.of(mask)
    loss = AGGREGATIONS[cfg.agg](token_losses, mask.to(work), totals, norm_length)
    return loss, LossStatistics.compute(terms, own_weight, own_keep, behaviour=behaviour, correction=correction,
                                        centering=centering)


def compute_policy_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PolicyLossConfig,
    *,
    totals: BatchTotals | None = None,
    old_logprobs: torch.Tensor | None = None,
    head_logprobs: torch.Tensor | None = None,
    sampler_head_logprobs: torch.Tensor | None = None,
    old_head_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss ``ℓ_t = −Â · M_t · sg(w_t) · log π(y_t)`` aggregated by ``cfg.agg``.

    Args:
        logprobs: [B, T] log π of the sampled tokens (differentiable).
        rollout_logprobs: [B, T] log μ, the rollout engine's log-probs (no gradient flows here).
        advantages: [B] per-response Â or [B, T] per-token.
        loss_mask: [B, T] bool or 0/1; False for prompt and padding positions.
        cfg: which loss and its hyper-parameters.
        totals: token/sequence counts of the whole batch when this call sees only a part of it
            (micro-batches, data-parallel ranks); defaults to this call's own counts.
        old_logprobs: [B, T] the trainer's log-probs of the behaviour weights (log π_old). When
            given, the loss's weight and mask are taken against them instead of log μ, and
            ``cfg.correction`` reweights/masks by π_old/μ (losses/corrections.py).
        head_logprobs: [B, T, k] log π of the sampler's top-k ids at each position (differentiable,
            normalised over the whole vocabulary), with ``cfg.score_centering``.
        sampler_head_logprobs: [B, T, k] the sampler's log q of those ids (the distribution it drew
            from), with ``cfg.score_centering`` (losses/score_centering.py).
        old_head_logprobs: [B, T, k] log π_old of those ids, with ``cfg.score_centering`` and
            ``old_logprobs`` (the centering's coefficients take the loss's weight against π_old).

    Returns:
        ``(loss, metrics)``: a scalar tensor and a dict of Python floats (masked fractions by sign
        of Â, mean/max weight, mean |log π − log μ|, k3 KL(μ‖π), token count).

    Raises:
        ValueError: naming the argument, for shape mismatches, non-finite log-probs or
        advantages under the mask, or log-probs > 0.
    """
    loss, stats = policy_loss(logprobs, rollout_logprobs, advantages, loss_mask, cfg, totals=totals,
                              old_logprobs=old_logprobs, head_logprobs=head_logprobs,
                              sampler_head_logprobs=sampler_head_logprobs, old_head_logprobs=old_head_logprobs)
    return loss, stats.as_metrics()
