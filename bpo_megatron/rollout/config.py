"""The ``rollout`` section: which engine generates, and how it samples."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from bpo_megatron.config import build_sections
from bpo_megatron.rollout.agents.config import AgentConfig
from bpo_megatron.rollout.engine import ENGINES, EngineSpec, engine_options, engine_spec


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling for training (the paper: G=16 at T=1.0, top-p 1.0, no top-k, 16k tokens).

    ``capture_routed_experts`` makes the engine record the experts of every processed token;
    R3 (``model.routing_replay``) needs it. Every engine of the registry (``ENGINES``,
    ``rollout/engine.py``) has its own section here, ``rollout.<engine>`` (``rollout.hf``,
    ``rollout.sglang``, ``rollout.vllm``, ...): its typed options, built from a mapping by the
    dataclass its spec names (``EngineSpec.options``, ``rollout/<engine>/options.py``), so this
    section imports no engine and lists none; only the section of the chosen engine is used, by
    that engine alone. ``agent`` makes every response a conversation with a tool
    (``rollout/agents``; off by default).
    """

    # the engine that generates: a name of the engine registry (ENGINES), whose own section is rollout.<engine>
    engine: str = field(default="hf", metadata={"choices": lambda: tuple(ENGINES)})
    num_engines: int = 1  # rollout engines; each generates its share of a step's requests
    group_size: int = 16  # responses per prompt (G), the group its advantages are computed in
    temperature: float = 1.0  # sampling temperature; the trainer's log π is computed at the same one
    top_p: float = 1.0  # nucleus sampling (1.0: off)
    top_k: int = 0  # top-k sampling (0: off)
    max_new_tokens: int = 16384  # response length limit (a response cut there is truncated: data.truncated_reward)
    stop_token_ids: tuple[int, ...] = ()  # added to the tokenizer's end-of-sequence and end-of-turn tokens
    capture_routed_experts: bool = True
    seed: int = 0  # the sampling seeds' base: a step's requests draw from seeds derived from seed + step
    threads_per_engine: int = 1  # torch threads of the embedded engine
    # An engine that dies, does not answer a generate call within generate_timeout_s (None: no
    # limit), makes no progress for stall_timeout_s while it has requests (no decoding step, or no
    # answer to a progress probe: a stopped or wedged process), or does not answer any other call
    # (memory, weights, version, health) within stall_timeout_s is replaced, in whatever phase
    # the step is, and its requests sent again; max_restarts per engine (on average) bounds the
    # replacements of a run.
    generate_timeout_s: float | None = None
    stall_timeout_s: float = 120.0
    max_restarts: int = 2
    # every registered engine's section, written at this level as rollout.<engine> (the config
    # loader's "sections": one per entry of the registry, built by its spec's options dataclass)
    engine_sections: Mapping[str, Any] = field(default_factory=dict, metadata={"sections": engine_options})
    agent: AgentConfig = field(default_factory=AgentConfig)

    def __post_init__(self) -> None:
        ENGINES.check(self.engine)
        # every engine's section, at its defaults where none was given
        object.__setattr__(self, "engine_sections", build_sections(engine_options(), self.engine_sections, "rollout"))
        for name in ("num_engines", "group_size", "max_new_tokens", "threads_per_engine"):
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
        if not (self.stall_timeout_s > 0 and math.isfinite(self.stall_timeout_s)):
            raise ValueError(f"rollout.stall_timeout_s must be > 0 seconds, got {self.stall_timeout_s}")
        if self.max_restarts < 0:
            raise ValueError(f"rollout.max_restarts must be >= 0, got {self.max_restarts}")

    @property
    def spec(self) -> EngineSpec:
        """The chosen engine's spec."""
        return engine_spec(self.engine)

    @property
    def options(self) -> Any:
        """The chosen engine's own section (``rollout.<engine>``)."""
        return self.engine_sections[self.engine]

    def unused_settings(self) -> list[tuple[str, str, Any]]:
        """``(engine, field, value)`` for every setting in the section of an engine other than
        ``engine`` that differs from its default: that section is never read, so what it says
        (``rollout.sglang.quantization=fp8`` under ``rollout.engine=hf``, say) does not happen."""
        unused = []
        for engine, section in self.engine_sections.items():
            if engine == self.engine:
                continue
            for option in dataclasses.fields(section):
                if option.default is not dataclasses.MISSING:
                    default = option.default
                elif option.default_factory is not dataclasses.MISSING:
                    default = option.default_factory()
                else:  # a required option: any value was set on purpose
                    default = dataclasses.MISSING
                value = getattr(section, option.name)
                if value != default:
                    unused.append((engine, option.name, value))
        return unused

    @property
    def sync_dtype(self) -> str | None:
        """The precision weights are sent to the engines in (the engine's spec decides: the
        embedded engine takes its own precision, so what it holds is exactly what was sent;
        other engines receive the trainer's tensors as they are)."""
        return self.spec.weight_dtype(self.options)

    def quantized_layout(self, hf: Any) -> Any:
        """Which of the model's (``hf``: its HFModelConfig) quantized layers the engine builds at its
        configured layout, serves in its dtype instead, or cannot serve (``EngineSpec.quantized_layout``;
        None: it does not quantize)."""
        return self.spec.quantized_layout(self.options, hf)

    def sync_delta(self, colocated: bool, gpus: bool) -> str:
        """How a delta weight sync reaches the engines placed so (``EngineSpec.weight_delta``):
        "sparse" or "tensors"."""
        return self.spec.weight_delta(self.options, self.spec.transport(self.options, colocated, gpus))

    def sync_quantization(self, hf: Any) -> Any:
        """How the engines hold the model's (``hf``) weights beyond their dtype (``fp8``), so the
        trainer sends them so: a :class:`bpo_megatron.weights.fp8.SyncQuantization`, or None (as
        they are)."""
        form = self.spec.weight_quantization(self.options)
        if form is None:
            return None
        from bpo_megatron.weights.fp8 import SyncQuantization

        layout = self.quantized_layout(hf)
        return SyncQuantization(form, frozenset(layout.unquantized) if layout is not None else frozenset())
