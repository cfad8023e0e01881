"""The rollout-engine interface, the spec each engine describes itself with, and their registry.

The RL loop only talks to :class:`RolloutEngine`. Each engine (embedded transformers on CPU,
SGLang or vLLM on GPUs) is one folder under ``bpo_megatron/rollout/`` whose ``spec.SPEC`` says,
once, everything the rest of the system needs: its typed options (the ``rollout.<name>``
section), how it is built from them, its memory profile for the planner, its config checks, the
weight transports it accepts. :data:`ENGINES` names the specs; :func:`engine_spec` imports one
only when it is used, so nothing imports an engine's heavy dependencies it does not run.
"""

from __future__ import annotations

import abc
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from bpo_megatron.models.routing import RoutingLayout
from bpo_megatron.registry import LazyRegistry
from bpo_megatron.rollout.types import EngineHealth, GenerationRequest, Sample
from bpo_megatron.weights.buckets import DEFAULT_BUCKET_BYTES


@dataclass(frozen=True)
class EngineCapabilities:
    captures_routing: bool  # can return routed experts per processed token (R3)


# samples that finished together, each with its position in the order generate() returns them
Finished = list[tuple[int, Sample]]


def as_finished(generate: Callable[[Callable[[Finished], None]], list[Sample]]) -> Iterator[Finished]:
    """Run ``generate(report)`` in a thread of its own and yield what it reports, as it reports
    it (from any thread), then the samples it returned that it did not report; its exception is
    raised here once what it reported before is yielded."""
    reports: queue.SimpleQueue = queue.SimpleQueue()
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(generate(reports.put))
        except BaseException as exc:  # noqa: BLE001 - raised again in the consumer's thread below
            outcome.append(exc)
        reports.put(None)

    threading.Thread(target=run, name="generate-as-finished", daemon=True).start()
    seen: set[int] = set()
    ended = False
    while not ended and (batch := reports.get()) is not None:
        while True:  # what else has finished meanwhile goes in the same batch
            try:
                more = reports.get_nowait()
            except queue.Empty:
                break
            if more is None:
                ended = True
                break
            batch = batch + more
        seen.update(position for position, _ in batch)
        yield batch
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    rest = [(position, sample) for position, sample in enumerate(outcome[0]) if position not in seen]
    if rest:
        yield rest


class EngineLost(RuntimeError):
    """The engine lost what it held (its server died): replace it, give it the current weights,
    then send its requests again. Never answered by sampling from the initial weights."""


class EngineUnresponsive(RuntimeError):
    """The engine's backend (its server) did not answer a liveness probe in time."""


