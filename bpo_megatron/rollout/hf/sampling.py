"""Token sampling for a batch of rows that may each have their own settings, without per-row loops.

Semantics (fixed here, so the trainer can recompute them): the logits are cast to fp32 and divided
by the temperature; their log-softmax gives log μ of the sampled token. Top-k, then top-p on the
renormalised top-k distribution, only shape the distribution sampled from. The filtered draw walks
the distribution in descending order of probability, equal probabilities in order of token id.

Two implementations of one draw: :func:`draw` (torch, every device: the reference) and, on a GPU
with triton and 16-bit logits, :func:`fused_draw` (:mod:`fused_sampling`: the bf16 logits read in
place, no fp32 copy, no sort), chosen by :func:`fused_applies`; they draw the same token for the
same uniform up to floating-point summation order (see :mod:`fused_sampling`).

Randomness: each row owns a ``torch.Generator`` seeded from its request's seed and its index among
the request's ``n`` samples, and draws one uniform per step (in fixed blocks) that picks a token by
inverse CDF. A seed therefore gives the same tokens whatever else is batched with the request.
"""

from __future__ import annotations

import os

import torch

from bpo_megatron import platform
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
                     uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k then top-p, in descending-probability order, as one masked pass over the batch: the
    tokens, and the kept (unnormalised) probabilities in that order with the order itself."""
    sorted_logprobs, order = logprobs.sort(dim=-1, descending=True, stable=True)  # ties: the lower id first
    probs = sorted_logprobs.exp()
    rank = torch.arange(probs.shape[-1], device=probs.device)
    top_k = torch.where(top_k > 0, top_k, probs.shape[-1])
    probs = probs.masked_fill(rank >= top_k[:, None], 0.0)
    cumulative = probs.cumsum(-1)
    # keep the smallest prefix whose (renormalised) mass reaches top_p: a token stays when the
    # mass before it is still below top_p, so the most likely token always stays
    below = (cumulative - probs) < top_p[:, None] * cumulative[:, -1:]
    kept = probs.masked_fill(~below, 0.0)
    picked = _inverse_cdf(kept, uniforms)
    return order.gather(1, picked[:, None])[:, 0], kept, order


Head = tuple[torch.Tensor, torch.Tensor]  # ([b, k] token ids, [b, k] their log q), most likely first


def draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         uniforms: torch.Tensor, filtered: bool, head: int = 0) -> tuple[torch.Tensor, torch.Tensor, Head | None]:
    """Tokens ``[b]`` and their log μ ``[b]`` (fp32) from last-position logits ``[b, V]``, one
    uniform per row. ``filtered``: the batch goes through top-k/top-p (which orders the CDF by
    probability, so it picks another token for the same uniform than the unfiltered draw).
    ``head`` > 0: also the ``head`` most likely tokens of the distribution drawn from and their
    log q — after the filters, renormalised (a token the filters left out has log q = −inf) —
    what score centering is built from."""
    logprobs = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    top = None
    if filtered:
        tokens, kept, order = _sample_filtered(logprobs, top_k, top_p, uniforms)
        if head:
            top = order[:, :head], (kept[:, :head] / kept.sum(-1, keepdim=True)).log()
    else:
        tokens = _inverse_cdf(logprobs.exp(), uniforms)
        if head:
            values, ids = logprobs.topk(head, dim=-1)
            top = ids, values
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0], top


FUSED_DTYPES = (torch.bfloat16, torch.float16)  # the fused draw reads 16-bit logits (their bit patterns)
CODES = 1 << 16  # a filtered fused draw's histogram bins per row: every 16-bit pattern


def fused_applies(device: torch.device) -> bool:
    """Whether samplers on ``device`` draw with the fused kernels: a GPU with triton. A sampler then
    does so for 16-bit logits when it reports no head (score centering's top tokens come from the
    torch draw)."""
    return platform.runs_triton(device)


@torch.library.custom_op("bpo_megatron::fused_plain_draw", mutates_args=())
def _fused_plain_draw(logits: torch.Tensor, temperature: torch.Tensor,
                      uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from bpo_megatron.rollout.hf import fused_sampling

    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    logprobs = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    fused_sampling.plain_draw(logits, temperature, uniforms, tokens, logprobs)
    return tokens, logprobs


@torch.library.custom_op("bpo_megatron::fused_filtered_draw", mutates_args=("counts",))
def _fused_filtered_draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         uniforms: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from bpo_megatron.rollout.hf import fused_sampling

    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    logprobs = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    fused_sampling.filtered_draw(logits, temperature, top_k, top_p, uniforms, counts, tokens, logprobs)
    return tokens, logprobs


@_fused_plain_draw.register_fake
@_fused_filtered_draw.register_fake
def _(logits: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor]:  # shapes only (meta, compile)
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.long), logits.new_empty(rows, dtype=torch.float32)


def fused_draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               uniforms: torch.Tensor, filtered: bool, counts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`draw` without a head, by the fused kernels: 16-bit logits ``[b, V]``; ``counts``: the
    filtered draw's scratch, ``[≥ b, CODES]`` int32, all zeros (and left so)."""
    if logits.dtype not in FUSED_DTYPES:
        raise ValueError(f"the fused sampler reads 16-bit logits ({FUSED_DTYPES}), got {logits.dtype}")
    if logits.stride(-1) != 1:  # the kernels walk a row with unit stride
        logits = logits.contiguous()
    if not filtered:
        return _fused_plain_draw(logits, temperature, uniforms)
    if counts is None or counts.shape[0] < logits.shape[0] or counts.shape[1] != CODES or counts.dtype != torch.int32:
        raise ValueError(f"the fused filtered draw needs a zeroed int32 scratch [≥ {logits.shape[0]}, {CODES}]")
    return _fused_filtered_draw(logits, temperature, top_k, top_p, uniforms, counts)


