"""The embedded engine's own settings: the ``rollout.hf`` section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

WeightDtype = Literal["fp32", "bf16"]


@dataclass(frozen=True)
class HFEngineOptions:
    """The embedded engine's own settings (``rollout.hf``). ``dtype`` is the precision it holds
    the weights and computes in: ``bf16`` against an fp32 trainer reproduces, on a CPU, the
    numerical gap between GPU inference kernels and the trainer that makes routing differ and
    that R3 closes. ``max_batch_rows`` bounds the rows decoded together."""

    dtype: WeightDtype = "fp32"
    max_batch_rows: int = 256

    def __post_init__(self) -> None:
        from bpo_megatron.models.options import TORCH_DTYPES

        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"rollout.hf.dtype={self.dtype!r} is unknown; choose one of {sorted(TORCH_DTYPES)}")
        if self.max_batch_rows < 1:
            raise ValueError(f"rollout.hf.max_batch_rows must be >= 1, got {self.max_batch_rows}")
