"""The vLLM engine as the rest of the system sees it (registered in ``rollout.engine.ENGINES``)."""

from __future__ import annotations

from dataclasses import asdict

from bpo_megatron.rollout.engine import EngineContext, EngineProfile, EngineSpec, RolloutEngine
from bpo_megatron.rollout.vllm.options import VLLMConfig, VLLMOptions


def engine_config(options: VLLMOptions, context: EngineContext) -> VLLMConfig:
    """An engine of a run: its checkpoint, capture and weight buckets as the run decides."""
    return VLLMConfig(**asdict(options), model_path=context.model_dir,
                      capture_routed_experts=context.routing is not None, weight_bucket_bytes=context.weight_bucket_bytes)


def _build(options: VLLMOptions, context: EngineContext) -> RolloutEngine:
    from bpo_megatron.rollout.vllm.engine import VLLMEngine

    config = engine_config(options, context)
    return VLLMEngine(context.model_dir, capture_routing=config.capture_routed_experts, config=config)


def _profile(options: VLLMOptions, requests: int, gpus_per_engine: float) -> EngineProfile:
    # it hands nothing back when released (no sleep mode here): colocated, it keeps all its memory
    return EngineProfile(tp=options.tensor_parallel_size, sequences=requests, released=())


SPEC = EngineSpec(
    name="vllm",
    options=VLLMOptions,
    build=_build,
    profile=_profile,
    transport=lambda options, colocated, gpus: "object_store",
    library="vllm",  # an in-process engine: vLLM's LLM runs in the engine actor
    captures_routing_without_gpu=False,  # routed-expert capture needs vLLM's GPU model runner
    # logprobs=k: its processed log-probs are the drawn distribution's only without top-k/top-p, its
    # raw ones only at temperature 1 without them (vllm/engine.py refuses the rest per request)
    top_logprobs="unfiltered",
)
