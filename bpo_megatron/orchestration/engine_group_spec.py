"""What an engine group is built from, in one value: ``EngineGroup(spec, model_dir)``.

As :class:`~bpo_megatron.trainer.spec.TrainerSpec` is for the trainer ranks: a run makes it from its
experiment (``ExperimentConfig.engine_group_spec()``; ``evaluation=True``: the background evaluation
engines), a test from the sections it varies, the rest at their defaults. The group reads nothing
else, so a new setting of the engines reaches every place that starts them through this value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bpo_megatron.models import HFModelConfig
from bpo_megatron.orchestration.config import ClusterConfig
from bpo_megatron.orchestration.placement import EVALUATION, ROLLOUT
from bpo_megatron.rollout.config import RolloutConfig
from bpo_megatron.weight_sync.config import WeightSyncConfig


@dataclass(frozen=True)
class EngineGroupSpec:
    """One engine group's sections. ``hf``: the served model's Hugging Face config (an
    :class:`HFModelConfig`, a directory or a ``config.json``; routing capture is laid out by it);
    ``rollout``: the engine, its own section and the group's restart and timeout bounds;
    ``cluster``: each engine's resources without a placement, and whether the rollout engines share
    the trainer's devices. ``max_staleness`` (``train.async.max_staleness``): the generations an
    engine may have under way at once, less one, when it pauses them for weight updates;
    ``max_prompt_tokens`` (``data.max_prompt_tokens``): with ``rollout.max_new_tokens``, the longest
    sequence a request reaches. ``role``: rollout, or evaluation (a run's background evaluation
    engines: devices of their own, no routing capture); ``num_engines`` of them (None:
    ``rollout.num_engines``), indexed from ``first_index`` (an SGLang server's port is its base
    port plus its index: the evaluation engines' follow the rollout engines').
    ``weight_bucket_bytes`` (``weight_sync.bucket_mb``): the size of the buckets a weight sync
    sends, which an engine loads one at a time."""

    hf: HFModelConfig
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    max_staleness: int = 0
    max_prompt_tokens: int = 0
    role: str = ROLLOUT
    num_engines: int | None = None
    first_index: int = 0
    weight_bucket_bytes: int = field(default_factory=lambda: WeightSyncConfig().bucket_bytes)

    def __post_init__(self) -> None:
        if not isinstance(self.hf, HFModelConfig):
            object.__setattr__(self, "hf", HFModelConfig.load(self.hf))
        if self.role not in (ROLLOUT, EVALUATION):
            raise ValueError(f"an engine group's role is {ROLLOUT!r} or {EVALUATION!r}, not {self.role!r}")
        if self.num_engines is not None and self.num_engines < 1:
            raise ValueError(f"an engine group has at least one engine, got num_engines={self.num_engines}")

    @property
    def count(self) -> int:
        """How many engines the group starts."""
        return self.rollout.num_engines if self.num_engines is None else self.num_engines

    @property
    def longest_sequence(self) -> int:
        """The longest sequence a request can reach: the longest prompt and the longest response."""
        return self.max_prompt_tokens + self.rollout.max_new_tokens
