"""Settings of the train actor itself (model, loss, optimizer and layout have their own)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerConfig:
    """How the train actor batches and scores samples.

    ``temperature`` must be the rollout engine's sampling temperature: the trainer's log π is
    computed from logits / temperature, the same distribution the engine's log μ comes from.
    """

    micro_batch_size: int = 1  # samples per forward/backward micro-batch on each DP rank
    temperature: float = 1.0
    seed: int = 1234

    def __post_init__(self) -> None:
        if not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1:
            raise ValueError(f"train.micro_batch_size must be a positive integer, got {self.micro_batch_size!r}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"train.temperature must be > 0, got {self.temperature}")
