"""Rewards of generated responses: decode, then verify against the reference answers."""

from __future__ import annotations

import torch

from bpo_megatron.rollout import Sample


def response_texts(samples: list[Sample], tokenizer) -> list[str]:
    eos = set(tokenizer.eos_token_ids)
    return [tokenizer.decode([t for t in s.response_tokens.tolist() if t not in eos]) for s in samples]


def score(samples: list[Sample], answers: list[str], tokenizer, reward_fn) -> torch.Tensor:
    """Rewards in sample order (``answers`` holds one answer per sample)."""
    return torch.tensor(reward_fn(response_texts(samples, tokenizer), answers), dtype=torch.float32)
