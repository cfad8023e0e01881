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


def _sample_filtered(logprobs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     uniforms: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p, in descending-probability order, as one masked pass over the batch."""
    sorted_logprobs, order = logprobs.sort(dim=-1, descending=True)
    probs = sorted_logprobs.exp()
    rank = torch.arange(probs.shape[-1], device=probs.device)
    top_k = torch.where(top_k > 0, top_k, probs.shape[-1])
    probs = probs.masked_fill(rank >= top_k[:, None], 0.0)
    cumulative = probs.cumsum(-1)
    # keep the smallest prefix whose (renormalised) mass reaches top_p: a token stays when the
    # mass before it is still below top_p, so the most likely token always stays
    below = (cumulative - probs) < top_p[:, None] * cumulative[:, -1:]
    picked = _inverse_cdf(probs.masked_fill(~below, 0.0), uniforms)
    return order.gather(1, picked[:, None])[:, 0]


def draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         uniforms: torch.Tensor, filtered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[b]`` and their log μ ``[b]`` (fp32) from last-position logits ``[b, V]``, one
    uniform per row. ``filtered``: the batch goes through top-k/top-p (which orders the CDF by
    probability, so it picks another token for the same uniform than the unfiltered draw)."""
    logprobs = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    if filtered:
        tokens = _sample_filtered(logprobs, top_k, top_p, uniforms)
    else:
        tokens = _inverse_cdf(logprobs.exp(), uniforms)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


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
        return draw(logits, self.temperature, self.top_k, self.top_p, self._uniforms_at(step), self._filtered)

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


class SlotSampler:
    """Sampling settings and random streams of the rows held in fixed decoding slots; a slot takes
    a new row when its row is done (:mod:`bpo_megatron.rollout.hf.slots`).

    The random streams are :class:`BatchSampler`'s: a row's token ``t`` uses uniform ``t mod
    UNIFORM_BLOCK`` of the row's block ``t // UNIFORM_BLOCK``, drawn from the row's own generator,
    so a seed gives the same tokens in either engine loop. ``filtered`` is fixed for the session
    (``BatchSampler`` decides it per batch; the two agree when the session is one batch).
    """

    def __init__(self, slots: int, filtered: bool, device: torch.device) -> None:
        self._device = device
        self.filtered = filtered
        self.temperature = torch.ones(slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.long, device=device)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.max_new_tokens = torch.ones(slots, dtype=torch.long, device=device)
        self.stop_ids = torch.full((slots, 1), -1, dtype=torch.long, device=device)
        self._uniforms = torch.zeros(slots, UNIFORM_BLOCK, device=device)
        self._generators: list[torch.Generator | None] = [None] * slots
        self._drawn = [0] * slots  # tokens each slot's row has had uniforms for (host-side count)

    def assign(self, slots: list[int], params: list[SamplingParams], seeds: list[int]) -> None:
        """Give ``slots`` to new rows (their first token is sampled next)."""
        index = torch.tensor(slots, dtype=torch.long, device=self._device)
        self.temperature[index] = torch.tensor([p.temperature for p in params], device=self._device)
        self.top_k[index] = torch.tensor([p.top_k for p in params], device=self._device)
        self.top_p[index] = torch.tensor([p.top_p for p in params], device=self._device)
        self.max_new_tokens[index] = torch.tensor([p.max_new_tokens for p in params], device=self._device)
        width = max(self.stop_ids.shape[1], max(len(p.stop_token_ids) for p in params))
        if width > self.stop_ids.shape[1]:
            pad = self.stop_ids.new_full((self.stop_ids.shape[0], width - self.stop_ids.shape[1]), -1)
            self.stop_ids = torch.cat([self.stop_ids, pad], dim=1)
        stops = [list(p.stop_token_ids) + [-1] * (width - len(p.stop_token_ids)) for p in params]
        self.stop_ids[index] = torch.tensor(stops, dtype=torch.long, device=self._device)
        for slot, seed in zip(slots, seeds):
            self._generators[slot] = torch.Generator().manual_seed(seed)
            self._drawn[slot] = 0

    def release(self, slot: int) -> None:
        self._generators[slot] = None

    def sample(self, logits: torch.Tensor, slots: list[int] | None, count: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and log μ from logits ``[len(slots), V]`` (None: every slot, in order);
        ``count`` holds each of those slots' tokens sampled so far (on the device)."""
        rows = range(len(self._generators)) if slots is None else slots
        self._advance(rows)
        index = slice(None) if slots is None else torch.tensor(slots, dtype=torch.long, device=self._device)
        uniforms = self._uniforms[index].gather(1, (count % UNIFORM_BLOCK)[:, None])[:, 0]
        return draw(logits, self.temperature[index], self.top_k[index], self.top_p[index], uniforms, self.filtered)

    def _advance(self, rows) -> None:
        """Draw a fresh block for every row about to use the first uniform of one. The host counts
        tokens per row without reading the device: a row that finished between host syncs counts
        on, harmlessly (its stream is dropped with it)."""
        fresh = [s for s in rows if self._generators[s] is not None and self._drawn[s] % UNIFORM_BLOCK == 0]
        if fresh:
            blocks = torch.stack([torch.rand(UNIFORM_BLOCK, generator=self._generators[s]) for s in fresh])
            self._uniforms[torch.tensor(fresh, device=self._device)] = blocks.to(self._device)
        for s in rows:
            self._drawn[s] += 1

    def is_stop(self, tokens: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Which of ``tokens`` (one per slot of ``slots``; None: every slot) end their row."""
        stop_ids = self.stop_ids if slots is None else self.stop_ids[slots]
        return (tokens[:, None] == stop_ids).any(dim=1)
