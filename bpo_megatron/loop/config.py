"""The ``train`` and ``checkpoint`` sections: the shape of one RL step and when to save."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class AsyncConfig:
    """``train.async``: generation for the next steps runs while a step trains
    (loop/rollout_pipeline.py). ``max_staleness`` k: a step trains on responses sampled by weights
    at most k updates old (0: the synchronous loop). A response found older than that (an engine
    restarted with older weights, say) is regenerated with the current weights, or its group is
    dropped and replaced by fresh prompts (``stale``)."""

    max_staleness: int = 0
    stale: Literal["regenerate", "drop"] = "regenerate"

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"train.async.max_staleness must be >= 0 (0: synchronous), got {self.max_staleness}")


@dataclass(frozen=True)
class LoopConfig:
    """One step samples ``prompts_per_step`` prompts × ``rollout.group_size`` responses and takes
    ``minibatches_per_step`` optimizer steps on equal slices of them (paper: 256 × 16 responses,
    8 minibatches of 512, 400 steps). ``steps: 0`` with ``sft_warmup_steps`` > 0 is a supervised
    run: the warm start alone, saved as the checkpoint of step 0 (e.g. a base model that every run
    of an experiment starts from, exported with ``bpo-megatron convert mcore-to-hf``)."""

    steps: int = 400
    prompts_per_step: int = 256
    minibatches_per_step: int = 8
    sft_warmup_steps: int = 0  # supervised steps on reference answers before RL (CPU demos)
    sft_batch_size: int = 64  # reference answers per warm-start step
    sft_lr: float | None = None  # learning rate of the warm start (None: optimizer.lr)
    routing_agreement_samples: int = 8  # responses per step re-routed by the trainer to measure agreement
    # Before the step's updates, the trainer recomputes log π_old of every response under the
    # weights of the step's start (one forward pass over the batch): the loss then anchors its
    # ratios to them, and loss.correction reweights by π_old/μ (the engine's). Needed by every
    # correction. Those weights sampled the batch in the synchronous loop; under train.async they
    # are newer (decoupled PPO), so ρ = π_old/μ carries the responses' staleness too.
    recompute_old_logprobs: bool = False
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig, metadata={"key": "async"})
    # DAPO batch shaping (loop/batch_shaping.py): dynamic_sampling drops groups whose rewards do not
    # vary and draws more prompts, in at most dynamic_sampling_max_rounds rounds; and the soft
    # overlong punishment over the last overlong_buffer tokens before rollout.max_new_tokens (0:
    # off), reaching -overlong_penalty.
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 4
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.steps < 0 or (self.steps == 0 and not self.sft_warmup_steps):
            raise ValueError(f"train.steps must be >= 1 (or 0 with train.sft_warmup_steps > 0: a supervised run), "
                             f"got {self.steps} with train.sft_warmup_steps={self.sft_warmup_steps}")
        for name in ("prompts_per_step", "minibatches_per_step", "sft_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.dynamic_sampling_max_rounds < 1:
            raise ValueError(f"train.dynamic_sampling_max_rounds must be >= 1, got {self.dynamic_sampling_max_rounds}")
        if self.overlong_buffer < 0 or not self.overlong_penalty >= 0:
            raise ValueError(f"train.overlong_buffer={self.overlong_buffer} and train.overlong_penalty="
                             f"{self.overlong_penalty} must be >= 0")
        if self.sft_warmup_steps < 0:
            raise ValueError("train.sft_warmup_steps must be >= 0")
        if self.sft_lr is not None and not self.sft_lr > 0:
            raise ValueError(f"train.sft_lr must be > 0 (or null), got {self.sft_lr}")


@dataclass(frozen=True)
class CheckpointConfig:
    """When the trainer's state is saved under the run directory's ``checkpoints/``, how many saves
    are kept, and whether a run continues from the newest one."""

    every: int = 10  # steps; 0 saves only at the end
    keep_last: int | None = 3  # newest checkpoints kept, besides the best evaluated one; null: all
    resume: bool = True  # continue from the newest checkpoint in the run directory
    # true: a step waits only while the state is staged (host memory: `bpo-megatron plan` prints
    # it) and a background process writes it, published once whole; false: the step waits for the
    # write. Either way a save is atomic and at most one is in flight (bpo_megatron/trainer/checkpoint.py)
    background: bool = True

    def __post_init__(self) -> None:
        if self.every < 0 or (self.keep_last is not None and self.keep_last < 1):
            raise ValueError("checkpoint.every must be >= 0 and checkpoint.keep_last >= 1 (or null)")
        if not isinstance(self.background, bool):
            raise ValueError(f"checkpoint.background must be true (saves written in the background) or false "
                             f"(each save blocks the step until written), got {self.background!r}")
