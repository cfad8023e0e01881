"""Rewards of generated responses: decode, then verify against the reference answers."""

from __future__ import annotations

import torch

from bpo_megatron.rollout import Sample


def response_texts(samples: list[Sample], tokenizer) -> list[str]:
    stops = set(tokenizer.eos_token_ids) | set(tokenizer.end_of_turn_ids)
    return [tokenizer.decode([t for t in s.response_tokens.tolist() if t not in stops]) for s in samples]


def truncated(sample: Sample) -> bool:
    """Cut off by the length limit: whatever its text ends with, the response never finished."""
    return sample.finish_reason == "length"


def score(samples: list[Sample], answers: list[str], tokenizer, reward_fn, *,
          truncated_reward: float) -> torch.Tensor:
    """Rewards in sample order (``answers`` holds one answer per sample). A truncated response
    scores ``truncated_reward`` (``data.truncated_reward``) unverified: its text may end in the
    reference answer mid-derivation, and rewarding that teaches nothing about finishing."""
    finished = [i for i, s in enumerate(samples) if not truncated(s)]
    rewards = [float(truncated_reward)] * len(samples)
    verified = reward_fn(response_texts([samples[i] for i in finished], tokenizer), [answers[i] for i in finished])
    for i, value in zip(finished, verified):
        rewards[i] = value
    return torch.tensor(rewards, dtype=torch.float32)