class RolloutEngine(abc.ABC):
    """Generates samples from the current policy and takes new weights from the trainer.

    Weights arrive in an update session: :meth:`begin_weight_update` with the version they are
    (the trainer's update count), :meth:`update_weights` per bucket, :meth:`end_weight_update`,
    which drops caches of the old weights and admits work again. Every sample records
    :attr:`weight_version`, the version that produced it (0: the weights it started from).
    """

    capabilities: EngineCapabilities
    weight_version: int = 0

    @abc.abstractmethod
    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        """All ``n`` samples of every request, in request order then index order."""

    def generate_as_finished(self, requests: list[GenerationRequest]) -> Iterator[Finished]:
        """What :meth:`generate` returns, in batches as the samples finish, each sample with its
        position in :meth:`generate`'s order (a conversation's next turn need not wait for the
        longest answer). Here all at the end: an engine that finishes samples one by one yields
        them so (:func:`as_finished`)."""
        yield list(enumerate(self.generate(requests)))

    @abc.abstractmethod
    def begin_weight_update(self, version: int) -> None:
        """Stop admitting work and open an update that brings the weights of ``version``."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load Hugging Face-named tensors (the on-disk names) inside an update; returns the bytes
        received."""

    @abc.abstractmethod
    def end_weight_update(self) -> None:
        """Close the update: caches of the old weights are gone, work is admitted again."""

    def weight_details(self) -> Any:
        """What this engine's own weight transports need to reach it (a server's address and TP
        size, where its weights lie in shared memory); None when they need nothing. Carried to the
        trainer's ranks inside an endpoint without being read on the way."""
        return None

    def release_memory(self) -> None:
        """Hand the device memory it holds (weights, caches) back to a trainer sharing its
        devices; nothing to do for an engine that holds none between calls."""

    def resume_memory(self, tags: tuple[str, ...] = ()) -> None:
        """Take back what :meth:`release_memory` handed back (``tags``: which parts; () all)."""

    @abc.abstractmethod
    def health(self) -> EngineHealth: ...

    def progress(self) -> int | None:
        """A count of work done that advances while the engine generates (decoding steps, say),
        read while a generation is under way to tell a slow engine from a stuck one; None: the
        engine counts nothing, and answering at all is its sign of life. Raises
        :class:`EngineUnresponsive` when the engine's own backend (a server) does not answer."""
        return None

    @abc.abstractmethod
    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class EngineContext:
    """What an engine is built with besides its own options."""

    model_dir: str  # the Hugging Face checkpoint it starts from
    index: int  # which of the run's engines (ports, seeds)
    routing: RoutingLayout | None  # capture routed experts laid out so (R3); None: no capture
    threads: int = 1  # torch threads of an in-process engine
    colocated: bool = False  # shares the trainer's devices: must be able to hand its memory back
    devices: tuple[int, ...] = ()  # GPU ids (on its node) a server process uses; () : as placed
    node_address: str = "127.0.0.1"  # its node's address as other nodes reach it (a server binds it)
    # the longest sequence a request can reach (max prompt + max response tokens); 0: unknown
    longest_sequence: int = 0
    # the most one weight-update call takes (weight_sync.bucket_mb: the trainer's buckets' size too)
    weight_bucket_bytes: int = DEFAULT_BUCKET_BYTES


@dataclass(frozen=True)
class EngineProfile:
    """What one engine occupies, for the planner."""

    tp: int  # GPUs one engine spans
    sequences: int  # sequences resident at once
    # share of a GPU the engine reserves for weights and KV cache (SGLang's mem_fraction_static);
    # None: the whole GPU less the reserved allowance
    pool_fraction: float | None = None
    # the engine admits requests while its KV pool (pool_fraction, less the weights) holds them
    # and queues the rest itself (SGLang): the pool, not the sequences in flight, bounds its memory
    admits_by_pool: bool = False
    # what release_memory hands back to a trainer sharing its devices: its weights' memory and its
    # KV cache with the runtime around it (SGLang); the rest stays on the device meanwhile
    released: tuple[str, ...] = ("weights", "kv_cache")
    # requests the config asks the engine to keep in flight (SGLang's rollout.sglang.max_inflight);
    # None: the planner's cap for an engine that admits by its pool
    requested_inflight: int | None = None


@dataclass(frozen=True)
class QuantizedLayout:
    """What an engine builds of a model's quantized layers at its configured layout (its own
    ``rollout.<engine>`` section's parallelism): one line per layer shape with its partitions and
    what is done with it; the layers it cannot serve at all (each line naming the rule and the
    settings that work: the config is refused); the checkpoint's modules it serves in its dtype
    instead (``model.layers.<i>.<projection>``: left unquantized in what it starts from and what it
    is sent)."""

    layout: str  # the settings it was checked at
    lines: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()
    unquantized: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.refused

    def describe(self) -> str:
        head = f"quantized layers at {self.layout}"
        if self.unquantized:
            head += f" ({len(self.unquantized)} modules served in bf16)"
        return "\n".join([head + ":", *(f"  {line}" for line in self.lines),
                          *(f"  refused: {line}" for line in self.refused)])


def _no_layout(_options: Any, _hf: Any) -> QuantizedLayout | None:
    return None


def _no_check(_options: Any) -> None:
    return None


def _engine_dtype(_options: Any) -> str | None:
    return None


def _no_quantization(_options: Any) -> str | None:
    return None


def _whole_tensors(_options: Any, _transport: str) -> str:
    return "tensors"


def _no_notes(_options: Any) -> list[str]:
    return []


TopLogprobs = Literal["none", "drawn", "unfiltered"]


