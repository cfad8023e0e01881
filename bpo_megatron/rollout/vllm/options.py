"""Settings of the vLLM rollout engine: the ``rollout.vllm`` section (:class:`VLLMOptions`) and one
engine's full configuration (:class:`VLLMConfig`: the options plus its checkpoint and whether it
captures routing, which the run decides)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from bpo_megatron.weights.buckets import DEFAULT_BUCKET_BYTES

LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]
# the class vLLM mixes into its workers so that they load tensors by Hugging Face name
WORKER_EXTENSION = "bpo_megatron.rollout.vllm.engine.WeightLoadingExtension"


@dataclass(frozen=True)
class VLLMOptions:
    """How to build each ``vllm.LLM`` (``rollout.vllm``). ``engine_args`` go to it verbatim, over
    the ones derived here."""

    tensor_parallel_size: int = 1  # GPUs one engine spans
    dtype: str = "auto"  # vLLM's dtype of the weights and activations ("auto": the checkpoint's)
    gpu_memory_utilization: float = 0.85  # the share of each GPU vLLM may take (weights and KV cache)
    max_model_len: int | None = None  # the longest sequence it serves; None: the model's limit
    enforce_eager: bool = False  # true: no CUDA graphs
    # which distribution its log-probs come from: processed_logprobs (after temperature and top-k/top-p;
    # exact without top-k/top-p) or raw_logprobs (before temperature; exact at temperature 1)
    logprobs_mode: LogprobsMode = "processed_logprobs"
    seed: int = 0  # vllm.LLM's own seed (each request brings its sampling seeds)
    engine_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r}: choose 'processed_logprobs' or 'raw_logprobs' "
                             "(the modes vLLM's GPU model runner supports)")
        if self.tensor_parallel_size < 1:
            raise ValueError("rollout.vllm.tensor_parallel_size must be >= 1")


@dataclass(frozen=True)
class VLLMConfig(VLLMOptions):
    """One engine: the options, the checkpoint it serves and whether it captures routed experts."""

    model_path: str = ""
    capture_routed_experts: bool = True
    weight_bucket_bytes: int = DEFAULT_BUCKET_BYTES  # the most one weight-update call loads (weight_sync.bucket_mb)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_bucket_bytes < 1:
            raise ValueError(f"a vLLM engine's weight buckets hold at least one byte, got {self.weight_bucket_bytes}")
        if not self.model_path:
            raise ValueError("the vLLM engine needs model_path (a Hugging Face checkpoint directory)")

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "skip_tokenizer_init": True,  # token ids in and out; the loop owns the tokenizer
            "tensor_parallel_size": self.tensor_parallel_size,
            "dtype": self.dtype,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            "logprobs_mode": self.logprobs_mode,
            "worker_extension_cls": WORKER_EXTENSION,
        }
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if self.capture_routed_experts:
            kwargs["enable_return_routed_experts"] = True
        return {**kwargs, **self.engine_args}
