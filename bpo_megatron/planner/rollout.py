"""Memory of one rollout engine GPU: weights at the engine's tensor parallelism plus the KV cache
of the sequences it holds at once.

What an engine runs with comes from its own config, through one profile function per engine:

* ``hf`` (embedded): one device, decodes all of its requests in one batch;
* ``sglang``: ``rollout.sglang.tp_size`` GPUs; at most ``requests_per_post × concurrent_posts``
  sequences are in flight per engine (the client's concurrency), fewer if the step has fewer;
  weights and KV cache must fit in its static pool, ``mem_fraction_static`` of the GPU, when set;
* ``vllm``: ``cluster.gpus_per_engine`` GPUs, all of its requests at once.

KV cache per GPU = 2 (K and V) × layers × KV heads per rank × head_dim × bytes × tokens, with
tokens = sequences × (max prompt + max response) — the worst case, every sequence at full
length. KV heads are split over the engine's TP ranks and replicated when there are fewer of
them than ranks. Weights are split over TP (experts included).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bpo_megatron.models.hf_config import HFModelConfig

if TYPE_CHECKING:
    from bpo_megatron.experiment import ExperimentConfig

# Engines serve in bf16 on GPUs (the checkpoints' dtype), whatever the trainer's dtype.
ENGINE_BYTES = 2


@dataclass(frozen=True)
class EngineProfile:
    tp: int  # GPUs one engine spans
    sequences: int  # sequences resident at once per engine
    # share of a GPU the engine reserves for weights and KV cache (SGLang's mem_fraction_static);
    # None: the whole GPU less the reserved allowance
    pool_fraction: float | None = None


def _requests_per_engine(cfg: ExperimentConfig) -> int:
    return math.ceil(cfg.responses_per_step / cfg.rollout.num_engines)


def _hf_profile(cfg: ExperimentConfig) -> EngineProfile:
    return EngineProfile(tp=1, sequences=_requests_per_engine(cfg))


def _sglang_profile(cfg: ExperimentConfig) -> EngineProfile:
    settings = cfg.rollout.sglang
    concurrency = int(settings.get("requests_per_post", 64)) * int(settings.get("concurrent_posts", 8))
    fraction = settings.get("mem_fraction_static")
    return EngineProfile(tp=int(settings.get("tp_size", 1)),
                         sequences=min(concurrency, _requests_per_engine(cfg)),
                         pool_fraction=None if fraction is None else float(fraction))


def _vllm_profile(cfg: ExperimentConfig) -> EngineProfile:
    return EngineProfile(tp=max(1, int(cfg.cluster.gpus_per_engine)), sequences=_requests_per_engine(cfg))


ENGINE_PROFILES: dict[str, Callable[[ExperimentConfig], EngineProfile]] = {
    "hf": _hf_profile,
    "sglang": _sglang_profile,
    "vllm": _vllm_profile,
}


@dataclass(frozen=True)
class RolloutMemory:
    profile: EngineProfile
    tokens_per_sequence: int
    weights: float
    kv_cache: float
    kv_bytes_per_token: float  # per GPU

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache


def kv_bytes_per_token(hf: HFModelConfig, tp: int, dtype_bytes: int = ENGINE_BYTES) -> float:
    kv_heads_per_rank = math.ceil(hf.num_key_value_heads / tp)
    return 2 * hf.num_hidden_layers * kv_heads_per_rank * hf.head_dim * dtype_bytes


def rollout_memory(cfg: ExperimentConfig, hf: HFModelConfig, total_params: int) -> RolloutMemory:
    profile = ENGINE_PROFILES[cfg.rollout.engine](cfg)
    tokens = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    per_token = kv_bytes_per_token(hf, profile.tp)
    return RolloutMemory(profile=profile, tokens_per_sequence=tokens,
                         weights=total_params * ENGINE_BYTES / profile.tp,
                         kv_cache=per_token * profile.sequences * tokens, kv_bytes_per_token=per_token)
