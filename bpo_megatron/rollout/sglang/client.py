"""Generation against one SGLang server: one request per sample, up to ``max_inflight`` at once.

SGLang admits requests while its KV pool holds them, queues the rest and retracts on overflow by
itself: a client only has to keep it supplied. A batched ``/generate`` holds its requests' slots
until its longest answer ends, so with RL's long-tailed lengths a batch of posts leaves the pool
mostly idle; here every sample is its own request on one event loop (aiohttp), and as each
returns the next is posted. A retried request gets a fresh ``rid`` (SGLang refuses an id it may
still hold). A request has no deadline by default (``rollout.sglang.request_timeout_s``: one would
count the time it waits in SGLang's queue); a server that stops making progress is the stall
watch's to find. A connection that breaks is the server's death only when the server no longer
answers ``/health``: otherwise (a keep-alive race, one dropped socket) the request is sent again.
Decoding an answer — SGLang's routed experts arrive as base64 int32 rows of every
layer — runs in worker threads, off the event loop, and keeps only the MoE layers in the smallest
integer type.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from bpo_megatron.models.routing import RoutingLayout
from bpo_megatron.rollout.sglang.http import RequestTimeout, ServerError, ServerUnavailable
from bpo_megatron.rollout.sglang.protocol import Pause, decode_sample, generate_body
from bpo_megatron.rollout.engine import Finished
from bpo_megatron.rollout.types import ResponseSlot, Sample

DECODE_THREADS = 2  # base64 → uint8 routing decoding beside the event loop
CONNECT_TIMEOUT_S = 60.0  # opening a connection to a live server takes far less, however long its queue
HEALTH_REUSE_S = 1.0  # the requests a server's death breaks together share one health probe


class RolloutFailed(RuntimeError):
    """Generation could not be completed (a request kept timing out, or SGLang refused one)."""


@dataclass(frozen=True)
class _Attempt:
    """A slot as sent the ``number``-th time: a retry carries a fresh ``rid``."""

    slot: ResponseSlot
    number: int

    @property
    def request(self):
        return self.slot.request

    @property
    def index(self) -> int:
        return self.slot.index

    @property
    def seed(self) -> int | None:
        return self.slot.seed

    @property
    def rid(self) -> str:
        return self.slot.rid if self.number == 0 else f"{self.slot.rid}.retry{self.number}"


class GenerationClient:
    def __init__(self, base_url: str, api_key: str | None, *, max_inflight: int, request_timeout_s: float | None,
                 max_retries: int, capture_routing: bool, routing: RoutingLayout | None, pause_mode: str,
                 healthy: Callable[[], bool] | None = None, pauses: Callable[[], list[Pause]] | None = None,
                 space_retractions_now: Callable[[], float | None] | None = None) -> None:
        """``pause_mode``: how the engine pauses for weight updates (which tokens' routing it
        re-prefills, :func:`~bpo_megatron.rollout.sglang.protocol.decode_sample`).
        ``request_timeout_s``: each request's deadline (None: none; connecting is bounded by
        ``CONNECT_TIMEOUT_S`` either way). ``healthy``: whether the server is alive and answers
        (its process, ``/health``); a request whose connection breaks is sent again when it is,
        within ``max_retries``, and the server is given up as lost only when it is not (without
        ``healthy``: at once). ``pauses``: the server's re-prefilling pauses so far, and
        ``space_retractions_now`` its retractions for KV space so far: what tells a pause's
        retraction of a request still in prefill from one for space
        (:func:`~bpo_megatron.rollout.sglang.protocol.retracted_before_output`)."""
        self.url = f"{base_url}/generate"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.max_inflight, self.timeout_s, self.max_retries = max_inflight, request_timeout_s, max_retries
        self.capture_routing, self.routing, self.pause_mode = capture_routing, routing, pause_mode
        self.healthy = healthy
        self.pauses, self.space_retractions_now = pauses, space_retractions_now
        self._health_lock: asyncio.Lock | None = None
        self._health_seen: tuple[float, bool] | None = None  # (when, what) the last probe found

    def generate(self, slots: list[ResponseSlot], finished: Callable[[Finished], None] | None = None) -> list[Sample]:
        """Every slot's sample, in slot order (``finished`` is told each as it comes: its slot's
        position and it). Raises :class:`ServerUnavailable` as soon as the server is gone (the
        requests under way are abandoned), :class:`RolloutFailed` for a request SGLang refused or
        that kept timing out."""
        return asyncio.run(self._all(slots, finished))

    async def _all(self, slots: list[ResponseSlot], finished: Callable[[Finished], None] | None) -> list[Sample]:
        import aiohttp

        inflight = asyncio.Semaphore(self.max_inflight)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=CONNECT_TIMEOUT_S)
        self._health_lock = asyncio.Lock()
        connector = aiohttp.TCPConnector(limit=self.max_inflight)
        with ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="sglang-decode") as decoder:
            async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=self.headers) as session:
                tasks = [asyncio.create_task(self._one(session, inflight, decoder, slot)) for slot in slots]
                if finished is not None:
                    for position, task in enumerate(tasks):
                        task.add_done_callback(lambda done, position=position: _tell(finished, position, done))
                try:
                    return list(await asyncio.gather(*tasks))
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, session, inflight: asyncio.Semaphore, decoder: ThreadPoolExecutor,
                   slot: ResponseSlot) -> Sample:
        attempt = 0
        while True:
            sent = _Attempt(slot, attempt)
            try:
                async with inflight:
                    posted = len(self.pauses()) if self.pauses is not None else 0
                    payload = await self._post(session, sent)
                return await asyncio.get_running_loop().run_in_executor(decoder, self._decode, sent, payload, posted)
            except ServerUnavailable as exc:  # the connection broke: the server's death, or one request's bad luck
                if not await self._server_healthy():
                    raise
                attempt += 1
                if attempt > self.max_retries:
                    raise RolloutFailed(f"request {slot.rid} lost its connection {attempt} times to a server that "
                                        f"answers /health (last: {exc}); raise rollout.sglang.max_retries") from exc
            except (RequestTimeout, ServerError) as exc:
                if isinstance(exc, ServerError) and not exc.retryable:
                    raise RolloutFailed(f"SGLang refused request {sent.rid}: {exc}") from exc
                attempt += 1
                if attempt > self.max_retries:
                    raise RolloutFailed(f"request {slot.rid} failed {attempt} times (last: {exc}); raise "
                                        "rollout.sglang.request_timeout_s (or null it) or rollout.sglang.max_retries"
                                        ) from exc

    async def _server_healthy(self) -> bool:
        """``healthy()`` off the event loop, probed once for the requests that broke together (a
        finding is reused for ``HEALTH_REUSE_S``)."""
        if self.healthy is None:
            return False
        async with self._health_lock:
            now = time.monotonic()
            if self._health_seen is None or now - self._health_seen[0] > HEALTH_REUSE_S:
                alive = await asyncio.get_running_loop().run_in_executor(None, self.healthy)
                self._health_seen = (time.monotonic(), bool(alive))
            return self._health_seen[1]

    async def _post(self, session, slot: _Attempt) -> bytes:
        import aiohttp

        body = generate_body([slot], capture_routing=self.capture_routing)
        try:
            async with session.post(self.url, data=json.dumps(body)) as response:
                payload = await response.read()
                if response.status >= 400:
                    detail = payload.decode(errors="replace")[:500]
                    raise ServerError(f"POST {self.url} -> HTTP {response.status}: {detail}",
                                      retryable=response.status >= 500)
        except asyncio.TimeoutError as exc:
            raise RequestTimeout(f"POST {self.url} gave no answer within {self.timeout_s:.0f}s (or did not connect "
                                 f"within {CONNECT_TIMEOUT_S:.0f}s)" if self.timeout_s else
                                 f"POST {self.url} did not connect within {CONNECT_TIMEOUT_S:.0f}s") from exc
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise ServerUnavailable(f"POST {self.url}: {exc}") from exc
        return payload

    def _decode(self, slot: _Attempt, payload: bytes, posted: int) -> Sample:
        """The answer's JSON and routing, parsed in a decoding thread (``posted``: the server's
        pauses before the request was sent)."""
        answer = json.loads(payload)
        if not isinstance(answer, list) or len(answer) != 1:
            raise ServerError(f"/generate returned {type(answer).__name__} for 1 request", retryable=True)
        pauses = self.pauses()[posted:] if self.pauses is not None else ()
        return decode_sample(slot, answer[0], routing=self.routing, pause_mode=self.pause_mode, pauses=pauses,
                             space_retractions_now=self.space_retractions_now)


def _tell(finished: Callable[[Finished], None], position: int, task: asyncio.Task) -> None:
    """A request's sample, to ``finished``, once its task has one (a failure is raised by the gather)."""
    if not task.cancelled() and task.exception() is None:
        finished([(position, task.result())])
