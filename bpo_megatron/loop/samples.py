"""From scored samples to training samples: group-normalised advantages and response statistics."""

from __future__ import annotations

import dataclasses

import torch

from bpo_megatron.algo import group_advantages
from bpo_megatron.rollout import Sample
from bpo_megatron.trainer.samples import TrainSample


def training_samples(samples: list[Sample], rewards: torch.Tensor, group_size: int, *,
                     keep_routing: bool) -> tuple[list[TrainSample], dict[str, float]]:
    """Samples arrive grouped (the G responses of a prompt together), as advantages need."""
    advantages, metrics = group_advantages(rewards, group_size)
    train = [TrainSample(tokens=s.tokens, response_start=s.prompt_tokens.numel(),
                         rollout_logprobs=s.rollout_logprobs, advantage=float(a),
                         routed_experts=s.routed_experts if keep_routing else None)
             for s, a in zip(samples, advantages.tolist())]
    lengths = torch.tensor([s.response_tokens.numel() for s in samples], dtype=torch.float32)
    metrics.update(response_length_mean=float(lengths.mean()), response_length_max=float(lengths.max()),
                   truncated_frac=sum(s.finish_reason == "length" for s in samples) / len(samples))
    return train, metrics


def with_old_logprobs(trainer, samples: list[TrainSample]) -> list[TrainSample]:
    """The samples with the trainer's log π_old of each response token under the current weights,
    the ones that sampled them (one forward pass over the batch, routing replayed as in training)."""
    scored = trainer.compute_logprobs(samples)
    return [dataclasses.replace(sample, old_logprobs=logprobs) for sample, logprobs in zip(samples, scored.logprobs)]
