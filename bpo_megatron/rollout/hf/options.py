"""The embedded engine's own settings: the ``rollout.hf`` section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

WeightDtype = Literal["fp32", "bf16"]
# none: the weights as sent, in ``dtype``; fp8: the linear layers computed as a block-FP8 (w8a8) server
# does: weights in 128 x 128 e4m3 blocks, inputs in 1 x 128 groups (bpo_megatron/weights/fp8.py,
# rollout/hf/fp8_compute.py): FP8 GEMMs on a Hopper GPU, an exact emulation elsewhere
Quantization = Literal["none", "fp8"]
# The engine has one decode loop (fixed per-row KV slots, a functional step: rollout/hf/slots.py);
# this chooses how its step runs. eager: op by op (any device and dtype); cuda_graph: the step,
# sampling and bookkeeping included, replayed as one CUDA graph with FlashAttention (CUDA, bf16);
# auto: cuda_graph on a GPU in bf16, eager otherwise
DecodePath = Literal["auto", "eager", "cuda_graph"]
# values that named loops the engine no longer has -> what to write instead
_ONE_LOOP = ("is gone: the embedded engine has one decode loop now (fixed per-row KV slots); write "
             "rollout.hf.decode=eager (its step op by op, any device) or auto (a CUDA graph on a GPU in bf16)")
REMOVED_DECODE = {"transformers": _ONE_LOOP, "static": _ONE_LOOP}


@dataclass(frozen=True)
class HFEngineOptions:
    """The embedded engine's own settings (``rollout.hf``). ``dtype`` is the precision it holds
    the weights and computes in: ``bf16`` against an fp32 trainer reproduces, on a CPU, the
    numerical gap between GPU inference kernels and the trainer that makes routing differ and
    that R3 closes. ``max_batch_rows`` bounds the rows decoded together. ``decode`` picks the
    decode step runs (:data:`DecodePath`); ``refill_every`` is how many steps run between host
    syncs (finished rows leave and queued rows enter only then; at most one uniform block,
    ``UNIFORM_BLOCK`` steps, so each row's random stream can be drawn ahead at the sync).
    ``compile`` runs each decoder layer of the step through ``torch.compile`` (its elementwise
    work fused between the GEMMs; compiled once per layer kind at the first generation).
    ``quantization: fp8`` computes the linear layers as a block-FP8 server does (weights rounded
    through block-wise e4m3 at load and at every weight update, inputs quantized in 1 × 128 groups:
    :mod:`bpo_megatron.weights.fp8`, :mod:`bpo_megatron.rollout.hf.fp8_compute`), so a CPU run
    samples under a genuine FP8 mismatch with the trainer; R3 is unchanged."""

    REMOVED_VALUES: ClassVar[dict[str, dict[str, str]]] = {"decode": REMOVED_DECODE}  # refused by the loader

    dtype: WeightDtype = "fp32"
    max_batch_rows: int = 256
    decode: DecodePath = "auto"
    refill_every: int = 8
    compile: bool = False
    quantization: Quantization = "none"

    def __post_init__(self) -> None:
        from bpo_megatron.models.options import TORCH_DTYPES

        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"rollout.hf.dtype={self.dtype!r} is unknown; choose one of {sorted(TORCH_DTYPES)}")
        if self.max_batch_rows < 1:
            raise ValueError(f"rollout.hf.max_batch_rows must be >= 1, got {self.max_batch_rows}")
        check_decode(self.decode, self.refill_every)


def check_decode(decode: str, refill_every: int) -> None:
    from bpo_megatron.rollout.hf.sampling import UNIFORM_BLOCK

    if decode in REMOVED_DECODE:
        raise ValueError(f"rollout.hf.decode={decode!r} {REMOVED_DECODE[decode]}")
    if decode not in get_args(DecodePath):
        raise ValueError(f"rollout.hf.decode={decode!r} is unknown; choose one of {list(get_args(DecodePath))}")
    if not 1 <= refill_every <= UNIFORM_BLOCK:
        raise ValueError(f"rollout.hf.refill_every must be between 1 and {UNIFORM_BLOCK} (the steps a row's "
                         f"random stream is drawn ahead), got {refill_every}")
