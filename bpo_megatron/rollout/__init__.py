"""Rollout engines: generation with per-token log-probs and routed-expert capture (R3)."""

from bpo_megatron.rollout.engine import ENGINES, EngineCapabilities, RolloutEngine, engine_class
from bpo_megatron.rollout.types import EngineHealth, GenerationRequest, Sample, SamplingParams

__all__ = [
    "ENGINES",
    "EngineCapabilities",
    "EngineHealth",
    "GenerationRequest",
    "RolloutEngine",
    "Sample",
    "SamplingParams",
    "engine_class",
]
