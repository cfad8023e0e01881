"""The rollout-engine interface and its registry.

The RL loop only talks to :class:`RolloutEngine`; which engine runs behind it (embedded
transformers on CPU, SGLang or vLLM on GPUs) is a config choice resolved through
:data:`ENGINES`, so the loop never imports an engine's heavy dependencies.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from bpo_megatron.rollout.types import EngineHealth, GenerationRequest, Sample


@dataclass(frozen=True)
class EngineCapabilities:
    captures_routing: bool  # can return routed experts per processed token (R3)


class RolloutEngine(abc.ABC):
    """Generates samples from the current policy and takes new weights from the trainer."""

    capabilities: EngineCapabilities

    @abc.abstractmethod
    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        """All ``n`` samples of every request, in request order then index order."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load Hugging Face-named tensors (the on-disk names); returns the bytes received."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop admitting work (before a weight update)."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Admit work again (after a weight update; caches of old weights are gone)."""

    @abc.abstractmethod
    def health(self) -> EngineHealth: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...


# engine name -> "module:Class"; imported only when the engine is used
ENGINES: dict[str, str] = {
    "hf": "bpo_megatron.rollout.hf_engine:HFEngine",
    "sglang": "bpo_megatron.rollout.sglang:SGLangEngine",
    "vllm": "bpo_megatron.rollout.vllm_engine:VLLMEngine",
}


def engine_class(name: str) -> type[RolloutEngine]:
    if name not in ENGINES:
        raise ValueError(f"rollout.engine={name!r} is unknown; choose one of {sorted(ENGINES)}")
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)
