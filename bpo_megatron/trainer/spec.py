"""What a train actor is built from, in one value: ``TrainerSpec(...).build()``.

Every place that makes a trainer rank — the Ray worker (from an experiment:
``ExperimentConfig.trainer_spec()``), the GPU kit, the benchmarks and the tests
(``bpo_megatron.testing``) — states the sections it cares about and leaves the rest at their
defaults, so a new setting of the trainer reaches all of them through this one constructor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bpo_megatron.losses import PolicyLossConfig
from bpo_megatron.models import HFModelConfig, ModelOptions
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.trainer.config import TrainerConfig
from bpo_megatron.trainer.optimizer import OptimizerSettings

if TYPE_CHECKING:
    from bpo_megatron.trainer.actor import TrainActor


@dataclass(frozen=True)
class TrainerSpec:
    """One trainer rank's sections. ``hf``: the model's Hugging Face config (an
    :class:`HFModelConfig`, a directory or a ``config.json``); ``weights``: a Hugging Face
    directory loaded into the model after it is built (None: Megatron's initialisation, seeded by
    ``trainer.seed``)."""

    hf: HFModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelOptions = field(default_factory=ModelOptions)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    weights: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.hf, HFModelConfig):
            object.__setattr__(self, "hf", HFModelConfig.load(self.hf))
        if isinstance(self.loss, str):  # a loss by name: its defaults
            object.__setattr__(self, "loss", PolicyLossConfig(name=self.loss))
        if isinstance(self.weights, Path):
            object.__setattr__(self, "weights", str(self.weights))

    def build(self) -> "TrainActor":
        """This rank's actor, in the current torch.distributed world (every rank calls it)."""
        from bpo_megatron.trainer.actor import TrainActor

        actor = TrainActor(self.hf, parallel=self.parallel, model=self.model, loss=self.loss,
                           optimizer=self.optimizer, trainer=self.trainer)
        if self.weights is not None:
            actor.load_hf(self.weights)
        return actor
