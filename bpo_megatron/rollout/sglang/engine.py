"""The SGLang rollout engine: one server (started here or attached to), driven over HTTP."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future

import torch

from bpo_megatron.models.routing import RoutingLayout
from bpo_megatron.rollout.engine import (
    EngineCapabilities, EngineLost, EngineUnresponsive, Finished, RolloutEngine, as_finished,
)
from bpo_megatron.rollout.sglang.client import GenerationClient, RolloutFailed  # noqa: F401 - raised through generate
from bpo_megatron.rollout.sglang.endpoint import ServerEndpoint
from bpo_megatron.rollout.sglang.nccl import UNKNOWN, server_nccl_version
from bpo_megatron.rollout.sglang.options import SGLangConfig
from bpo_megatron.rollout.sglang.protocol import Pause, space_retractions_total
from bpo_megatron.rollout.sglang.http import (
    RequestTimeout,
    ServerError,
    ServerUnavailable,
)
from bpo_megatron.rollout.sglang.server import ServerProcess
from bpo_megatron.rollout.sglang.weights import flattened_bucket, ipc_payload, ipc_update_body
from bpo_megatron.rollout.types import (
    EngineHealth,
    GenerationRequest,
    Sample,
    response_slots,
)
from bpo_megatron.weights.buckets import buckets, tensor_bytes


def capacity_tokens(state: dict) -> int | None:
    """The tokens a server's KV pool holds, from one entry of ``/server_info``'s
    ``internal_states`` (SGLang 0.5.23: ``memory_usage.token_capacity``); None when not said."""
    tokens = (state.get("memory_usage") or {}).get("token_capacity")
    return int(tokens) if tokens else None


def pool_sequences(state: dict, sequence_tokens: int) -> int | None:
    """Sequences of ``sequence_tokens`` the server's KV pool holds at once (at least 1: one
    request always runs); None when the pool or the length is unknown."""
    tokens = capacity_tokens(state)
    if tokens is None or sequence_tokens < 1:
        return None
    return max(1, tokens // sequence_tokens)


class WeightUpdateRefused(RuntimeError):
    """The server refused a step of a weight update (its message says why)."""


# keep in-flight requests and their output (SGLang's default "abort" would end them); unlike
# "in_place" it frees their KV cache, so the cache flush after the update succeeds
PAUSE_MODE = "retract"
# SGLang's memory tags (``--enable-memory-saver``): what release_memory hands back
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
DEFAULT_INFLIGHT = (256, 1024)  # bounds of the requests in flight taken from the server's own limit
CONTROL_TIMEOUT_S = 1800.0  # a control call (memory, weights, versions) that takes longer: the server is stuck
LIVENESS_TIMEOUT_S = 10.0  # /health without generation answers at once from a live server
# /health_generate waits up to SGLang's own 20 s for a token before it answers 503
GENERATING_CHECK_TIMEOUT_S = 40.0


class SGLangEngine(RolloutEngine):
    """``serializer`` (tests only) replaces SGLang's tensor serializer on the IPC route."""

    def __init__(self, cfg: SGLangConfig, *, routing: RoutingLayout | None = None, serializer=None) -> None:
        if cfg.capture_routed_experts and routing is None:
            raise ValueError("capturing routed experts needs the model's routing layout (its layers, MoE layers, top-k)")
        self.cfg = cfg
        self.routing = routing if cfg.capture_routed_experts else None
        self.capabilities = EngineCapabilities(captures_routing=cfg.capture_routed_experts)
        self.server = None if cfg.url else ServerProcess(cfg)
        self._serializer = serializer
        self._paused = False
        self._generating = 0  # generate calls under way (health checks never generate beside them)
        self._count_lock = threading.Lock()
        # the memory tags this server has handed back and not resumed: resuming any other would
        # raise in SGLang's scheduler and take the server down
        self.released: set[str] = set()
        self._limits: tuple[int | None, int | None] | None = None  # see _server_limits
        self._inflight_said: tuple | None = None  # the in-flight note last printed
        # the NCCL version of the server's interpreter, asked beside the server's start (the probe
        # imports torch: seconds to minutes on a busy node, which a weight-group call's own bound
        # must not include); an answer may be None: an interpreter without NCCL
        self._nccl_version: Future = Future()
        self.weight_version = self._pending_version = 0
        self.pauses: list[Pause] = []  # each weight update's pause, with the server's space retractions then
        if self.server is not None:
            threading.Thread(target=self._ask_nccl_version, name="sglang-nccl-probe", daemon=True).start()
            self.server.start()
        else:
            self._nccl_version.set_result(UNKNOWN)  # attached by URL: nobody can ask it

    def _ask_nccl_version(self) -> None:
        try:
            self._nccl_version.set_result(server_nccl_version(self.cfg.launcher, self.cfg.visible_devices))
        except BaseException as exc:  # noqa: BLE001 - NcclVersionUnknown and whatever else: the weight group's to raise
            self._nccl_version.set_exception(exc)

    @property
    def base_url(self) -> str:
        return (self.cfg.url or self.server.base_url).rstrip("/")

    @property
    def api_key(self) -> str | None:
        return None if self.server is None else self.server.api_key

    def nccl_version(self):
        """The NCCL version the server's interpreter runs (asked once, beside the server's start;
        ``UNKNOWN`` for a server attached by URL): a weight group refuses members of different versions."""
        return self._nccl_version.result()  # the probe started with the server; it has its own bound

    def endpoint(self) -> ServerEndpoint:
        """Where the trainer reaches this server (its node's address) and with which key."""
        return ServerEndpoint(self.base_url, self.cfg.tp_size, self.api_key)

    def weight_details(self) -> ServerEndpoint:
        """What ``nccl_broadcast`` and ``cuda_ipc`` reach the server by: :meth:`endpoint`."""
        return self.endpoint()

    # ------------------------------------------------------------------------------ generation
    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        """Responses to ``requests``. It may run while another thread updates the weights
        (partial rollouts, ``train.async``): SGLang holds the requests it has not started, stops
        decoding the others at the pause (``retract``: their output is kept) and finishes them all
        with the new weights after ``continue_generation``; each sample's ``token_versions`` say
        which weights sampled each token."""
        return self._generate(requests, None)

    def generate_as_finished(self, requests: list[GenerationRequest]) -> Iterator[Finished]:
        """Each sample as its request returns."""
        return as_finished(lambda report: self._generate(requests, report))

    def _generate(self, requests: list[GenerationRequest], report: Callable[[Finished], None] | None) -> list[Sample]:
        with self._count_lock:
            self._generating += 1
        try:
            return self._post_all(requests, report)
        finally:
            with self._count_lock:
                self._generating -= 1

    def _post_all(self, requests: list[GenerationRequest], report: Callable[[Finished], None] | None) -> list[Sample]:
        try:  # max_inflight may ask the server first: a server gone by then is the engine lost too
            client = GenerationClient(self.base_url, self.api_key, max_inflight=self.max_inflight,
                                      request_timeout_s=self.cfg.request_timeout_s, max_retries=self.cfg.max_retries,
                                      capture_routing=self.cfg.capture_routed_experts, routing=self.routing,
                                      pause_mode=PAUSE_MODE, healthy=self._answers_health,
                                      pauses=lambda: list(self.pauses), space_retractions_now=self.space_retractions)
            return client.generate(response_slots(requests), report)
        except ServerUnavailable:
            self._lost()
            raise  # not reached: _lost raises

    @property
    def max_inflight(self) -> int:
        """Requests posted at once: ``rollout.sglang.max_inflight``, else the server's own limit of
        running requests within [256, 1024]; either way no more than the full-length sequences its
        KV pool holds (``memory_usage.token_capacity`` // ``sequence_tokens``, asked of the server
        once), so the server never retracts a response for space. A configured value above that
        is lowered, and said."""
        asked = self.cfg.max_inflight
        if asked is not None and not self.cfg.sequence_tokens:
            return asked  # nothing to hold it against
        running, capacity = self._server_limits()
        if asked is None:
            asked = min(max(running or DEFAULT_INFLIGHT[0], DEFAULT_INFLIGHT[0]), DEFAULT_INFLIGHT[1])
        inflight = asked if capacity is None else min(asked, capacity)
        said = (self.cfg.max_inflight, inflight)
        if capacity is not None and (self.cfg.max_inflight is None or inflight < asked) and self._inflight_said != said:
            self._inflight_said = said
            setting = ("rollout.sglang.max_inflight unset" if self.cfg.max_inflight is None
                       else f"rollout.sglang.max_inflight={asked} lowered")
            print(f"sglang engine {self.base_url}: {setting}: {inflight} requests in flight, the sequences of "
                  f"{self.cfg.sequence_tokens} tokens its KV pool holds (so none is retracted for space)", flush=True)
        return inflight

    def _server_limits(self) -> tuple[int | None, int | None]:
        """The server's limit of running requests and the full-length sequences its KV pool holds
        (None where ``/server_info`` does not say), asked once."""
        if self._limits is None:
            info = self.endpoint().get("server_info", timeout=LIVENESS_TIMEOUT_S)
            states = (info.get("internal_states") if isinstance(info, dict) else None) or [{}]
            running = states[0].get("effective_max_running_requests_per_dp")
            self._limits = (int(running) if running else None, pool_sequences(states[0], self.cfg.sequence_tokens))
        return self._limits

    def _answers_health(self) -> bool:
        """The server's process runs (when started here) and ``/health`` answers."""
        if self.server is not None and not self.server.alive():
            return False
        try:
            self.endpoint().get("health", timeout=LIVENESS_TIMEOUT_S)
        except (ServerUnavailable, RequestTimeout, ServerError):
            return False
        return True

    def _lost(self) -> None:
        """A server that died took its weights along: a restart would serve the initial ones."""
        if self.server is None:
            raise RolloutFailed(f"the SGLang server at {self.cfg.url} stopped answering (attached with "
                                "rollout.sglang.url, so it is not restarted here)")
        log = self.server.log_tail()
        self.shutdown()
        raise EngineLost(f"the SGLang server died (weights of version {self.weight_version} gone with it); "
                         f"last output:\n{log}")

    # ------------------------------------------------------------------------------- weights
    def join_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                          group_name: str, backend: str) -> None:
        """The server's TP ranks join a weight group hosted elsewhere (the trainer's rank 0) as
        ranks ``rank_offset …``; returns once they joined (run it beside the host's own join)."""
        self._checked("init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def leave_weight_group(self, group_name: str) -> None:
        self._checked("destroy_weights_update_group", {"group_name": group_name})

    def begin_weight_update(self, version: int) -> None:
        """Pause (in-flight requests kept) and open SGLang's weight-update session."""
        self._post("pause_generation", {"mode": PAUSE_MODE})
        self._paused = True
        self._checked("begin_weight_update", {})
        self._pending_version = int(version)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Hand the server tensors held in this process's device memory (CUDA IPC, SGLang's
        flattened buckets; every TP rank maps the same buffer). The trainer's colocated transport
        (:mod:`bpo_megatron.rollout.sglang.cuda_ipc`) gives each TP rank its own GPU's copy instead."""
        if not self._paused:
            raise RuntimeError("update_weights() outside a weight update: call begin_weight_update() first")
        sent = 0
        for bucket in buckets(named_tensors, self.cfg.weight_bucket_bytes):
            payload = ipc_payload(flattened_bucket(bucket), self._serializer)
            self._checked("update_weights_from_tensor", ipc_update_body([payload] * self.cfg.tp_size,
                                                                        self._pending_version))
            sent += sum(tensor_bytes(t) for _, t in bucket)
        return sent

    def end_weight_update(self) -> None:
        """Close the session, drop the cache of the old weights, admit work again."""
        self._checked("end_weight_update", {})
        self._post("flush_cache", None)  # no KV computed with the old weights may be reused
        # read while paused: a space retraction after the continue is one the pause's count does not hold
        self.pauses.append(Pause(self._pending_version, self.space_retractions()))
        self._post("continue_generation", {})
        self._paused, self.weight_version = False, self._pending_version

    def space_retractions(self) -> float | None:
        """The requests the server retracted for KV space so far (SGLang's
        ``sglang:num_retracted_requests_total`` at ``/metrics``, which the engine starts it with
        when capturing routing); None when it does not report them (the metrics off on a server
        attached by URL, or the read failed): a retraction is then taken as one for space."""
        try:
            exposition = self.endpoint().get("metrics", timeout=LIVENESS_TIMEOUT_S)
        except (ServerUnavailable, RequestTimeout, ServerError):
            return None
        return space_retractions_total(exposition) if isinstance(exposition, str) else None

    # ------------------------------------------------------------------------------- control
    def release_memory(self) -> None:
        """The server hands the GPU memory it still holds back (``--enable-memory-saver``); a
        server that already released everything is not asked again. Released weights are gone
        (SGLang keeps no host copy of them), so the server holds no version until the next sync:
        a delta sync (weight_sync.delta) must not build on the version it held before."""
        tags = [tag for tag in MEMORY_TAGS if tag not in self.released]
        if tags:
            self._post("release_memory_occupation", {"tags": tags})
            self.released.update(tags)
            if "weights" in tags:
                self.weight_version = 0

    def resume_memory(self, tags: tuple[str, ...] = ()) -> None:
        """Take back ``tags`` (() all) of what was released; a tag this server holds is left
        out of the call (SGLang refuses to resume it and its scheduler dies)."""
        wanted = [tag for tag in (tags or MEMORY_TAGS) if tag in self.released]
        if wanted:
            self._post("resume_memory_occupation", {"tags": wanted})
            self.released.difference_update(wanted)

    def health(self) -> EngineHealth:
        """Alive and answering. The server runs a one-token generation for it only when that is
        safe and meaningful: it holds all its memory (a forward pass on a released KV cache kills
        it), is not paused (a paused server holds the check's request) and generates nothing for
        us (a busy server answers from the work under way)."""
        if self.server is not None and not self.server.alive():
            return EngineHealth(False, f"process exited ({self.server.process and self.server.process.returncode})")
        generating = not self.released and not self._paused and not self._generating
        route, timeout = ("health_generate", GENERATING_CHECK_TIMEOUT_S) if generating else ("health", LIVENESS_TIMEOUT_S)
        try:
            self.endpoint().get(route, timeout=timeout)
            return EngineHealth(True)
        except (ServerUnavailable, RequestTimeout, ServerError) as exc:
            return EngineHealth(False, str(exc))

    def progress(self) -> None:
        """A round trip through the server's scheduler (``/server_info`` asks it for its state
        between two forward passes): a stopped or wedged server does not answer. SGLang reports
        no token count, so the answer itself is the sign of progress."""
        if self.server is not None and not self.server.alive():
            raise EngineUnresponsive(f"the SGLang server at {self.base_url} exited")
        try:
            self.endpoint().get("server_info", timeout=LIVENESS_TIMEOUT_S)
        except (ServerUnavailable, RequestTimeout, ServerError) as exc:
            raise EngineUnresponsive(f"the SGLang server at {self.base_url} did not answer /server_info: {exc}") from exc
        return None

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()

    def _post(self, route: str, body: dict | None):
        """A control call; nothing answering at the server's address means the engine is lost
        (whatever it held went with the server), which its group replaces, not a refusal."""
        try:
            return self.endpoint().post(route, body, timeout=CONTROL_TIMEOUT_S)
        except ServerUnavailable:
            self._lost()
            raise  # not reached: _lost raises

    def _checked(self, endpoint: str, body: dict):
        """A call whose reply says ``success``; a refusal raises naming the endpoint."""
        try:
            reply = self._post(endpoint, body)
        except ServerError as exc:
            raise WeightUpdateRefused(f"SGLang refused /{endpoint}: {exc}") from exc
        if isinstance(reply, dict) and reply.get("success") is False:
            raise WeightUpdateRefused(f"SGLang refused /{endpoint}: {reply.get('message')}")
        return reply
