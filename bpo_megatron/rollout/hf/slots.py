"""Continuous batching over fixed slots: the embedded engine's decode loop for the static path.

A session owns ``slots`` decoding rows, a :class:`SlotKVCache` and per-slot output buffers. Rows
enter from a queue by a prefill (transformers' own forward over the new rows, left-padded; their
keys and values are then copied into their slots unpadded, and the routing hooks record the prompt
tokens' experts) and leave when done. Every decode step is the :class:`FunctionalDecoder` over all
slots (one CUDA graph replay on the graph path); sampling, bookkeeping and the writes of tokens,
log μ, weight versions and routing into the output buffers stay on the device. Only every
``refill_every`` steps does the host read which rows are done, harvest them and refill their
slots; a row that ends between two such syncs keeps stepping, and what it computes then is never
recorded (its writes are masked) — so the outputs do not depend on ``refill_every``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn
from transformers import DynamicCache

from bpo_megatron.rollout.hf.capture import RoutingCapture
from bpo_megatron.rollout.hf.decode import Attention, FunctionalDecoder, routing_buffer
from bpo_megatron.rollout.hf.kv_cache import SlotKVCache
from bpo_megatron.rollout.hf.sampling import SlotSampler
from bpo_megatron.rollout.types import SamplingParams

T = TypeVar("T")
# runs one forward pass under the engine's weight gate; returns its result and the weights version
GatedForward = Callable[[Callable[[], T]], tuple[T, int]]


@dataclass(frozen=True)
class SlotSettings:
    """How a session decodes: ``slots`` rows at once, the host looks every ``refill_every`` steps,
    which attention kernel the step uses and whether it is replayed as a CUDA graph."""

    slots: int
    refill_every: int
    attention: Attention
    cuda_graph: bool


@dataclass(frozen=True)
class SlotRow:
    """What a session needs of one row (one of the ``n`` responses of a request)."""

    prompt: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    capture_routing: bool


@dataclass
class RowOutput:
    """A finished row, on the host: ``routing`` covers the prompt and every response token but the last."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    stopped: bool
    routing: torch.Tensor | None


