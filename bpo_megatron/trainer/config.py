"""The ``trainer`` section: settings of the train actor itself (model, loss, optimizer and layout
have their own sections)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

LogprobKernel = Literal["auto", "fused", "chunked"]


@dataclass(frozen=True)
class TrainerConfig:
    """How the train actor batches and scores samples.

    ``max_tokens_per_micro_batch`` 0 splits a batch over the data-parallel ranks by count and
    cuts each share into micro-batches of ``micro_batch_size`` samples, right-padded to the
    longest; a positive budget packs samples end to end instead (``trainer/packing.py``), at most
    that many input positions per micro-batch, with the shares and the micro-batches balanced by
    estimated cost (``trainer/balance.py``), and ``micro_batch_size`` is not used. Every sample
    must fit the budget on its own.

    ``temperature`` must be the rollout engine's sampling temperature: the trainer's log π is
    computed from logits / temperature, the same distribution the engine's log μ comes from. In an
    experiment it is ``rollout.temperature`` and the seed (Megatron's RNG) is the run's ``seed``:
    neither is a key of this section.
    """

    micro_batch_size: int = 1  # samples per forward/backward micro-batch on each DP rank
    temperature: float = field(default=1.0, metadata={"derived": "rollout.temperature"})
    seed: int = field(default=1234, metadata={"derived": "the experiment's seed"})
    max_tokens_per_micro_batch: int = 0  # > 0: packed micro-batches of at most this many positions
    # the log-prob op (ops/vocab_parallel.py): auto takes the fused triton kernels on a GPU with
    # triton and the chunked op elsewhere; chunked forces the PyTorch op everywhere (the path
    # validated on an H100 before the fused kernels), fused refuses a rank that cannot run them
    logprob_kernel: LogprobKernel = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1:
            raise ValueError(f"trainer.micro_batch_size must be a positive integer, got {self.micro_batch_size!r}")
        budget = self.max_tokens_per_micro_batch
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError("trainer.max_tokens_per_micro_batch must be a non-negative integer (0: padded micro-batches "
                             f"of trainer.micro_batch_size samples), got {budget!r}")
        if self.logprob_kernel not in get_args(LogprobKernel):
            raise ValueError(f"trainer.logprob_kernel={self.logprob_kernel!r} must be auto, fused or chunked")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"trainer.temperature (rollout.temperature) must be > 0, got {self.temperature}")
