"""The embedded engine's own settings: the ``rollout.hf`` section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

WeightDtype = Literal["fp32", "bf16"]
# transformers: the model's own forward with a left-padded DynamicCache (today's loop);
# static: a functional step over fixed per-row KV slots, eager (any device);
# cuda_graph: the same step captured as one CUDA graph, FlashAttention and grouped GEMMs (CUDA, bf16);
# auto: cuda_graph on a GPU in bf16, transformers otherwise
DecodePath = Literal["auto", "transformers", "static", "cuda_graph"]


@dataclass(frozen=True)
class HFEngineOptions:
    """The embedded engine's own settings (``rollout.hf``). ``dtype`` is the precision it holds
    the weights and computes in: ``bf16`` against an fp32 trainer reproduces, on a CPU, the
    numerical gap between GPU inference kernels and the trainer that makes routing differ and
    that R3 closes. ``max_batch_rows`` bounds the rows decoded together. ``decode`` picks the
    decode loop (:data:`DecodePath`); ``refill_every`` is how many steps the static paths run
    between host syncs (finished rows leave and queued rows enter only then)."""

    dtype: WeightDtype = "fp32"
    max_batch_rows: int = 256
    decode: DecodePath = "auto"
    refill_every: int = 8

    def __post_init__(self) -> None:
        from bpo_megatron.models.options import TORCH_DTYPES

        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"rollout.hf.dtype={self.dtype!r} is unknown; choose one of {sorted(TORCH_DTYPES)}")
        if self.max_batch_rows < 1:
            raise ValueError(f"rollout.hf.max_batch_rows must be >= 1, got {self.max_batch_rows}")
        check_decode(self.decode, self.refill_every)


def check_decode(decode: str, refill_every: int) -> None:
    if decode not in get_args(DecodePath):
        raise ValueError(f"rollout.hf.decode={decode!r} is unknown; choose one of {list(get_args(DecodePath))}")
    if refill_every < 1:
        raise ValueError(f"rollout.hf.refill_every must be >= 1, got {refill_every}")