@dataclass(frozen=True)
class EngineSpec:
    """Everything the system knows of one engine.

    ``build(options, context)`` makes the engine. ``profile(options, requests, gpus_per_engine)``
    is its memory profile when it serves ``requests`` sequences of a step. ``check(options)``
    raises ``ValueError`` naming ``rollout.<name>.<field>`` for options it cannot run with.
    ``weight_dtype(options)``: the precision weights must be sent in (None: the trainer's).
    """

    name: str
    options: type  # the dataclass of the rollout.<name> section
    build: Callable[[Any, EngineContext], RolloutEngine]
    profile: Callable[[Any, int, float], EngineProfile]
    # the name of the weight transport it receives with, given its options, whether it shares the
    # trainer's devices and whether it runs on GPUs: one of its own ``transports`` or a generic one
    # (weight_sync.TRANSPORTS); the one place that decides how weights reach it
    transport: Callable[[Any, bool, bool], str]
    # the transports it declares, name -> "module:Class" (they live in its folder)
    transports: Mapping[str, str] = field(default_factory=dict)
    # the package it imports in the process that hosts it (None: none besides this one's)
    library: str | None = None
    check: Callable[[Any], None] = _no_check
    weight_dtype: Callable[[Any], str | None] = _engine_dtype
    # how the engine holds its weights beyond their dtype (None, or a form of
    # bpo_megatron.weights.fp8.SYNC_FORMS: "fp8" rounded through block e4m3, "fp8-blocks" e4m3
    # values and block scales): the trainer sends them so, and fingerprints what it sent
    weight_quantization: Callable[[Any], str | None] = _no_quantization
    # (options, the model's HFModelConfig): which quantized layers it builds at its layout, which it
    # serves in its dtype instead and which it cannot serve (QuantizedLayout; None: it does not
    # quantize, or builds any shape); checked at `train --check` and by `bpo-megatron plan`
    quantized_layout: Callable[[Any, Any], QuantizedLayout | None] = _no_layout
    # how a delta weight sync (weight_sync.delta) reaches it over a transport, given its options and
    # the transport's name: "sparse" (changed elements as flat indices and values, written in place)
    # or "tensors" (the changed tensors whole; what any engine that loads named tensors takes)
    weight_delta: Callable[[Any, str], str] = _whole_tensors
    # releasing its memory for a colocated trainer drops its weights (not only its caches), so the
    # sync after each train phase is a full one and a delta sync has nothing to build on
    drops_weights_when_released: bool = False
    captures_routing_without_gpu: bool = True  # R3 capture works on a CPU-only machine
    exposes_weights: bool = False  # can report what it holds (weight_sync.verify)
    # a generation under way pauses for a weight update and continues with the new weights, each
    # token recording the version that sampled it (partial rollouts, train.async)
    partial_rollouts: bool = False
    # the sampler's top-k ids and log q per generated token it returns (SamplingParams.top_logprobs:
    # what loss.score_centering is built from): "none"; "drawn": of the distribution it drew from,
    # filters included; "unfiltered": of the temperature-scaled distribution before top-k/top-p
    # (the one drawn from only when no filter is set)
    top_logprobs: TopLogprobs = "none"
    # what the user should know of these options before a run starts (train --check prints them)
    notes: Callable[[Any], list[str]] = _no_notes

    def weight_transport(self, options: Any, colocated: bool, gpus: bool) -> str:
        """What the trainer's ranks build the transport from (``weight_sync.transport_class``):
        one of this engine's own as ``module:Class``, or a generic one by name."""
        name = self.transport(options, colocated, gpus)
        return self.transports.get(name, name)


# engine name -> its spec; a spec module is imported only when its engine is named
ENGINES = LazyRegistry({
    "hf": "bpo_megatron.rollout.hf.spec:SPEC",
    "sglang": "bpo_megatron.rollout.sglang.spec:SPEC",
    "vllm": "bpo_megatron.rollout.vllm.spec:SPEC",
}, unknown="rollout.engine={name!r} is unknown; choose one of {sorted}")


def engine_spec(name: str) -> EngineSpec:
    return ENGINES.load(name)


def engine_options() -> dict[str, type]:
    """Each registered engine's name and the dataclass of its own section (``rollout.<name>``)."""
    return {name: engine_spec(name).options for name in ENGINES}
