"""The embedded rollout engine: a transformers model of a supported family (Qwen3, Qwen3-MoE,
GLM-4.5 MoE) sampled by our own loop.

``model.generate`` is not used so that what a sample reports is exactly what was sampled from: per
step, fp32 logits / temperature → log-softmax = log μ (before top-k/top-p), then the filtered draw
(see :mod:`sampling`). There is one decode loop (:mod:`slots`): rows decode in fixed per-row KV
slots with a functional step, finished rows replaced from the queue at host syncs every
``refill_every`` steps; ``rollout.hf.decode`` chooses whether the step runs op by op (``eager``,
any device) or is replayed as one CUDA graph (``cuda_graph``, a GPU in bf16). Every row computes
what a single unpadded forward computes (up to float summation order). With capture on, the
experts each MoE router picks for every processed token are recorded (R3), for the requests that
want them (``GenerationRequest.capture_routing``); a generation none of whose requests wants them
is decoded without capture.

The decode states (KV slots, buffers, captured graphs) are kept between generations, one per
shape bucket; a KV entry is always written by the step that feeds its position before any step
reads it, so nothing computed with old weights is read after a weight update. They are dropped
when the engine hands its memory back (:meth:`HFEngine.release_memory`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from bpo_megatron import platform
from bpo_megatron.rollout.engine import EngineCapabilities, Finished, RolloutEngine, as_finished
from bpo_megatron.rollout.hf.capture import RoutingCapture, moe_routers, num_routed_experts
from bpo_megatron.rollout.hf import fp8_compute, fused_qkv
from bpo_megatron.rollout.hf.decode import attention_for, check_supported, resolve_path
from bpo_megatron.rollout.hf.options import check_decode
from bpo_megatron.rollout.hf.sampling import fused_applies, row_seeds
from bpo_megatron.rollout.hf.shared_weights import SegmentLayout, SharedWeights
from bpo_megatron.rollout.hf.slots import (DecodeState, DecodeStates, RowOutput, SlotRow, SlotSession, SlotSettings,
                                            StateShape)
from bpo_megatron.rollout.hf.weights import HFWeights
from bpo_megatron.rollout.types import EngineHealth, GenerationRequest, Sample
from bpo_megatron.weight_sync.delta import Sparse, updates
from bpo_megatron.weights import fp8

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Row:
    """One of the ``n`` responses of a request: a row of a decoding batch."""

    request: GenerationRequest
    index: int
    seed: int


class HFEngine(RolloutEngine):
    """Rollout engine on a transformers causal LM, in-process (the CPU default).

    ``model_dir_or_model`` is a local checkpoint directory (loaded with ``dtype`` onto ``device``) or
    an already built model, used as is. ``threads`` sets torch's (process-wide) intra-op threads.
    ``max_batch_rows`` bounds the rows decoded together (the slots; more rows wait in a queue,
    shortest prompts first). ``decode`` and ``refill_every`` choose how the decode step runs and how
    often the host looks, ``compile_layers`` whether its layers go through ``torch.compile``
    (``rollout.hf``, :class:`~bpo_megatron.rollout.hf.options.HFEngineOptions`).
    """

    def __init__(self, model_dir_or_model: str | Path | nn.Module, *, capture_routing: bool,
                 dtype: torch.dtype = torch.float32, threads: int = 1, device: str | torch.device = "cpu",
                 max_batch_rows: int = 256, decode: str = "auto", refill_every: int = 8,
                 compile_layers: bool = False, quantization: str = "none") -> None:
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
        self._dtype = next(model.parameters()).dtype
        self._decode_path = resolve_path(decode, self._device, self._dtype)
        check_supported(model)
        self._states = DecodeStates()
        self._refill_every = refill_every
        self._compile_layers = compile_layers
        self._max_positions = getattr(model.config, "max_position_embeddings", None)
        self._weights = HFWeights(model)
        if quantization not in ("none", "fp8"):
            raise ValueError(f"quantization={quantization!r}: choose none or fp8")
        self._fp8 = quantization == "fp8"
        # an FP8 engine holds its linear weights rounded through block e4m3 and computes those layers
        # in block FP8 (rollout/hf/fp8_compute.py), from the first generation on
        self._fp8_layers: list[fp8_compute.Fp8Linear] = []
        if self._fp8:
            with torch.no_grad():
                for name, view in self._weights.items():
                    if fp8.quantized(name):
                        view.copy_(fp8.round_through_fp8(view))
            self._fp8_layers = fp8_compute.install(model)
        # the decode step's stacked query/key/value projections, copies refreshed after every update
        self._fused_qkv = fused_qkv.install(model)
        routers = moe_routers(model)
        self._capture = (RoutingCapture(routers, topk=model.config.num_experts_per_tok,
                                        num_experts=num_routed_experts(routers))
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
        """How the decode step runs on this device: ``eager`` or ``cuda_graph``."""
        return self._decode_path

    def decode_states(self) -> list[DecodeState]:
        """The decode states kept between generations (least recently used first), to inspect or
        profile a step (``DecodeState.run_step``) between generations."""
        return self._states.kept()

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
            for layer in self._fp8_layers:  # what update_weights or shared memory wrote, once
                layer.refresh()
            self._refresh_fused_qkv()
            self._paused, self.weight_version = False, self._pending_version
            self._gate.notify_all()

    def release_memory(self) -> None:
        """Drop the decode states (KV slots, buffers, captured graphs); the weights stay. The next
        generation allocates (and captures) again."""
        with self._generating:
            self._states.clear()
            gc.collect()  # a state and its graph refer to each other: freed by the collector, not at once
            platform.release_cached_memory()

    def health(self) -> EngineHealth:
        if self._model is None:
            return EngineHealth(healthy=False, detail="shut down")
        return EngineHealth(healthy=True, detail="paused" if self._paused else "ready")

    def shutdown(self) -> None:
        with self._between_forwards():
            if self._capture is not None:
                self._capture.remove()
            self._model = self._weights = self._capture = None
            self._states.clear()
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
        A delta's sparse pieces (:mod:`bpo_megatron.weight_sync.delta`) are written in place.

        Each tensor is checked (name, shape) before it is written; a refused one raises ValueError
        and leaves its weight untouched (tensors before it are already applied).
        """
        self._live_model()
        with self._between_forwards():
            # an FP8 engine's linear weights arrive rounded (the trainer rounds them at sync, as it
            # does for weights written in place); rounding again changes nothing but catches a sender
            # that did not (same dtype and shape: the bytes are those received)
            # (their e4m3 copies follow at end_weight_update, which closes every update)
            # (a delta's sparse pieces are the rounded bytes already: a block cannot be rounded in part)
            round_ = fp8.round_named if self._fp8 else (lambda name, tensor: tensor)
            received = sum(self._weights.load(name, tensor if isinstance(tensor, Sparse) else round_(name, tensor))
                           for name, tensor in updates(named_tensors))
            self._refresh_fused_qkv()  # a call outside begin/end_weight_update decodes with its weights too
            return received

    def _refresh_fused_qkv(self) -> None:
        with torch.no_grad():
            for holder in self._fused_qkv:
                holder.refresh()

    def weight_details(self) -> SegmentLayout | None:
        """What ``shared_memory`` writes into: where the shared weights lie (None: not shared)."""
        return self.share_weights()

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
                self._states.clear()  # nothing captured may read the parameters' old storage
            return self._shared.layout(dict(self._weights.items()))

    def named_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The current weights under their on-disk names (views of the live model: clone to keep)."""
        self._live_model()
        yield from self._weights.items()

    # -- generation ------------------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        return self._generate(requests, None)

    def generate_as_finished(self, requests: list[GenerationRequest]) -> Iterator[Finished]:
        """Samples as their rows leave the decoding slots (at each host sync)."""
        return as_finished(lambda report: self._generate(requests, report))

    def _generate(self, requests: list[GenerationRequest], report: Callable[[Finished], None] | None) -> list[Sample]:
        model = self._live_model()
        if self._paused:
            raise RuntimeError("the hf rollout engine is in a weight update; call end_weight_update() "
                               "before generate()")
        self._check_requests(requests)
        rows = [_Row(request, index, seed) for request in requests
                for index, seed in enumerate(row_seeds(request.sampling.seed, request.sampling.n))]
        if not rows:
            return []
        # similar prompt lengths enter the slots together, so a prefill pads little
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].request.prompt_tokens))
        with self._generating, torch.inference_mode():
            settings = SlotSettings(slots=self._max_batch_rows, refill_every=self._refill_every,
                                    attention=attention_for(self._device, self._dtype),
                                    cuda_graph=self._decode_path == "cuda_graph",
                                    compile_layers=self._compile_layers,
                                    fused_sampler=fused_applies(self._device))
            queued = [SlotRow(rows[i].request.prompt_tokens, rows[i].request.sampling, rows[i].seed,
                              rows[i].request.capture_routing) for i in order]
            shape = StateShape.of(queued, settings, capture=self._capture is not None
                                  and any(r.capture_routing for r in queued))
            state = self._states.get(model, shape, settings)
            samples: list[Sample | None] = [None] * len(rows)

            @torch.inference_mode(False)  # a sample's own tensors are ordinary ones, as they always were
            def finished(ended: list) -> None:  # session rows (sorted order) -> the request order's samples
                done = []
                for queued_row, out in ended:
                    i = order[queued_row]
                    routed = out.routing if self._capture is not None and rows[i].request.capture_routing else None
                    samples[i] = _to_sample(rows[i], out, routed)
                    done.append((i, samples[i]))
                if report is not None:
                    report(done)

            SlotSession(model, queued, settings, state, self._capture, self._gated).run(finished)
        return samples

    def _gated(self, forward):
        """Run ``forward(version)``, one forward pass, between weight updates (``version``: the
        weights it runs with)."""
        version = self._forward_may_start()
        try:
            return forward(version)
        finally:
            self._forward_done()

    def _check_requests(self, requests: list[GenerationRequest]) -> None:
        vocab = self._live_model().config.vocab_size
        for request in requests:
            if request.sampling.top_logprobs > vocab:
                raise ValueError(f"request {request.request_id!r}: top_logprobs={request.sampling.top_logprobs} "
                                 f"exceeds the model's vocabulary of {vocab} tokens (loss.score_centering_top_k)")
        if self._max_positions is None:
            return
        for request in requests:
            total = len(request.prompt_tokens) + request.sampling.max_new_tokens
            if total > self._max_positions:
                raise ValueError(f"request {request.request_id!r}: prompt ({len(request.prompt_tokens)}) + "
                                 f"max_new_tokens ({request.sampling.max_new_tokens}) = {total} exceeds the "
                                 f"model's max_position_embeddings={self._max_positions}")


def _to_sample(row: _Row, out: RowOutput, routed: torch.Tensor | None) -> Sample:
    """A row's sample from its outputs, all host tensors it may keep."""
    return Sample(
        request_id=row.request.request_id,
        index=row.index,
        prompt_tokens=torch.tensor(row.request.prompt_tokens, dtype=torch.long),
        response_tokens=out.tokens,
        rollout_logprobs=out.logprobs,
        finish_reason="stop" if out.stopped else "length",
        routed_experts=routed,
        weight_version=int(out.versions.min()),  # the oldest weights that sampled a token of it
        token_versions=out.versions,
        cached_tokens=0,  # no prefix cache: every request computes its whole prompt
        sampler_head_ids=out.head_ids,
        sampler_head_logprobs=out.head_logprobs,
    )
