"""The ``rollout`` section: which engine generates, and how it samples."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

EngineName = Literal["hf", "sglang", "vllm"]
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


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling for training (the paper: G=16 at T=1.0, top-p 1.0, no top-k, 16k tokens).

    ``capture_routed_experts`` makes the engine record the experts of every processed token;
    R3 (``model.routing_replay``) needs it. ``sglang`` holds the SGLang engine's own settings
    (see ``bpo_megatron.rollout.sglang.SGLangConfig``; ``model_path`` defaults to ``model.path``);
    ``vllm`` the vLLM engine's keyword arguments (``bpo_megatron.rollout.vllm_engine.VLLMEngine``);
    ``hf`` the embedded engine's options (:class:`HFEngineOptions`).
    """

    engine: EngineName = "hf"
    num_engines: int = 1
    group_size: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16384
    stop_token_ids: tuple[int, ...] = ()  # added to the tokenizer's end-of-sequence tokens
    capture_routed_experts: bool = True
    seed: int = 0
    threads_per_engine: int = 1  # torch threads of the embedded engine
    weight_bucket_mb: int = 512
    # An engine that dies, or does not answer a generate call within generate_timeout_s (None:
    # no limit), is replaced and its requests sent again; max_restarts per engine (on average)
    # bounds the replacements of a run.
    generate_timeout_s: float | None = None
    max_restarts: int = 2
    hf: HFEngineOptions = field(default_factory=HFEngineOptions)
    sglang: dict[str, Any] = field(default_factory=dict)
    vllm: dict[str, Any] = field(default_factory=dict)  # keyword arguments of VLLMEngine

    def __post_init__(self) -> None:
        for name in ("num_engines", "group_size", "max_new_tokens", "threads_per_engine", "weight_bucket_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"rollout.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"rollout.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.generate_timeout_s is not None and not self.generate_timeout_s > 0:
            raise ValueError(f"rollout.generate_timeout_s must be > 0 (or null: no limit), got {self.generate_timeout_s}")
        if self.max_restarts < 0:
            raise ValueError(f"rollout.max_restarts must be >= 0, got {self.max_restarts}")

    @property
    def sync_dtype(self) -> WeightDtype | None:
        """The precision weights are sent to the engines in: the embedded engine's own (so what it
        holds is exactly what was sent); other engines receive the trainer's tensors as they are."""
        return self.hf.dtype if self.engine == "hf" else None
