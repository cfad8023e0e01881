"""Training samples for tests, benchmarks and the GPU kit: random tokens, log μ, advantages and
R3 routing of known shapes, and RL's long-tailed response lengths."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from bpo_megatron.testing.models import tiny_moe
from bpo_megatron.trainer.samples import TrainSample


def random_routing(n: int, hf, gen: torch.Generator) -> torch.Tensor:
    """Distinct top-k expert ids for n positions of every MoE layer."""
    scores = torch.rand(n, len(hf.moe_layers), hf.num_experts, generator=gen)
    return scores.argsort(dim=-1)[..., : hf.num_experts_per_tok]


def random_tokens(count: int, length: int, vocab: int, *, seed: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, vocab, (length,), generator=gen).tolist()) for _ in range(count)]


def make_samples(count: int, *, seed: int, routing: bool = False, hf=None) -> list[TrainSample]:
    """Prompts of 2–5 and responses of 2–7 tokens; advantages of both signs (for ``hf``, by
    default the tiny MoE)."""
    hf = hf or tiny_moe()
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        prompt = int(torch.randint(2, 6, (1,), generator=gen))
        response = int(torch.randint(2, 8, (1,), generator=gen))
        tokens = torch.randint(0, hf.vocab_size, (prompt + response,), generator=gen)
        samples.append(TrainSample(
            tokens=tokens,
            response_start=prompt,
            rollout_logprobs=-torch.rand(response, generator=gen) * 4 - 3,
            advantage=(1.0 if i % 2 == 0 else -1.0) * (0.5 + i / count),
            routed_experts=random_routing(prompt + response - 1, hf, gen) if routing else None,
        ))
    return samples


def samples_of_lengths(positions: tuple[int, ...], prompts: tuple[int, ...], *, seed: int, old_spread: float,
                       masked: tuple[int, ...] = (), hf=None) -> list[TrainSample]:
    """Samples of the given input positions (len(tokens) − 1) and prompt lengths with R3 routing,
    log μ, log π_old within ``old_spread`` of it (clamped to ≤ 0), advantages of both signs, and
    for the samples ``masked`` a ``train_mask`` leaving some response tokens out (never the last)."""
    hf = hf or tiny_moe()
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, (length, prompt) in enumerate(zip(positions, prompts)):
        response = length + 1 - prompt
        rollout = -torch.rand(response, generator=gen) * 2 - 0.5
        old = (rollout + (torch.rand(response, generator=gen) * 2 - 1) * old_spread).clamp(max=0.0)
        train_mask = None
        if i in masked:
            train_mask = torch.rand(response, generator=gen) > 0.4
            train_mask[-1] = True
        samples.append(TrainSample(
            tokens=torch.randint(0, hf.vocab_size, (length + 1,), generator=gen), response_start=prompt,
            rollout_logprobs=rollout, advantage=(1.0 if i % 3 else -1.5) * (0.5 + i / 8),
            routed_experts=random_routing(length, hf, gen), old_logprobs=old, train_mask=train_mask))
    return samples


def train_samples(samples: list, advantages: torch.Tensor) -> list[TrainSample]:
    """Training samples of engine samples (routing kept for R3), with the given advantages."""
    return [TrainSample(tokens=s.tokens, response_start=s.prompt_tokens.numel(), rollout_logprobs=s.rollout_logprobs,
                        advantage=float(a), routed_experts=s.routed_experts) for s, a in zip(samples, advantages.tolist())]


def long_tailed(samples: list, *, seed: int, at_cap: float = 0.3, shortest: float = 1 / 16) -> list:
    """``samples`` (training samples) with their responses cut to RL's long-tailed lengths: a
    share ``at_cap`` keeps its whole response, the rest keep a log-uniform length between
    ``shortest`` of it and all of it (log μ and routing cut alike)."""
    gen = torch.Generator().manual_seed(seed)
    cut = []
    for s in samples:
        full = s.num_response_tokens
        if float(torch.rand((), generator=gen)) < at_cap:
            keep = full
        else:
            low = math.log(max(1.0, full * shortest))
            keep = max(1, min(full, round(math.exp(low + float(torch.rand((), generator=gen)) * (math.log(full) - low)))))
        end = s.response_start + keep
        cut.append(replace(s, tokens=s.tokens[:end], rollout_logprobs=s.rollout_logprobs[:keep],
                           routed_experts=None if s.routed_experts is None else s.routed_experts[:end - 1],
                           old_logprobs=None if s.old_logprobs is None else s.old_logprobs[:keep],
                           train_mask=None if s.train_mask is None else s.train_mask[:keep]))
    return cut