class SlotSampler:
    """Sampling settings and random streams of the rows held in fixed decoding slots; a slot takes
    a new row when its row is done (:mod:`bpo_megatron.rollout.hf.slots`).

    A row's token ``t`` uses uniform ``t mod UNIFORM_BLOCK`` of the row's block ``t // UNIFORM_BLOCK``,
    the blocks drawn in order from the row's own generator (seeded from its request's seed and its
    index among the request's ``n`` samples), so a seed gives the same tokens whatever else is
    batched with the request. Blocks are drawn on the host *ahead* of use, at the host syncs
    (:meth:`draw_ahead`), into a ring of two blocks per slot on the device: :meth:`sample` then
    reads its uniforms by the device-side token count alone, with no host work, so the whole
    decode step, sampling included, can be replayed as one CUDA graph.

    Every tensor is allocated once and written in place (a captured graph reads their addresses);
    ``stop_width`` bounds the stop tokens a row may have. ``filtered`` is fixed for the sampler
    (one request with top-k/top-p sends every row through the sorted draw, which picks another
    token for the same uniform than the unfiltered draw).
    """

    def __init__(self, slots: int, filtered: bool, stop_width: int, device: torch.device, head: int = 0,
                 fused: bool = False) -> None:
        self._device = device
        self.filtered = filtered
        self.head = head  # the sampler's most likely tokens reported per step (0: none)
        # fused kernels (:func:`fused_applies`) for 16-bit logits; the filtered draw's histogram scratch
        self.fused = fused and head == 0
        self._counts = (torch.zeros(slots, CODES, dtype=torch.int32, device=device)
                        if self.fused and filtered else None)
        self.temperature = torch.ones(slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.long, device=device)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.max_new_tokens = torch.ones(slots, dtype=torch.long, device=device)
        self.stop_ids = torch.full((slots, stop_width), -1, dtype=torch.long, device=device)  # -1: never a token
        self._ring = torch.zeros(slots, 2, UNIFORM_BLOCK, device=device)
        self._slot_ids = torch.arange(slots, device=device)
        self._generators: list[torch.Generator | None] = [None] * slots
        self._blocks = [0] * slots  # blocks drawn so far for each slot's row

    def assign(self, slots: list[int], params: list[SamplingParams], seeds: list[int]) -> None:
        """Give ``slots`` to new rows (their first token is sampled next: its uniform is drawn here)."""
        width = self.stop_ids.shape[1]
        if any(len(p.stop_token_ids) > width for p in params):
            raise ValueError(f"a row has more than the sampler's {width} stop tokens")
        index = torch.tensor(slots, dtype=torch.long, device=self._device)
        self.temperature[index] = torch.tensor([p.temperature for p in params], device=self._device)
        self.top_k[index] = torch.tensor([p.top_k for p in params], device=self._device)
        self.top_p[index] = torch.tensor([p.top_p for p in params], device=self._device)
        self.max_new_tokens[index] = torch.tensor([p.max_new_tokens for p in params], device=self._device)
        stops = [list(p.stop_token_ids) + [-1] * (width - len(p.stop_token_ids)) for p in params]
        self.stop_ids[index] = torch.tensor(stops, dtype=torch.long, device=self._device)
        for slot, seed in zip(slots, seeds):
            self._generators[slot] = torch.Generator().manual_seed(seed)
            self._blocks[slot] = 0
        self.draw_ahead({slot: 0 for slot in slots}, 1)

    def release(self, slot: int) -> None:
        self._generators[slot] = None

    def draw_ahead(self, counts: dict[int, int], steps: int) -> None:
        """Make the uniforms of the next ``steps`` tokens of each slot in ``counts`` (slot -> tokens
        its row has sampled) present on the device. ``steps`` ≤ UNIFORM_BLOCK, so the blocks in use
        span at most two and the ring's older block is free when a new one is drawn."""
        assert 1 <= steps <= UNIFORM_BLOCK
        fresh: list[tuple[int, int, torch.Tensor]] = []
        for slot, count in counts.items():
            generator = self._generators[slot]
            if generator is None:
                continue
            last = (count + steps - 1) // UNIFORM_BLOCK
            while self._blocks[slot] <= last:
                block = self._blocks[slot]
                fresh.append((slot, block % 2, torch.rand(UNIFORM_BLOCK, generator=generator)))
                self._blocks[slot] = block + 1
        if fresh:
            slots = torch.tensor([f[0] for f in fresh], device=self._device)
            parity = torch.tensor([f[1] for f in fresh], device=self._device)
            self._ring[slots, parity] = torch.stack([f[2] for f in fresh]).to(self._device)

    def sample(self, logits: torch.Tensor, count: torch.Tensor, slots: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, Head | None]:
        """Tokens, log μ and the head (:func:`draw`) from logits ``[len(slots), V]`` (``slots``
        None: every slot, in order); ``count`` holds each of those slots' tokens sampled so far."""
        index = self._slot_ids if slots is None else slots
        uniforms = self._ring[index, (count // UNIFORM_BLOCK) % 2, count % UNIFORM_BLOCK]
        settings = ((self.temperature, self.top_k, self.top_p) if slots is None
                    else (self.temperature[slots], self.top_k[slots], self.top_p[slots]))
        if self.fused and logits.dtype in FUSED_DTYPES:
            return (*fused_draw(logits, *settings, uniforms, self.filtered, self._counts), None)
        return draw(logits, *settings, uniforms, self.filtered, self.head)

    def is_stop(self, tokens: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Which of ``tokens`` (one per slot of ``slots``; None: every slot) end their row."""
        stop_ids = self.stop_ids if slots is None else self.stop_ids[slots]
        return (tokens[:, None] == stop_ids).any(dim=1)
