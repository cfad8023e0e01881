"""Input checks of the policy loss: bad rollout data must fail loudly, before any update."""

from __future__ import annotations

import torch

# Log-probs computed as z_y − logsumexp(z) can exceed 0 by rounding; more than this is a bug
# upstream (e.g. logits instead of log-probs were passed).
LOGPROB_TOLERANCE = 1e-5


def _first_index(bad: torch.Tensor) -> list[int]:
    return [int(i) for i in bad.nonzero()[0]]


def check_logprobs(name: str, value: torch.Tensor, mask: torch.Tensor) -> None:
    if not value.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor of log-probabilities, got {value.dtype}")
    nonfinite = mask & ~torch.isfinite(value)
    if bool(nonfinite.any()):
        raise ValueError(
            f"{name} has {int(nonfinite.sum())} non-finite values under loss_mask "
            f"(first at {_first_index(nonfinite)}); such rollouts cannot be trained on"
        )
    positive = mask & (value > LOGPROB_TOLERANCE)
    if bool(positive.any()):
        where = _first_index(positive)
        raise ValueError(
            f"{name} has {int(positive.sum())} values > 0 under loss_mask (first at {where}: "
            f"{float(value[tuple(where)]):.4g}); log-probabilities must be <= 0 — were logits passed?"
        )


def validate_policy_loss_inputs(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check shapes and values; return (advantages broadcast to [B, T], loss_mask as bool)."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must have shape [B, T], got {tuple(logprobs.shape)}")
    shape = logprobs.shape
    if rollout_logprobs.shape != shape:
        raise ValueError(
            f"rollout_logprobs shape {tuple(rollout_logprobs.shape)} does not match logprobs {tuple(shape)}"
        )
    if loss_mask.shape != shape:
        raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} does not match logprobs {tuple(shape)}")
    if advantages.shape == shape[:1]:
        advantages = advantages.unsqueeze(-1).expand(shape)
    elif advantages.shape != shape:
        raise ValueError(
            f"advantages must have shape [B]={tuple(shape[:1])} or [B, T]={tuple(shape)}, "
            f"got {tuple(advantages.shape)}"
        )
    if loss_mask.dtype != torch.bool:
        if bool(((loss_mask != 0) & (loss_mask != 1)).any()):
            raise ValueError("loss_mask must hold only 0/1 (or be bool)")
        loss_mask = loss_mask != 0
    check_logprobs("logprobs", logprobs.detach(), loss_mask)
    check_logprobs("rollout_logprobs", rollout_logprobs.detach(), loss_mask)
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be floating point, got {advantages.dtype}")
    if bool((loss_mask & ~torch.isfinite(advantages)).any()):
        raise ValueError("advantages has non-finite values under loss_mask")
    return advantages, loss_mask
