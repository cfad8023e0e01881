"""Registry of policy losses.

Every loss in the family has the per-token form ``ℓ_t = −Â · M_t · sg(w_t) · log π(y_t)``; a loss
is defined only by how it computes the stop-gradient weight ``w`` and the keep-mask ``M`` from
the current and rollout log-probabilities. Adding a loss is one decorated function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the config validates names against this registry
    import torch

    from bpo_megatron.losses.config import PolicyLossConfig
    from bpo_megatron.losses.terms import TokenTerms

# (terms, cfg) -> (weight w, keep mask M), both [B, T]; computed without gradient.
WeightAndMask = Callable[["TokenTerms", "PolicyLossConfig"], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True)
class PolicyLoss:
    name: str
    weight_and_mask: WeightAndMask
    summary: str


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, summary: str) -> Callable[[WeightAndMask], WeightAndMask]:
    """Decorator adding ``fn(terms, cfg) -> (w, M)`` to :data:`POLICY_LOSSES` under ``name``."""

    def decorator(fn: WeightAndMask) -> WeightAndMask:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = PolicyLoss(name=name, weight_and_mask=fn, summary=summary)
        return fn

    return decorator
