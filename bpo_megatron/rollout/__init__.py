"""Rollout engines: generation with per-token log-probs and routed-expert capture (R3)."""

from bpo_megatron.rollout.engine import (
    ENGINES,
    EngineCapabilities,
    EngineContext,
    EngineProfile,
    EngineSpec,
    RolloutEngine,
    engine_spec,
)
from bpo_megatron.rollout.types import EngineHealth, GenerationRequest, Sample, SamplingParams

__all__ = [
    "ENGINES",
    "EngineCapabilities",
    "EngineContext",
    "EngineProfile",
    "EngineSpec",
    "EngineHealth",
    "GenerationRequest",
    "RolloutEngine",
    "Sample",
    "SamplingParams",
    "engine_spec",
]
