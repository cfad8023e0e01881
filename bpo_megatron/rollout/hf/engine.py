"""The embedded rollout engine: a transformers Qwen3 / Qwen3-MoE model sampled by our own loop.

``model.generate`` is not used so that what a sample reports is exactly what was sampled from: per
step, fp32 logits / temperature → log-softmax = log μ (before top-k/top-p), then the filtered draw
(see :mod:`hf_sampling`). All rows of all requests decode together with one KV cache: prompts are
left-padded, masked and given their own position ids, so every row computes what a single unpadded
forward computes (up to float summation order). Rows leave the batch (and the cache) as they finish.
That is the ``transformers`` decode path; the ``static`` and ``cuda_graph`` paths
(``rollout.hf.decode``, :mod:`bpo_megatron.rollout.hf.slots`) decode the same rows through fixed
per-row KV slots with a functional step, refilling slots from the queue as rows finish.
With capture on, the experts each MoE router picks for every processed token are recorded (R3), for
the requests that want them (``GenerationRequest.capture_routing``); a batch none of whose requests
wants them is decoded without capture.

The KV cache lives only inside one :meth:`HFEngine.generate` call, so no cache ever outlives a
weight update.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache

from bpo_megatron.rollout.engine import EngineCapabilities, RolloutEngine
from bpo_megatron.rollout.hf.capture import RoutingCapture, moe_routers
from bpo_megatron.rollout.hf.decode import attention_for, check_supported, resolve_path
from bpo_megatron.rollout.hf.options import check_decode
from bpo_megatron.rollout.hf.sampling import BatchSampler, row_seeds
from bpo_megatron.rollout.hf.shared_weights import SegmentLayout, SharedWeights
from bpo_megatron.rollout.hf.slots import SlotRow, SlotSession, SlotSettings, left_padded
from bpo_megatron.rollout.hf.weights import HFWeights
from bpo_megatron.rollout.types import EngineHealth, GenerationRequest, Sample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Row:
    """One of the ``n`` responses of a request: a row of a decoding batch."""

    request: GenerationRequest
    index: int
    seed: int


@dataclass
class _Batch:
    """Outputs of one decoding batch, indexed by its rows (in the order they were given)."""

    tokens: torch.Tensor  # [b, T] sampled tokens
    logprobs: torch.Tensor  # [b, T] log μ
    lengths: list[int]  # response length of each row
    stopped: list[bool]  # ended on a stop token
    routing: torch.Tensor | None  # [rows recorded, P + T − 1, moe layers, top-k], left-padded columns
    routing_rows: list[int | None]  # each row's row of ``routing``; None: not recorded
    width: int  # P, the padded prompt width
    versions: torch.Tensor  # [b, T] the weights version each token was sampled with


class HFEngine(RolloutEngine):
    """Rollout engine on a transformers causal LM, in-process (the CPU default).

    ``model_dir_or_model`` is a local checkpoint directory (loaded with ``dtype`` onto ``device``) or
    an already built model, used as is. ``threads`` sets torch's (process-wide) intra-op threads.
    ``max_batch_rows`` bounds the rows decoded together; more are split into batches of similar
    prompt length. ``decode`` and ``refill_every`` choose the decode loop (``rollout.hf.decode``,
    :class:`~bpo_megatron.rollout.hf.options.HFEngineOptions`).
    """

    def __init__(self, model_dir_or_model: str | Path | nn.Module, *, capture_routing: bool,
                 dtype: torch.dtype = torch.float32, threads: int = 1, device: str | torch.device = "cpu",
                 max_batch_rows: int = 256, decode: str = "auto", refill_every: int = 8) -> None:
        if threads < 1 or max_batch_rows < 1:
            raise ValueError(f"threads={threads} and max_batch_rows={max_batch_rows} must be >= 1")
        check_decode(decode, refill_every)
        torch.set_num_threads(threads)
        if isinstance(model_dir_or_model, nn.Module):
            model = model_dir_or_model
        else:
            model = AutoModelForCausalLM.from_pretrained(
                str(model_dir_or_model), dtype=dtype, local_files_only=True).to(device)
            model.requires_grad_(False)
        self._model: nn.Module | None = model.eval()
        self._device = next(model.parameters()).device
        self._max_batch_rows = max_batch_rows
        self._decode_path = resolve_path(decode, self._device, next(model.parameters()).dtype)
        if self._decode_path != "transformers":
            check_supported(model)
        self._refill_every = refill_every
        self._max_positions = getattr(model.config, "max_position_embeddings", None)
        self._weights = HFWeights(model)
        routers = moe_routers(model)
        self._capture = (RoutingCapture(routers, topk=model.config.num_experts_per_tok,
                                        num_experts=model.config.num_experts)
                         if capture_routing and routers else None)
        self.num_moe_layers = len(routers)
        self.capabilities = EngineCapabilities(captures_routing=self._capture is not None)
        self._paused = False
        self.weight_version = self._pending_version = 0
        # Weights change only between forward passes: a forward runs with the gate's lock free
        # and _in_forward set; a weight update (or any write to the weights) first waits for the
        # forward under way, and a paused generation waits at its next step (a partial rollout:
        # it continues with the new weights, each token recording the version that sampled it).
        self._gate = threading.Condition()
        self._in_forward = False
        self._forwards = 0  # forward passes done: the progress a stall watch reads
        self._generating = threading.Lock()  # one generation at a time
        self._shared: SharedWeights | None = None

    @property
    def model(self) -> nn.Module:
        return self._live_model()

    @property
    def decode_path(self) -> str:
        """The decode loop ``decode`` resolved to on this device: transformers, static or cuda_graph."""
        return self._decode_path

    # -- lifecycle -------------------------------------------------------------------------------

    def begin_weight_update(self, version: int) -> None:
        """Pause: a generation under way stops at its next step until :meth:`end_weight_update`
        (returns once no forward pass is running)."""
        self._live_model()
        with self._gate:
            self._paused, self._pending_version = True, int(version)
            self._gate.wait_for(lambda: not self._in_forward)

    def end_weight_update(self) -> None:
        self._live_model()
        with self._gate:
            self._paused, self.weight_version = False, self._pending_version
            self._gate.notify_all()

    def health(self) -> EngineHealth:
        if self._model is None:
            return EngineHealth(healthy=False, detail="shut down")
        return EngineHealth(healthy=True, detail="paused" if self._paused else "ready")

    def shutdown(self) -> None:
        with self._between_forwards():
            if self._capture is not None:
                self._capture.remove()
            self._model = self._weights = self._capture = None
            if self._shared is not None:
                self._shared.close()
                self._shared = None

    @contextlib.contextmanager
    def _between_forwards(self):
        """Hold the gate with no forward pass running (none starts until it is released)."""
        with self._gate:
            self._gate.wait_for(lambda: not self._in_forward)
            yield

    def _forward_may_start(self) -> int:
        """Wait while a weight update is in progress; the weights version the forward runs with."""
        with self._gate:
            self._gate.wait_for(lambda: not self._paused)
            self._in_forward = True
            return self.weight_version

    def _forward_done(self) -> None:
        with self._gate:
            self._in_forward = False
            self._forwards += 1
            self._gate.notify_all()

    def progress(self) -> int:
        """Forward passes done so far: it advances at every decoding step."""
        return self._forwards

    def _live_model(self) -> nn.Module:
        if self._model is None:
            raise RuntimeError("the hf rollout engine was shut down; create a new one")
        return self._model

    # -- weights ---------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each tensor into the weight of that on-disk name, in order; returns bytes received.

        Each tensor is checked (name, shape) before it is written; a refused one raises ValueError
        and leaves its weight untouched (tensors before it are already applied).
        """
        self._live_model()
        with self._between_forwards():
            return sum(self._weights.load(name, tensor) for name, tensor in named_tensors)

    def share_weights(self) -> SegmentLayout | None:
        """Move the weights into shared memory (once) so that another process on this node can
        write them in place, inside a weight update (:mod:`bpo_megatron.rollout.hf.shared_memory`);
        where each weight lies. None when they are not in host memory or cannot be shared."""
        self._live_model()
        with self._between_forwards():
            if self._shared is None:
                if self._device.type != "cpu":
                    return None
                try:
                    self._shared = SharedWeights(self._model)
                except OSError as exc:  # e.g. no memfd_create on this system
                    log.warning("weights not shared (%s); they arrive through Ray's object store", exc)
                    return None
                self._weights = HFWeights(self._model)  # views of the parameters' new storage
            return self._shared.layout(dict(self._weights.items()))

    def named_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The current weights under their on-disk names (views of the live model: clone to keep)."""
        self._live_model()
        yield from self._weights.items()

    # -- generation ------------------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        model = self._live_model()
        if self._paused:
            raise RuntimeError("the hf rollout engine is in a weight update; call end_weight_update() "
                               "before generate()")
        self._check_lengths(requests)
        rows = [_Row(request, index, seed) for request in requests
                for index, seed in enumerate(row_seeds(request.sampling.seed, request.sampling.n))]
        samples: list[Sample | None] = [None] * len(rows)
        # similar prompt lengths share a batch, so little of it is left padding
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].request.prompt_tokens))
        with self._generating, torch.inference_mode():
            if self._decode_path != "transformers":
                return self._decode_in_slots(model, rows, order)
            for start in range(0, len(order), self._max_batch_rows):
                chunk = order[start:start + self._max_batch_rows]
                batch = self._decode(model, [rows[i] for i in chunk])
                for position, i in enumerate(chunk):
                    samples[i] = self._sample(rows[i], batch, position)
        return samples

    def _decode_in_slots(self, model: nn.Module, rows: list[_Row], order: list[int]) -> list[Sample]:
        """All rows through one slot session, queued in ``order`` (slots refill as rows finish)."""
        settings = SlotSettings(slots=self._max_batch_rows, refill_every=self._refill_every,
                                attention=attention_for(self._decode_path),
                                cuda_graph=self._decode_path == "cuda_graph")
        queued = [SlotRow(rows[i].request.prompt_tokens, rows[i].request.sampling, rows[i].seed,
                          rows[i].request.capture_routing) for i in order]
        outputs = SlotSession(model, queued, settings, self._capture, self._gated).run()
        samples: list[Sample | None] = [None] * len(rows)
        for i, out in zip(order, outputs):
            routed = out.routing if self._capture is not None and rows[i].request.capture_routing else None
            samples[i] = _to_sample(rows[i], out.tokens, out.logprobs, out.versions, out.stopped, routed)
        return samples

    def _gated(self, forward):
        """Run one forward pass between weight updates; its result and the weights version it used."""
        version = self._forward_may_start()
        try:
            return forward(), version
        finally:
            self._forward_done()

    def _check_lengths(self, requests: list[GenerationRequest]) -> None:
        if self._max_positions is None:
            return
        for request in requests:
            total = len(request.prompt_tokens) + request.sampling.max_new_tokens
            if total > self._max_positions:
                raise ValueError(f"request {request.request_id!r}: prompt ({len(request.prompt_tokens)}) + "
                                 f"max_new_tokens ({request.sampling.max_new_tokens}) = {total} exceeds the "
                                 f"model's max_position_embeddings={self._max_positions}")

    def _decode(self, model: nn.Module, rows: list[_Row]) -> _Batch:
        device = self._device
        input_ids, mask, positions = left_padded([r.request.prompt_tokens for r in rows], device)
        width = input_ids.shape[1]
        sampler = BatchSampler([r.request.sampling for r in rows], [r.seed for r in rows], device)
        steps = max(r.request.sampling.max_new_tokens for r in rows)
        tokens = torch.zeros(len(rows), steps, dtype=torch.long, device=device)
        logprobs = torch.zeros(len(rows), steps, dtype=torch.float32, device=device)
        versions = torch.zeros(len(rows), steps, dtype=torch.int64, device=device)
        lengths, stopped = [0] * len(rows), [False] * len(rows)
        # each row's row of the capture buffer: only the requests that want their routing have one
        routing_rows = _routing_rows([r.request.capture_routing for r in rows])
        capture = self._capture if any(row is not None for row in routing_rows) else None
        if capture is not None:
            capture.open(sum(row is not None for row in routing_rows), width + steps - 1, device)
            select, targets = _recorded(routing_rows, None, device)

        cache = DynamicCache(config=model.config)
        live = torch.arange(len(rows), device=device)  # batch rows still decoding
        next_position = positions[:, -1] + 1
        step_ids, step_positions = input_ids, positions
        try:
            for step in range(steps):
                if capture is not None:  # prefill fills columns [0, width); step s feeds column width+s-1
                    capture.target(targets, 0 if step == 0 else width + step - 1, step_ids.shape[1], select)
                version = self._forward_may_start()
                try:
                    logits = model(input_ids=step_ids, attention_mask=mask, position_ids=step_positions,
                                   past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
                finally:
                    self._forward_done()
                if capture is not None:
                    capture.check_forward()
                sampled, sampled_logprobs = sampler.sample(logits, step)
                versions[live, step] = version
                tokens[live, step] = sampled
                logprobs[live, step] = sampled_logprobs
                stop = sampler.is_stop(sampled)
                done = stop | (sampler.max_new_tokens <= step + 1)
                if int(done.sum()):  # the one host sync of a step
                    done_rows = [(row, is_stop) for row, is_done, is_stop
                                 in zip(live.tolist(), done.tolist(), stop.tolist()) if is_done]
                    for row, is_stop in done_rows:
                        lengths[row], stopped[row] = step + 1, is_stop
                    if len(done_rows) == live.numel():
                        break
                    # finished rows leave the batch: their cache, mask and settings go with them
                    keep = (~done).nonzero()[:, 0]
                    cache.batch_select_indices(keep)
                    live, mask, sampled, next_position = live[keep], mask[keep], sampled[keep], next_position[keep]
                    sampler.keep(keep)
                    if capture is not None:
                        select, targets = _recorded(routing_rows, live, device)
                step_ids, step_positions = sampled[:, None], next_position[:, None]
                next_position = next_position + 1
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        finally:
            routing = capture.close() if capture is not None else None
        return _Batch(tokens, logprobs, lengths, stopped, routing, routing_rows, width, versions)

    def _sample(self, row: _Row, batch: _Batch, i: int) -> Sample:
        length = batch.lengths[i]
        routed = None
        if batch.routing is not None and batch.routing_rows[i] is not None:
            # real positions only: after the row's left padding, up to the last token fed back
            first = batch.width - len(row.request.prompt_tokens)
            routed = batch.routing[batch.routing_rows[i], first:batch.width + length - 1].to("cpu", copy=True)
        return _to_sample(row, batch.tokens[i, :length].cpu().clone(), batch.logprobs[i, :length].cpu().clone(),
                          batch.versions[i, :length].cpu().clone(), batch.stopped[i], routed)


def _to_sample(row: _Row, tokens: torch.Tensor, logprobs: torch.Tensor, versions: torch.Tensor, stopped: bool,
               routed: torch.Tensor | None) -> Sample:
    """A row's sample from its outputs, all host tensors it may keep."""
    return Sample(
        request_id=row.request.request_id,
        index=row.index,
        prompt_tokens=torch.tensor(row.request.prompt_tokens, dtype=torch.long),
        response_tokens=tokens,
        rollout_logprobs=logprobs,
        finish_reason="stop" if stopped else "length",
        routed_experts=routed,
        weight_version=int(versions.min()),  # the oldest weights that sampled a token of it
        token_versions=versions,
    )


def _routing_rows(wanted: list[bool]) -> list[int | None]:
    """The capture-buffer row of each batch row whose request wants its routing (None: it does not)."""
    rows, count = [], 0
    for want in wanted:
        rows.append(count if want else None)
        count += want
    return rows


def _recorded(routing_rows: list[int | None], live: torch.Tensor | None, device: torch.device
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """For a forward over batch rows ``live`` (None: every row, in order), which of its rows the
    capture records (None: all) and their buffer rows (None: every buffer row, in order). Called at
    the prefill and whenever rows leave the batch (a step that synchronises with the host anyway)."""
    if all(row is not None for row in routing_rows):  # every row recorded, buffer rows = batch rows
        return None, live
    forward_rows = range(len(routing_rows)) if live is None else live.tolist()
    picked = [(j, routing_rows[r]) for j, r in enumerate(forward_rows) if routing_rows[r] is not None]
    select = torch.tensor([j for j, _ in picked], dtype=torch.long, device=device)
    targets = torch.tensor([row for _, row in picked], dtype=torch.long, device=device)
    return select, targets