def left_padded(prompts: list[tuple[int, ...]], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, attention mask and position ids ``[b, P]`` of prompts right-aligned in P columns.

    Positions count real tokens only (a row's first prompt token is position 0), as in an unpadded
    forward; transformers would otherwise number the padding too.
    """
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
    lengths = torch.tensor([len(p) for p in prompts])
    mask = (torch.arange(width) >= width - lengths[:, None]).long()
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    return input_ids.to(device), mask.to(device), positions.to(device)


class SlotSession:
    """Decodes a list of rows through ``settings.slots`` slots; :meth:`run` returns their outputs."""

    def __init__(self, model: nn.Module, rows: list[SlotRow], settings: SlotSettings,
                 capture: RoutingCapture | None, gated: GatedForward) -> None:
        self._model, self._rows, self._gated = model, rows, gated
        self._capture = capture if any(r.capture_routing for r in rows) else None
        self._refill_every = settings.refill_every
        config = model.config
        parameter = next(model.parameters())
        device = self._device = parameter.device
        slots = self._slots = min(settings.slots, len(rows))
        steps = self._steps = max(r.sampling.max_new_tokens for r in rows)
        # a row may step refill_every − 1 times past its end before the host sees it is done
        length = max(len(r.prompt) + r.sampling.max_new_tokens for r in rows) + settings.refill_every
        self._cache = SlotKVCache(layers=config.num_hidden_layers, slots=slots, length=length,
                                  kv_heads=config.num_key_value_heads, head_dim=model.model.layers[0].self_attn.head_dim,
                                  dtype=parameter.dtype, device=device)
        routing = routing_buffer(model, slots, device) if self._capture is not None else None
        decoder = FunctionalDecoder(model, self._cache, attention=settings.attention, routing=routing)
        # the step's inputs: static tensors, updated in place (a captured graph reads these addresses)
        self._feed = torch.zeros(slots, dtype=torch.long, device=device)
        self._position = torch.zeros(slots, dtype=torch.long, device=device)

        def step() -> tuple[torch.Tensor, ...]:
            logits = decoder(self._feed, self._position)
            return (logits,) if routing is None else (logits, routing)

        if settings.cuda_graph:
            from bpo_megatron.rollout.hf.graphs import GraphedStep

            self._step = GraphedStep(step)
        else:
            self._step = step
        self._sampler = SlotSampler(slots, any(r.sampling.top_k > 0 or r.sampling.top_p < 1.0 for r in rows), device)
        self._ids = torch.arange(slots, device=device)
        self._tokens = torch.zeros(slots, steps, dtype=torch.long, device=device)
        self._logprobs = torch.zeros(slots, steps, dtype=torch.float32, device=device)
        self._versions = torch.zeros(slots, steps, dtype=torch.int64, device=device)
        self._routing = (torch.zeros(slots, steps, *routing.shape[1:], dtype=routing.dtype, device=device)
                         if routing is not None else None)
        self._count = torch.zeros(slots, dtype=torch.long, device=device)  # tokens sampled per slot
        self._done = torch.ones(slots, dtype=torch.bool, device=device)  # empty slots count as done
        self._stopped = torch.zeros(slots, dtype=torch.bool, device=device)
        self._holder: list[int | None] = [None] * slots  # the row each slot decodes
        self._prompt_routing: dict[int, torch.Tensor] = {}

    def run(self) -> list[RowOutput]:
        queue = deque(range(len(self._rows)))
        outputs: list[RowOutput | None] = [None] * len(self._rows)
        free = list(range(self._slots))
        while True:
            taken = [(queue.popleft(), slot) for slot in free[:len(queue)]]
            if taken:
                self._prefill(taken)
            if all(holder is None for holder in self._holder):
                return outputs
            for _ in range(self._refill_every):
                self._decode_step()
            free = self._harvest(outputs)

    def _prefill(self, taken: list[tuple[int, int]]) -> None:
        """Start rows ``(row, slot)``: one forward over their prompts, their keys and values into
        their slots, their first tokens sampled."""
        device, model = self._device, self._model
        rows = [self._rows[r] for r, _ in taken]
        input_ids, mask, positions = left_padded([r.prompt for r in rows], device)
        width = input_ids.shape[1]
        wanted = [i for i, r in enumerate(rows) if r.capture_routing]
        capture = self._capture if wanted else None
        if capture is not None:
            capture.open(len(wanted), width, device)
            select = None if len(wanted) == len(rows) else torch.tensor(wanted, device=device)
            capture.target(None, 0, width, select)
        cache = DynamicCache(config=model.config)
        try:
            logits, version = self._gated(lambda: model(
                input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                use_cache=True, logits_to_keep=1).logits[:, -1])
            if capture is not None:
                capture.check_forward()
        finally:
            recorded = capture.close() if capture is not None else None
        for buffer_row, i in enumerate(wanted if recorded is not None else []):
            self._prompt_routing[taken[i][0]] = recorded[buffer_row, width - len(rows[i].prompt):]

        lengths = [len(r.prompt) for r in rows]
        slots = [slot for _, slot in taken]
        batch_rows = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)], device=device)
        columns = torch.tensor([width - n + p for n in lengths for p in range(n)], device=device)
        slot_of = torch.tensor([slots[i] for i, n in enumerate(lengths) for _ in range(n)], device=device)
        position_of = torch.tensor([p for n in lengths for p in range(n)], device=device)
        for layer in range(len(self._cache.keys)):
            self._cache.load_prefill(layer, cache.layers[layer].keys, cache.layers[layer].values,
                                     batch_rows, columns, slot_of, position_of)

        index = torch.tensor(slots, dtype=torch.long, device=device)
        self._sampler.assign(slots, [r.sampling for r in rows], [r.seed for r in rows])
        tokens, logprobs = self._sampler.sample(logits, slots, torch.zeros_like(index))
        self._tokens[index, 0], self._logprobs[index, 0], self._versions[index, 0] = tokens, logprobs, version
        stop = self._sampler.is_stop(tokens, index)
        self._stopped[index] = stop
        self._done[index] = stop | (self._sampler.max_new_tokens[index] <= 1)
        self._count[index] = 1
        self._feed[index] = tokens
        self._position[index] = torch.tensor(lengths, device=device)
        for (row, slot) in taken:
            self._holder[slot] = row

    def _decode_step(self) -> None:
        outputs, version = self._gated(self._step)
        tokens, logprobs = self._sampler.sample(outputs[0], None, self._count)
        active = ~self._done
        column = self._count.clamp(max=self._steps - 1)
        keep = lambda buffer, new: torch.where(active, new, buffer[self._ids, column])  # noqa: E731
        self._tokens[self._ids, column] = keep(self._tokens, tokens)
        self._logprobs[self._ids, column] = keep(self._logprobs, logprobs)
        self._versions[self._ids, column] = keep(self._versions, torch.full_like(self._count, version))
        if self._routing is not None:  # the experts of the token fed: response token count − 1
            fed = (self._count - 1).clamp(min=0)
            self._routing[self._ids, fed] = torch.where(active[:, None, None], outputs[1],
                                                        self._routing[self._ids, fed])
        stop = active & self._sampler.is_stop(tokens)
        self._stopped |= stop
        self._done |= stop | (self._count + 1 >= self._sampler.max_new_tokens)
        self._count += active.long()
        self._feed.copy_(tokens)
        self._position += 1

    def _harvest(self, outputs: list[RowOutput | None]) -> list[int]:
        """The host sync: move the rows that are done out of their slots; returns the free slots."""
        done, stopped, count = (t.tolist() for t in (self._done, self._stopped, self._count))
        free = []
        for slot, row in enumerate(self._holder):
            if row is not None and done[slot]:
                length = count[slot]
                routing = None
                if row in self._prompt_routing:
                    routing = torch.cat([self._prompt_routing.pop(row), self._routing[slot, :length - 1]]).cpu()
                # copies: the slot's buffers are reused by the next row
                outputs[row] = RowOutput(*(buffer[slot, :length].to("cpu", copy=True)
                                           for buffer in (self._tokens, self._logprobs, self._versions)),
                                         stopped[slot], routing)
                self._holder[slot] = None
                self._sampler.release(slot)
            if self._holder[slot] is None:
                free.append(slot)
        if free:  # empty slots keep stepping (the batch is static): from position 0, recording nothing
            index = torch.tensor(free, device=self._device)
            self._position[index] = 0
            self._feed[index] = 0
        return free
