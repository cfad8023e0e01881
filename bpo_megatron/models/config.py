"""The ``model`` section of an experiment: which checkpoint, and how to build and train it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from bpo_megatron.models.options import ModelOptions

Init = Literal["pretrained", "random"]


@dataclass(frozen=True)
class ModelConfig:
    """``path`` is a Hugging Face directory (config.json + weights). ``init: random`` starts from
    random weights of that config instead (CPU demos); ``config`` may then name just a
    ``config.json``. ``tokenizer`` is a Hugging Face tokenizer directory or ``char`` (the built-in
    character tokenizer of the procedural tasks). ``options``: how the trainer builds the model
    (:class:`ModelOptions`), written beside these keys (``model.routing_replay``), and what the
    trainer's spec receives."""

    path: str = ""
    init: Init = "pretrained"
    tokenizer: str = ""
    options: ModelOptions = field(default_factory=ModelOptions, metadata={"inline": True})

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("model.path is required: a Hugging Face model directory (or config.json with init=random)")
        if self.init not in ("pretrained", "random"):
            raise ValueError(f"model.init={self.init!r} must be 'pretrained' or 'random'")
