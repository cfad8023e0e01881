"""Continuous batching over fixed slots: the embedded engine's decode loop.

A :class:`DecodeState` owns ``slots`` decoding rows: a :class:`SlotKVCache`, the
:class:`FunctionalDecoder` over it, a :class:`SlotSampler` and per-slot bookkeeping and output
buffers, all allocated once. Its :meth:`DecodeState.step` is the whole decode step — the forward,
sampling, the writes of tokens, log μ, weight versions and routing into the output buffers, stop
and length checks — as device work on those tensors with no host sync, so on CUDA it is captured
once as a CUDA graph (:mod:`graphs`) and replayed for as long as the state lives: the engine keeps
its states between generations (:class:`DecodeStates`), one per shape bucket.

A :class:`SlotSession` decodes one generation's rows through a state. Rows enter from a queue by
a prefill (transformers' own forward over the new rows, left-padded; their keys and values are
then copied into their slots unpadded, the routing hooks record the prompt tokens' experts and
the first token is sampled) and leave when done. Only every ``refill_every`` steps does the host
read which rows are done, harvest them, refill their slots and draw the next uniforms of every
row's random stream; a row that ends between two such syncs keeps stepping, and what it computes
then is never recorded (its writes are masked) — so the outputs do not depend on ``refill_every``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn
from transformers import DynamicCache

from bpo_megatron.rollout.hf.capture import RoutingCapture
from bpo_megatron.rollout.hf.decode import Attention, FunctionalDecoder, cache_layout, routing_buffer
from bpo_megatron.rollout.hf.kv_cache import SlotKVCache
from bpo_megatron.rollout.hf.sampling import SlotSampler
from bpo_megatron.rollout.types import SamplingParams

T = TypeVar("T")
# runs ``forward(version)`` under the engine's weight gate (``version``: the weights it runs with)
GatedForward = Callable[[Callable[[int], T]], T]
MIN_LENGTH = 64  # the smallest KV length bucket
MIN_STOP_WIDTH = 4  # the smallest stop-token bucket


def bucket(value: int, smallest: int, cap: int | None = None) -> int:
    """``value`` rounded up to a power of two (at least ``smallest``, at most ``cap``): shapes that
    recur across generations map to the same state, so its graph is captured once."""
    rounded = max(smallest, 1 << max(value - 1, 0).bit_length())
    return rounded if cap is None else min(rounded, cap)


@dataclass(frozen=True)
class SlotSettings:
    """How a session decodes: at most ``slots`` rows at once, the host looks every ``refill_every``
    steps, which attention kernel the step uses, whether it is replayed as a CUDA graph, whether
    its layers go through ``torch.compile`` and whether it samples with the fused kernels
    (:func:`~bpo_megatron.rollout.hf.sampling.fused_applies`)."""

    slots: int
    refill_every: int
    attention: Attention
    cuda_graph: bool
    compile_layers: bool = False
    fused_sampler: bool = False


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
    # [tokens, k] the sampler's k most likely ids at each response token and their log q (when asked)
    head_ids: torch.Tensor | None = None
    head_logprobs: torch.Tensor | None = None


@dataclass(frozen=True)
class StateShape:
    """What a decode state's tensors (and so its captured graph) are sized by."""

    slots: int
    length: int  # KV positions per slot; also the output buffers' columns
    routing: bool  # routing written by the step
    filtered: bool  # the sampler's top-k/top-p draw
    stop_width: int
    head: int = 0  # the sampler's most likely tokens recorded per step (SamplingParams.top_logprobs)

    def serves(self, wanted: StateShape) -> bool:
        """Whether a state of this shape can decode rows that need ``wanted``: as many slots, room
        for as many positions and stop tokens, the same routing output and the same draw."""
        return (self.slots == wanted.slots and self.length >= wanted.length and self.stop_width >= wanted.stop_width
                and (self.routing, self.filtered, self.head) == (wanted.routing, wanted.filtered, wanted.head))

    @staticmethod
    def of(rows: list[SlotRow], settings: SlotSettings, capture: bool) -> StateShape:
        # a row may step refill_every − 1 times past its end before the host sees it is done
        length = max(len(r.prompt) + r.sampling.max_new_tokens for r in rows) + settings.refill_every
        return StateShape(slots=bucket(len(rows), 1, settings.slots), length=bucket(length, MIN_LENGTH),
                          routing=capture,
                          filtered=any(r.sampling.top_k > 0 or r.sampling.top_p < 1.0 for r in rows),
                          stop_width=bucket(max(len(r.sampling.stop_token_ids) for r in rows), MIN_STOP_WIDTH),
                          head=max(r.sampling.top_logprobs for r in rows))


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


