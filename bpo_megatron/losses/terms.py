"""Detached per-token quantities every policy loss is computed from."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class TokenTerms:
    """log π, log μ, advantages and the loss mask of a [B, T] batch, all detached, fp32 or wider.

    Positions outside ``mask`` may hold anything (padding); losses must not let them matter.
    """

    logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor  # [B, T], a per-response Â broadcast over tokens
    mask: torch.Tensor  # bool [B, T]
    max_log_ratio: float

    @cached_property
    def log_ratio(self) -> torch.Tensor:
        """log π − log μ, zero off the mask and clamped so exp() stays finite."""
        diff = torch.where(self.mask, self.logprobs - self.rollout_logprobs, 0.0)
        return diff.clamp(-self.max_log_ratio, self.max_log_ratio)

    @cached_property
    def ratio(self) -> torch.Tensor:
        """Importance ratio r = π/μ."""
        return torch.exp(self.log_ratio)

    @cached_property
    def prob(self) -> torch.Tensor:
        """p = π(y_t), at most 1 (log-probs may exceed 0 by rounding)."""
        return torch.exp(self.logprobs.clamp(max=0.0))

    @cached_property
    def rollout_prob(self) -> torch.Tensor:
        """q = μ(y_t)."""
        return torch.exp(self.rollout_logprobs.clamp(max=0.0))

    @cached_property
    def positive(self) -> torch.Tensor:
        return self.advantages > 0

    @cached_property
    def negative(self) -> torch.Tensor:
        return self.advantages < 0

    def clip_mask(self, value: torch.Tensor, low: float, high: float) -> torch.Tensor:
        """GRPO's clipping rule on any per-token quantity: drop Â>0 tokens above ``high`` and
        Â<0 tokens below ``low`` (the tokens whose PPO objective is flat)."""
        dropped = (self.positive & (value > high)) | (self.negative & (value < low))
        return ~dropped
