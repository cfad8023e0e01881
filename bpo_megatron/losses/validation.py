"""Input checks of the policy loss: bad rollout data must fail loudly, before any update.

The value checks read the inputs back to the host. A trainer that computes the loss once per
micro-batch defers them (:class:`DeferredChecks`): each call only adds to one device flag, read
once before the optimizer step, and the same error is raised from the inputs kept for it.
"""

from __future__ import annotations

from typing import Callable

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


def refuses_logprobs(value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Whether :func:`check_logprobs` refuses ``value`` under ``mask``, as a device flag (no host read)."""
    return (mask & (~torch.isfinite(value) | (value > LOGPROB_TOLERANCE))).any()


class DeferredChecks:
    """The value checks of many loss calls (a training step's micro-batches) with one host read.

    Each check given to :meth:`add` comes with whether it would refuse, as a device flag; the flags
    are OR-ed on the device and the inputs kept. :meth:`raise_first` reads the flag once and, if
    it is set, runs the kept checks in the order they were added: the error is the one the first
    bad call would have raised at once. Call it before anything is trained on the inputs.
    """

    def __init__(self) -> None:
        self._refused: torch.Tensor | None = None
        self._checks: list[Callable[[], None]] = []

    def add(self, check: Callable[[], None], refuses: torch.Tensor) -> None:
        self._refused = refuses if self._refused is None else self._refused | refuses
        self._checks.append(check)

    def raise_first(self, group=None, device: torch.device | str = "cpu") -> None:
        """Raise the first kept check's error if any check would refuse. With ``group`` (a
        ``torch.distributed`` group; ``device``: where its collectives run) the flags of every
        member are OR-ed first (one collective, the same one read), so every member refuses the
        step together: a rank whose own inputs were fine names the refusal of another, instead of
        stepping on gradients its peers' bad inputs reached through the gradient reduction."""
        refused = self._refused
        if group is not None:
            import torch.distributed as dist

            mine = (torch.zeros((), dtype=torch.int32, device=device) if refused is None
                    else refused.to(device=device, dtype=torch.int32))
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
            refused = mine
        if refused is None or not bool(refused):  # the one host read
            return
        for check in self._checks:
            check()
        raise ValueError("another trainer rank refused this step's loss inputs (its error names the input); "
                         "nothing was updated")


def check_values(check: Callable[[], None], refuses: Callable[[], torch.Tensor],
                 deferred: DeferredChecks | None) -> None:
    """Run ``check`` now, or, with ``deferred``, add it there with ``refuses()`` (the same
    question as a device flag)."""
    if deferred is None:
        check()
    else:
        deferred.add(check, refuses())


def validate_policy_loss_inputs(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    deferred: DeferredChecks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check shapes and values (the values later with ``deferred``); return (advantages
    broadcast to [B, T], loss_mask as bool)."""
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
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be floating point, got {advantages.dtype}")
    current, rollout, mask = logprobs.detach(), rollout_logprobs.detach(), loss_mask

    def check() -> None:
        check_logprobs("logprobs", current, mask)
        check_logprobs("rollout_logprobs", rollout, mask)
        if bool((mask & ~torch.isfinite(advantages)).any()):
            raise ValueError("advantages has non-finite values under loss_mask")

    check_values(check, lambda: refuses_logprobs(current, mask) | refuses_logprobs(rollout, mask)
                 | (mask & ~torch.isfinite(advantages)).any(), deferred)
    return advantages, loss_mask
