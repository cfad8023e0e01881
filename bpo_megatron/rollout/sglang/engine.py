"""The SGLang rollout engine: one server (started here or attached to), driven over HTTP."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch

from bpo_megatron.models.routing import RoutingLayout
from bpo_megatron.rollout.engine import EngineCapabilities, EngineLost, RolloutEngine
from bpo_megatron.rollout.sglang.options import SGLangConfig
from bpo_megatron.rollout.sglang.http import (
    RequestTimeout,
    ServerError,
    ServerUnavailable,
    request_json,
)
from bpo_megatron.rollout.sglang.protocol import decode_sample, generate_body
from bpo_megatron.rollout.sglang.server import ServerProcess
from bpo_megatron.rollout.sglang.weights import flattened_bucket, ipc_payload, ipc_update_body
from bpo_megatron.rollout.types import (
    EngineHealth,
    GenerationRequest,
    ResponseSlot,
    Sample,
    response_slots,
)
from bpo_megatron.rollout.weight_buckets import buckets, tensor_bytes


class RolloutFailed(RuntimeError):
    """Generation could not be completed (a request kept timing out or the server kept dying)."""


class WeightUpdateRefused(RuntimeError):
    """The server refused a step of a weight update (its message says why)."""


# keep in-flight requests and their output (SGLang's default "abort" would end them); unlike
# "in_place" it frees their KV cache, so the cache flush after the update succeeds
PAUSE_MODE = "retract"


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
        self.weight_version = self._pending_version = 0
        if self.server is not None:
            self.server.start()

    @property
    def base_url(self) -> str:
        return (self.cfg.url or self.server.base_url).rstrip("/")

    # ------------------------------------------------------------------------------ generation
    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        """Responses to ``requests``. It may run while another thread updates the weights
        (partial rollouts, ``train.async``): SGLang holds the requests it has not started, stops
        decoding the others at the pause (``retract``: their output is kept) and finishes them all
        with the new weights after ``continue_generation``; each sample's ``token_versions`` say
        which weights sampled each token."""
        items = response_slots(requests)
        chunks = [tuple(items[i : i + self.cfg.requests_per_post])
                  for i in range(0, len(items), self.cfg.requests_per_post)]
        results: dict[str, Sample] = {}
        attempts = {chunk: 0 for chunk in chunks}
        pending = chunks
        while pending:
            failed, server_down = [], False
            with ThreadPoolExecutor(max_workers=self.cfg.concurrent_posts) as pool:
                futures = {pool.submit(self._post_generate, chunk): chunk for chunk in pending}
                for future in as_completed(futures):
                    chunk = futures[future]
                    try:
                        for sample, item in zip(future.result(), chunk):
                            if item.rid in results:
                                raise RolloutFailed(f"request {item.rid} was answered twice")
                            results[item.rid] = sample
                    except ServerUnavailable:
                        server_down = True
                        failed.append(chunk)
                    except (RequestTimeout, ServerError) as exc:
                        if isinstance(exc, ServerError) and not exc.retryable:
                            raise RolloutFailed(f"SGLang refused a request: {exc}") from exc
                        attempts[chunk] += 1
                        if attempts[chunk] > self.cfg.max_retries:
                            raise RolloutFailed(
                                f"requests {chunk[0].rid}..{chunk[-1].rid} failed {attempts[chunk]} times "
                                f"(last: {exc}); raise rollout.sglang.request_timeout_s or max_retries"
                            ) from exc
                        failed.append(chunk)
            if server_down or (self.server is not None and not self.server.alive()):
                self._lost()
            pending = failed
        return [results[item.rid] for item in items]

    def _post_generate(self, chunk: tuple[ResponseSlot, ...]) -> list[Sample]:
        body = generate_body(list(chunk), capture_routing=self.cfg.capture_routed_experts)
        response = request_json("POST", f"{self.base_url}/generate", body, timeout=self.cfg.request_timeout_s)
        if not isinstance(response, list) or len(response) != len(chunk):
            raise ServerError(f"/generate returned {type(response).__name__} for {len(chunk)} requests",
                              retryable=True)
        return [decode_sample(item, answer, routing=self.routing) for item, answer in zip(chunk, response)]

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
        (:mod:`bpo_megatron.weight_sync.cuda_ipc`) gives each TP rank its own GPU's copy instead."""
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
        self._post("continue_generation", {})
        self._paused, self.weight_version = False, self._pending_version

    # ------------------------------------------------------------------------------- control
    def release_memory(self) -> None:
        """The server hands all of its GPU memory back (``--enable-memory-saver``)."""
        self._post("release_memory_occupation", {})

    def resume_memory(self, tags: tuple[str, ...] = ()) -> None:
        self._post("resume_memory_occupation", {"tags": list(tags)} if tags else {})

    def health(self) -> EngineHealth:
        if self.server is not None and not self.server.alive():
            return EngineHealth(False, f"process exited ({self.server.process and self.server.process.returncode})")
        try:
            request_json("GET", f"{self.base_url}/health", timeout=10.0)
            return EngineHealth(True)
        except (ServerUnavailable, RequestTimeout, ServerError) as exc:
            return EngineHealth(False, str(exc))

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()

    def _post(self, endpoint: str, body: dict | None):
        return request_json("POST", f"{self.base_url}/{endpoint}", body, timeout=self.cfg.request_timeout_s)

    def _checked(self, endpoint: str, body: dict):
        """A call whose reply says ``success``; a refusal raises naming the endpoint."""
        try:
            reply = self._post(endpoint, body)
        except ServerError as exc:
            raise WeightUpdateRefused(f"SGLang refused /{endpoint}: {exc}") from exc
        if isinstance(reply, dict) and reply.get("success") is False:
            raise WeightUpdateRefused(f"SGLang refused /{endpoint}: {reply.get('message')}")
        return reply
