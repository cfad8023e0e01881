"""Token sampling for a batch of rows that may each have their own settings, without per-row loops.

Semantics (fixed here, so the trainer can recompute them): the logits are cast to fp32 and divided
by the temperature; their log-softmax gives log μ of the sampled token. Top-k, then top-p on the
renormalised top-k distribution, only shape the distribution sampled from.

Randomness: each row owns a ``torch.Generator`` seeded from its request's seed and its index among
the request's ``n`` samples, and draws one uniform per step (in fixed blocks) that picks a token by
inverse CDF. A seed therefore gives the same tokens whatever else is batched with the request.
"""

from __future__ import annotations

import os

import torch

from bpo_megatron.rollout.types import SamplingParams

UNIFORM_BLOCK = 64  # uniforms a row draws at a time; part of what a seed means, do not change lightly


def row_seeds(seed: int | None, n: int) -> list[int]:
    """Seeds of the ``n`` rows of one request: derived from ``seed``, or fresh entropy when None."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 2
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**62, (n,), generator=generator).tolist()


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index of the token each row's uniform falls on; tokens of probability 0 are never chosen."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    # u·total may round up to total itself; keep it strictly below so searchsorted stays in range
    # and lands on a token whose probability moved the CDF.
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]


class BatchSampler:
    """Per-row sampling settings and random streams of one batch; rows can be dropped as they finish."""

    def __init__(self, params: list[SamplingParams], seeds: list[int], device: torch.device) -> None:
        self._device = device
        self.temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        self._filtered = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
        width = max(1, max(len(p.stop_token_ids) for p in params))
        stops = [list(p.stop_token_ids) + [-1] * (width - len(p.stop_token_ids)) for p in params]
        self.stop_ids = torch.tensor(stops, dtype=torch.long, device=device)  # -1 pads: never a token
        self.max_new_tokens = torch.tensor([p.max_new_tokens for p in params], dtype=torch.long, device=device)
        self._generators = [torch.Generator().manual_seed(s) for s in seeds]
        self._uniforms = torch.empty(len(params), 0, device=device)

    def sample(self, logits: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[b]`` and their log μ ``[b]`` (fp32) from last-position logits ``[b, V]``."""
        logprobs = torch.log_softmax(logits.float() / self.temperature[:, None], dim=-1)
        uniforms = self._uniforms_at(step)
        if self._filtered:
            tokens = self._sample_filtered(logprobs, uniforms)
        else:
            tokens = _inverse_cdf(logprobs.exp(), uniforms)
        return tokens, logprobs.gather(1, tokens[:, None])[:, 0]

    def _sample_filtered(self, logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """Top-k then top-p, in descending-probability order, as one masked pass over the batch."""
        sorted_logprobs, order = logprobs.sort(dim=-1, descending=True)
        probs = sorted_logprobs.exp()
        rank = torch.arange(probs.shape[-1], device=probs.device)
        top_k = torch.where(self.top_k > 0, self.top_k, probs.shape[-1])
        probs = probs.masked_fill(rank >= top_k[:, None], 0.0)
        cumulative = probs.cumsum(-1)
        # keep the smallest prefix whose (renormalised) mass reaches top_p: a token stays when the
        # mass before it is still below top_p, so the most likely token always stays
        below = (cumulative - probs) < self.top_p[:, None] * cumulative[:, -1:]
        picked = _inverse_cdf(probs.masked_fill(~below, 0.0), uniforms)
        return order.gather(1, picked[:, None])[:, 0]

    def _uniforms_at(self, step: int) -> torch.Tensor:
        column = step % UNIFORM_BLOCK
        if column == 0:  # steps start at 0; one small draw per row every UNIFORM_BLOCK steps
            self._uniforms = torch.stack(
                [torch.rand(UNIFORM_BLOCK, generator=g) for g in self._generators]).to(self._device)
        return self._uniforms[:, column]

    def is_stop(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens[:, None] == self.stop_ids).any(dim=1)

    def keep(self, rows: torch.Tensor) -> None:
        """Drop every row not in ``rows`` (indices into the current rows, ascending)."""
        for name in ("temperature", "top_k", "top_p", "stop_ids", "max_new_tokens", "_uniforms"):
            setattr(self, name, getattr(self, name)[rows])
        self._generators = [self._generators[i] for i in rows.tolist()]