class DecodeState:
    """Everything one decode step reads and writes, for ``shape.slots`` slots, allocated once.

    With ``cuda_graph`` the step is captured here and replayed by :meth:`run_step`; the captured
    graph replays raw device addresses, so this object owns every tensor its kernels touch (the
    cache, the decoder's tables, the sampler's settings and random ring, the bookkeeping and
    output buffers) and the graph keeps the step — and through it this state — alive.
    """

    def __init__(self, model: nn.Module, shape: StateShape, attention: Attention, cuda_graph: bool,
                 compile_layers: bool = False, fused_sampler: bool = False) -> None:
        config = model.config
        parameter = next(model.parameters())
        device = self.device = parameter.device
        self.shape = shape
        slots, length = shape.slots, shape.length
        kv_heads, key_dim, value_dim = cache_layout(model)
        self.cache = SlotKVCache(layers=config.num_hidden_layers, slots=slots, length=length, kv_heads=kv_heads,
                                 head_dim=key_dim, value_dim=value_dim, dtype=parameter.dtype, device=device)
        self.routing_out = routing_buffer(model, slots, device) if shape.routing else None
        self.decoder = FunctionalDecoder(model, self.cache, attention=attention, routing=self.routing_out,
                                         compile_layers=compile_layers)
        self.sampler = SlotSampler(slots, shape.filtered, shape.stop_width, device, head=shape.head,
                                   fused=fused_sampler)
        self.ids = torch.arange(slots, device=device)
        # the step's inputs and bookkeeping: static tensors, written in place
        self.feed = torch.zeros(slots, dtype=torch.long, device=device)  # the token each slot feeds
        self.position = torch.zeros(slots, dtype=torch.long, device=device)  # where it sits
        self.count = torch.zeros(slots, dtype=torch.long, device=device)  # tokens sampled per slot
        self.done = torch.ones(slots, dtype=torch.bool, device=device)  # empty slots count as done
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=device)
        self.version = torch.zeros((), dtype=torch.int64, device=device)  # the weights the step runs with
        self._version_set = 0
        # outputs: column t holds a slot's t-th response token (and the routing of the token fed then)
        self.tokens = torch.zeros(slots, length, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(slots, length, dtype=torch.float32, device=device)
        self.versions = torch.zeros(slots, length, dtype=torch.int64, device=device)
        self.routing = (torch.zeros(slots, length, *self.routing_out.shape[1:], dtype=self.routing_out.dtype,
                                    device=device) if self.routing_out is not None else None)
        self.head_ids = torch.zeros(slots, length, shape.head, dtype=torch.int32, device=device) if shape.head else None
        self.head_logprobs = (torch.zeros(slots, length, shape.head, dtype=torch.float32, device=device)
                              if shape.head else None)
        if cuda_graph:
            from bpo_megatron.rollout.hf.graphs import GraphedStep

            self._replay: Callable[[], object] | None = GraphedStep(self.step)
        else:
            self._replay = None
        self.reset()  # capture's warm-up steps ran on empty slots: start clean

    def reset(self) -> None:
        """Every slot empty (a new session): from position 0, recording nothing."""
        self.done.fill_(True)
        self.stopped.zero_()
        self.count.zero_()
        self.position.zero_()
        self.feed.zero_()

    def run_step(self, version: int) -> None:
        if version != self._version_set:  # a kernel launch only when the weights changed
            self.version.fill_(version)
            self._version_set = version
        if self._replay is not None:
            self._replay()
        else:
            self.step()

    def step(self) -> None:
        """One decode step of every slot: device work only (captured as is on CUDA)."""
        logits = self.decoder(self.feed, self.position)
        tokens, logprobs, head = self.sampler.sample(logits, self.count)
        active = ~self.done
        column = self.count.clamp(max=self.shape.length - 1)
        for buffer, new in ((self.tokens, tokens), (self.logprobs, logprobs),
                            (self.versions, self.version.expand_as(self.count))):
            buffer[self.ids, column] = torch.where(active, new, buffer[self.ids, column])
        if head is not None:
            for buffer, new in ((self.head_ids, head[0].to(torch.int32)), (self.head_logprobs, head[1])):
                buffer[self.ids, column] = torch.where(active[:, None], new, buffer[self.ids, column])
        if self.routing is not None:  # the experts of the token fed: response token count − 1
            fed = (self.count - 1).clamp(min=0)
            self.routing[self.ids, fed] = torch.where(active[:, None, None], self.routing_out,
                                                      self.routing[self.ids, fed])
        stop = active & self.sampler.is_stop(tokens)
        self.stopped |= stop
        self.done |= stop | (self.count + 1 >= self.sampler.max_new_tokens)
        self.count += active.long()
        self.feed.copy_(tokens)
        self.position += 1


class DecodeStates:
    """The engine's decode states, kept between generations so that a graph is captured once per
    shape; at most ``keep`` of them (the least recently used goes first), and none after
    :meth:`clear` (memory handed back, weights replaced in new storage, shutdown). A generation
    takes the smallest kept state that serves its shape (:meth:`StateShape.serves`: a shorter or
    a one-token generation reuses a longer state rather than capturing another)."""

    def __init__(self, keep: int = 2) -> None:
        self._keep = keep
        self._states: OrderedDict[tuple, DecodeState] = OrderedDict()

    def get(self, model: nn.Module, shape: StateShape, settings: SlotSettings) -> DecodeState:
        how = (settings.attention, settings.cuda_graph, settings.compile_layers, settings.fused_sampler)
        serving = [key for key, state in self._states.items() if key[1:] == how and state.shape.serves(shape)]
        if serving:
            key = min(serving, key=lambda k: self._states[k].shape.length)
            state = self._states.pop(key)
        else:
            while len(self._states) >= self._keep:
                self._states.popitem(last=False)
            key, state = (shape, *how), DecodeState(model, shape, settings.attention, settings.cuda_graph,
                                                    settings.compile_layers, settings.fused_sampler)
        self._states[key] = state
        return state

    def clear(self) -> None:
        self._states.clear()

    def kept(self) -> list[DecodeState]:
        """The states kept, least recently used first."""
        return list(self._states.values())

    def __len__(self) -> int:
        return len(self._states)


class SlotSession:
    """Decodes a list of rows through a :class:`DecodeState`; :meth:`run` returns their outputs."""

    def __init__(self, model: nn.Module, rows: list[SlotRow], settings: SlotSettings, state: DecodeState,
                 capture: RoutingCapture | None, gated: GatedForward) -> None:
        self._model, self._rows, self._gated, self._state = model, rows, gated, state
        self._capture = capture if state.shape.routing else None
        self._refill_every = settings.refill_every
        state.reset()
        self._holder: list[int | None] = [None] * state.shape.slots  # the row each slot decodes
        self._counts: dict[int, int] = {}  # host copy of each held slot's token count (exact at syncs)
        self._prompt_routing: dict[int, torch.Tensor] = {}

    def run(self, finished: Callable[[list[tuple[int, RowOutput]]], None] | None = None) -> list[RowOutput]:
        """Every row's output, in row order; ``finished`` is told the rows that end at each host
        sync (index, output) as they end."""
        queue = deque(range(len(self._rows)))
        outputs: list[RowOutput | None] = [None] * len(self._rows)
        free = list(range(self._state.shape.slots))
        while True:
            taken = [(queue.popleft(), slot) for slot in free[:len(queue)]]
            if taken:
                self._prefill(taken)
            if all(holder is None for holder in self._holder):
                return outputs
            self._state.sampler.draw_ahead(self._counts, self._refill_every)
            for _ in range(self._refill_every):
                self._gated(self._state.run_step)
            held = [row for row in self._holder if row is not None]
            free = self._harvest(outputs)
            ended = [(row, outputs[row]) for row in held if outputs[row] is not None]
            if finished is not None and ended:
                finished(ended)

    def _prefill(self, taken: list[tuple[int, int]]) -> None:
        """Start rows ``(row, slot)``: one forward over their prompts, their keys and values into
        their slots, their first tokens sampled."""
        state, model = self._state, self._model
        device = state.device
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
            logits, version = self._gated(lambda version: (model(
                input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                use_cache=True, logits_to_keep=1).logits[:, -1], version))
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
        for layer in range(len(state.cache.keys)):
            state.cache.load_prefill(layer, cache.layers[layer].keys, cache.layers[layer].values,
                                     batch_rows, columns, slot_of, position_of)

        index = torch.tensor(slots, dtype=torch.long, device=device)
        sampler = state.sampler
        sampler.assign(slots, [r.sampling for r in rows], [r.seed for r in rows])
        tokens, logprobs, head = sampler.sample(logits, torch.zeros_like(index), index)
        state.tokens[index, 0], state.logprobs[index, 0], state.versions[index, 0] = tokens, logprobs, version
        if head is not None:
            state.head_ids[index, 0], state.head_logprobs[index, 0] = head[0].to(torch.int32), head[1]
        stop = sampler.is_stop(tokens, index)
        state.stopped[index] = stop
        state.done[index] = stop | (sampler.max_new_tokens[index] <= 1)
        state.count[index] = 1
        state.feed[index] = tokens
        state.position[index] = torch.tensor(lengths, device=device)
        for row, slot in taken:
            self._holder[slot] = row
            self._counts[slot] = 1

    def _harvest(self, outputs: list[RowOutput | None]) -> list[int]:
        """The host sync: move the rows that are done out of their slots; returns the free slots."""
        state = self._state
        done, stopped, count = (t.tolist() for t in (state.done, state.stopped, state.count))
        free = []
        for slot, row in enumerate(self._holder):
            if row is not None and done[slot]:
                length = count[slot]
                routing = None
                if row in self._prompt_routing:
                    routing = torch.cat([self._prompt_routing.pop(row), state.routing[slot, :length - 1]]).cpu()
                # copies: the slot's buffers are reused by the next row
                head = self._rows[row].sampling.top_logprobs  # the row's own k: the most likely come first
                outputs[row] = RowOutput(*(buffer[slot, :length].to("cpu", copy=True)
                                           for buffer in (state.tokens, state.logprobs, state.versions)),
                                         stopped[slot], routing,
                                         *((buffer[slot, :length, :head].to("cpu", copy=True)
                                            for buffer in (state.head_ids, state.head_logprobs)) if head else ()))
                self._holder[slot] = None
                self._counts.pop(slot)
                state.sampler.release(slot)
            elif row is not None:
                self._counts[slot] = count[slot]
            if self._holder[slot] is None:
                free.append(slot)
        if free:  # empty slots keep stepping (the batch is static): from position 0, recording nothing
            index = torch.tensor(free, device=state.device)
            state.position[index] = 0
            state.feed[index] = 0
        return free
