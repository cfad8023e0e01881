"""Memory of one rollout engine GPU: weights at the engine's tensor parallelism plus the KV cache
of the sequences it holds at once.

What an engine runs with comes from its own spec (``rollout/<engine>/spec.py``): its tensor
parallelism, the sequences it keeps resident and the share of a GPU it reserves (SGLang's
``mem_fraction_static``), given the requests one engine serves per step.

KV cache per GPU = 2 (K and V) × layers × KV heads per rank × head_dim × bytes × tokens, with
tokens = sequences × (max prompt + max response) — the worst case, every sequence at full
length. KV heads are split over the engine's TP ranks and replicated when there are fewer of
them than ranks. With multi-head latent attention (DeepSeek-V3) an engine caches per token and layer
the compressed key/value latent and the rotated key shared by all heads (``kv_lora_rank +
qk_rope_head_dim``, as SGLang and vLLM do), whole on every TP rank. Weights are split over TP (experts included). An engine that admits requests
as its own KV pool allows (SGLang: the pool is ``mem_fraction_static`` of the GPU less the
weights, requests beyond it wait in the server's queue) reserves that pool whatever the requests
in flight; what counts is how many full-length sequences it holds at once.

Requests in flight on such an engine (rule): at most the full-length sequences its pool holds,
``⌊pool / (KV bytes per token × (max prompt + max response))⌋``. SGLang admits a request by its
prompt and an estimate of what it will still generate; when the running requests outgrow the
pool it retracts some, and a response retracted for space has its routing recomputed and is
masked out of the loss (``rollout/sglang/protocol.py``, ``space_retractions``). Within the rule
the running requests fit the pool even at full length, so none is retracted for space. Unset
(``rollout.sglang.max_inflight: null``), an engine keeps that many in flight (the server measures
its pool at start; ``SGLangEngine.max_inflight``); a config asking for more is refused at
``train --check`` and ``bpo-megatron plan`` marks it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.rollout.engine import EngineProfile

if TYPE_CHECKING:
    from bpo_megatron.experiment import ExperimentConfig

# Engines serve in bf16 on GPUs (the checkpoints' dtype), whatever the trainer's dtype.
ENGINE_BYTES = 2
# What a colocated trainer rank keeps on its GPU while offloaded, beyond what the offload moves:
# its CUDA context with cuBLAS/cuDNN handles and workspaces, and the buffers of each NCCL
# communicator it has used (NCCL allocates them per communicator, per channel and peer, and keeps
# them until the communicator is destroyed). Estimates until a GPU measures them (the kit's
# trainer_offload reports the device memory a rank holds after offloading).
TRAINER_CONTEXT_BYTES = 0.8e9
NCCL_COMMUNICATOR_BYTES = 0.6e9


def engine_profile(cfg: ExperimentConfig) -> EngineProfile:
    """The chosen engine's profile when it serves its share of a step's responses."""
    requests = math.ceil(cfg.responses_per_step / cfg.rollout.num_engines)
    return cfg.rollout.spec.profile(cfg.rollout.options, requests, cfg.cluster.gpus_per_engine)


@dataclass(frozen=True)
class RolloutMemory:
    profile: EngineProfile
    tokens_per_sequence: int
    weights: float
    kv_cache: float
    kv_bytes_per_token: float  # per GPU
    resident_sequences: int | None = None  # full-length sequences a server's own KV pool holds
    inflight: int = 0  # requests one engine keeps in flight (the config's, or the pool's cap when unset)

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache

    @property
    def inflight_cap(self) -> int | None:
        """The most requests an engine that admits by its own pool keeps in flight: the
        full-length sequences the pool holds (see the module's rule); None for other engines."""
        return self.resident_sequences

    @property
    def inflight_ok(self) -> bool:
        cap = self.inflight_cap
        return cap is None or self.profile.requested_inflight is None or self.profile.requested_inflight <= cap


def kv_bytes_per_token(hf: HFModelConfig, tp: int, dtype_bytes: int = ENGINE_BYTES) -> float:
    if hf.multi_latent_attention:
        # the engines cache MLA's compressed latent and shared rotated key per token, whole on every
        # TP rank, instead of per-head keys and values
        return hf.num_hidden_layers * (hf.kv_lora_rank + hf.head_dim) * dtype_bytes
    kv_heads_per_rank = math.ceil(hf.num_key_value_heads / tp)
    return 2 * hf.num_hidden_layers * kv_heads_per_rank * hf.head_dim * dtype_bytes


def rollout_memory(cfg: ExperimentConfig, hf: HFModelConfig, total_params: int,
                   gpu_bytes: float | None = None) -> RolloutMemory:
    profile = engine_profile(cfg)
    tokens = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    per_token = kv_bytes_per_token(hf, profile.tp)
    weights = total_params * ENGINE_BYTES / profile.tp
    if profile.admits_by_pool and profile.pool_fraction is not None and gpu_bytes:
        pool = max(0.0, profile.pool_fraction * gpu_bytes - weights)
        resident = int(pool // (per_token * tokens))
        inflight = profile.sequences if profile.requested_inflight is not None else min(profile.sequences, resident)
        return RolloutMemory(profile=profile, tokens_per_sequence=tokens, weights=weights, kv_cache=pool,
                             kv_bytes_per_token=per_token, resident_sequences=resident, inflight=inflight)
    return RolloutMemory(profile=profile, tokens_per_sequence=tokens, weights=weights,
                         kv_cache=per_token * profile.sequences * tokens, kv_bytes_per_token=per_token,
                         inflight=profile.sequences)


@dataclass(frozen=True)
class TrainerResidual:
    """What an offloaded colocated trainer rank still holds on the GPU its engine shares."""

    communicators: int  # NCCL communicators the rank uses (one per parallel group of more than one rank)
    groups: tuple[str, ...]

    @property
    def total(self) -> float:
        return TRAINER_CONTEXT_BYTES + self.communicators * NCCL_COMMUNICATOR_BYTES


def trainer_residual(*, tp: int, pp: int, ep: int, etp: int, dp: int, expert_dp: int, cp: int = 1) -> TrainerResidual:
    """The communicators a trainer rank uses: tensor, pipeline (and its embedding group), context
    (and the data × context group DDP reduces over), expert, expert-tensor, data and expert-data
    parallel groups of more than one rank."""
    sizes = {"tp": tp, "pp": pp, "embedding": pp, "cp": cp, "dp × cp": dp * cp if cp > 1 else 1, "ep": ep,
             "etp": etp, "dp": dp, "expert dp": expert_dp}
    groups = tuple(name for name, size in sizes.items() if size > 1)
    return TrainerResidual(communicators=len(groups), groups=groups)
