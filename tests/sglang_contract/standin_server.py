"""An SGLang 0.5.23 server built from SGLang's own code, for the contract tests (CPU, no kernels).

Run with the Python of SGLang's environment (``tools/setup.sh --sglang`` builds ``.venv-sglang``),
started by our client exactly as it starts ``python -m sglang.launch_server``: in its own process
tree with its own ``multiprocessing`` authkey, from the command line our client builds, which
SGLang's own ``ServerArgs`` parser must accept.

SGLang's code that runs: the FastAPI app of ``sglang.srt.entrypoints.http_server`` (routes, request
types of ``io_struct`` and their parsing, the ``/generate`` contract check, error responses),
served by uvicorn; per TP rank, in its own process, SGLang's scheduler-side weight-update manager
(``standin_rank.py``). Ours: the tokenizer manager the routes call (it fans calls out to the ranks
and merges their replies as SGLang's communicator does) and generation itself, which needs a GPU:
tokens come from a seeded generator, log-probs are made up, and routed experts are laid out as
SGLang lays them out (int32, every hidden layer, dense layers zero). ``GET /standin/state`` (ours)
reports each rank's weights and version and the calls received, for the tests.

Pause and continue: a paused server holds new ``/generate`` calls and stops decoding the requests
it has (``retract``/``in_place`` keep them and their output; they finish after
``/continue_generation`` in the same HTTP answer), as SGLang's tokenizer manager and scheduler do.
When a weight update changes the version, every live request with output records the change by
SGLang's own rule (``sglang.srt.utils.weight_versions.record_weight_version_events``), and a
finished request's ``meta_info.weight_versions`` spans come from SGLang's
``compute_weight_version_spans`` and ``add_weight_versions_to_meta_info``. The made-up log-prob of
a token carries the version that sampled it (``-0.1·(i+1) − 0.01·version``), so a client's
alignment of log-probs and versions can be checked. What is ours here: that decoding stops at a
token boundary when paused (SGLang retracts at a scheduler step), and that a position's routed
experts are made up from (request, position, the version that routed it): under ``retract`` every
position reports the request's last version (SGLang re-prefills the prefix with the new weights),
under ``in_place`` the version that processed it.

What this stand-in does not do that SGLang does (so nothing here proves it): real generation and
kernels, CUDA IPC and NCCL, TP ranks in one process group, SGLang's own retraction of requests when
its KV pool overflows unless asked to (``--standin-new-token-ratio``, below), its tokenizer
manager's request state machine (ours answers a finished request in one piece), streaming, and the
memory saver's device pages (host storages stand for them).

What hurts, as in SGLang: ``/health`` is SGLang's own handler, which generates a token unless
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` is false in the server's environment; with
``--enable-memory-saver``, a forward pass (a generation, the health check's included) while any
memory tag is released kills the server (an illegal memory access on unmapped pages), a release
while requests run fails SGLang's own idle assertion (the scheduler, and so the server, dies),
and resuming a tag that was not released raises SGLang's ``KeyError``. The server binds exactly
``--host`` (another loopback address of this machine reaches nothing) and, with ``--api-key``,
SGLang's own middleware refuses every call without the key (health probes excepted, as SGLang
does).

Test controls (``--standin-*``, removed before SGLang parses the rest): ``--standin-die-after N``
exits on the N-th ``/generate`` (once per ``--standin-marker-dir``), ``--standin-die-after-release N``
``--standin-die-delay S`` S seconds after its N-th memory release (once too: while a colocated
trainer holds the devices); ``--standin-token-delay S``
sleeps S seconds after each decoding step (a generation long enough to be paused), and
``--standin-seq-delay S`` S more per running sequence (a batch costs more the larger it is);
``--standin-kv-tokens N`` gives the KV pool N tokens (0: unbounded); ``--standin-call-log PATH``
appends every control call received to PATH (JSON lines); ``--standin-lengths longtail``
draws response lengths as long-tailed as RL's (30% at ``max_new_tokens``, the rest log-uniform
below it) instead of 3–7 tokens; ``--standin-drop-generate N`` closes the connection of the N-th
``POST /generate`` without an answer (once per marker directory: a keep-alive race, the server
stays up).

Retraction for KV space (``--standin-new-token-ratio R`` with ``--standin-kv-tokens``): admission
reserves, as SGLang's scheduler estimates it, the prompt and ``R × max_new_tokens`` of response; a
decoding step that would overflow the pool retracts running requests in SGLang's order (fewest
output tokens first, then longest prompt; at least one keeps running) back to the head of the
queue with their output kept, and counts each in ``meta_info.num_retractions`` (as SGLang's
``Req.reset_for_retract`` does, which a ``retract`` pause calls too: those are counted alike). A
retracted request is prefilled again in another batch, so the routing reported for every position
is the last prefill's, which differs from the routing that sampled the tokens before it: made up
here from (request, position, version, space retractions so far).

Prefix cache (SGLang's radix cache, in outline): a finished request leaves its prompt and output
(but the last token, never fed) cached with the routed experts computed for them; a request's first
prefill takes the longest cached prefix of its prompt (at most all but one token) and reports it as
``meta_info.cached_tokens``, the routing of those positions being the cached one. The cache is
emptied by ``/flush_cache`` and by a weight update that changes the version, and holds
``--standin-prefix-cache-tokens N`` tokens at most (0: unbounded), the least recently used entries
evicted first. A request prefilled again after a retraction computes every position again. A
position's made-up experts depend on this server (its port), the tokens up to it, the version and
the request's space retractions so far, so a computation on another engine differs. Each finished
request is logged (``--standin-call-log``, ``"call": "request"``) with which computation routed
each position (server, request id, version, space retractions): every prefill's view of the
positions before ``routed_experts_start_len`` (what the tokens sampled after it saw) and the rows
reported, so a test can check what each token was sampled after against what is replayed.

Chunked prefill (``--standin-chunked-prefill N``): a prompt's uncomputed tokens are prefilled N per
scheduler step, the first token sampled in the step of the last chunk; a ``retract`` pause retracts
a request still in prefill too (SGLang's ``chunked_req``), counted in its ``num_retractions``
with no output token to show a version change. ``--standin-stop-at-end 1``: a response that reaches
its drawn length ends on one of its stop tokens (drawn), so conversations go on for several turns.
``--enable-metrics``: ``GET /metrics`` reports ``sglang:num_retracted_requests_total``, the
requests retracted for KV space so far (SGLang counts only those there, not a pause's).

Scheduling, as SGLang's scheduler does it in outline: every request waits in one queue, is admitted
while the KV pool holds its prompt and its response (this stand-in knows each response's length in
advance, SGLang estimates it and retracts on overflow), and one decoding step advances every
running request at once. ``/standin/state`` reports the KV pool's use and the running sequences
averaged over decoding steps, ``/standin/running`` each running request (its id, output tokens so
far, tokens left), and ``/server_info`` the pool's capacity and the most requests the
scheduler runs at once, as SGLang reports them.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import multiprocessing as mp
import os
import random
import sys
import threading
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    ours, theirs, i = [], [], 0
    while i < len(argv):
        if argv[i].startswith("--standin-"):
            ours += argv[i:i + 2]
            i += 2
        else:
            theirs.append(argv[i])
            i += 1
    return ours, theirs


def _parse() -> tuple[argparse.Namespace, argparse.Namespace]:
    from sglang.srt.server_args import ServerArgs

    ours, theirs = _split_argv(sys.argv[1:])
    controls = argparse.ArgumentParser()
    controls.add_argument("--standin-die-after", type=int, default=0)
    controls.add_argument("--standin-die-after-release", type=int, default=0)
    controls.add_argument("--standin-die-delay", type=float, default=0.0)
    controls.add_argument("--standin-marker-dir", default="")
    controls.add_argument("--standin-token-delay", type=float, default=0.0)
    controls.add_argument("--standin-seq-delay", type=float, default=0.0)
    controls.add_argument("--standin-kv-tokens", type=int, default=0)
    controls.add_argument("--standin-lengths", choices=("short", "longtail"), default="short")
    controls.add_argument("--standin-call-log", default="")
    controls.add_argument("--standin-new-token-ratio", type=float, default=0.0)
    controls.add_argument("--standin-drop-generate", type=int, default=0)
    controls.add_argument("--standin-prefix-cache-tokens", type=int, default=0)
    controls.add_argument("--standin-chunked-prefill", type=int, default=0)
    controls.add_argument("--standin-stop-at-end", type=int, default=0)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)  # SGLang's own flags: ours must be among them
    if "--config" in theirs:  # SGLang's own merge of a --config file into the flags
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

        theirs = ConfigArgumentMerger(parser).merge_config_with_args(theirs)
    args = parser.parse_args(theirs)
    args.device = "cpu"  # the stand-in's ranks compute nothing on a device
    return args, controls.parse_args(ours)


ARGS, CONTROLS = _parse()
MODEL = json.loads((Path(ARGS.model_path) / "config.json").read_text())
LOCK = threading.RLock()  # re-entered: a prefill under a decoding step's hold
STATE = {"generate_calls": 0, "generate_posts": 0, "releases": 0, "calls": [], "paused": False, "pause_mode": None, "tokens": 0, "released": [],
         "space_retractions": 0}


def _record(call: dict, *, keep: bool = True) -> None:
    """A call received (under LOCK): kept for /standin/state (``keep``) and, with
    ``--standin-call-log``, appended to that file (it outlives the server)."""
    if keep:
        STATE["calls"].append(call)
    if CONTROLS.standin_call_log:
        with open(CONTROLS.standin_call_log, "a") as log:
            log.write(json.dumps({"host": ARGS.host, "port": ARGS.port, **call}) + "\n")


def _once(name: str) -> bool:
    if not CONTROLS.standin_marker_dir:
        return True
    marker = Path(CONTROLS.standin_marker_dir) / f"standin.{name}"
    if marker.exists():
        return False
    marker.write_text("1")
    return True


class Ranks:
    """The TP rank processes; a call goes to all of them at once and their replies are merged."""

    def __init__(self, tp_size: int, model_dir: str) -> None:
        from standin_rank import import_sglang_rank_modules, rank_main

        # The ranks are forked from this process once it holds SGLang's scheduler-side modules: a
        # spawned rank imports them again (about 9 s of CPU each, most of a server's start-up).
        # Forked before uvicorn or any thread starts, each rank still runs in its own process.
        import_sglang_rank_modules()
        assert threading.active_count() == 1, "the TP ranks are forked before any thread starts"
        ctx = mp.get_context("fork")
        self._lock = threading.Lock()
        self.pipes, self.processes = [], []
        for rank in range(tp_size):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=rank_main, args=(rank, model_dir, theirs, ARGS.enable_memory_saver),
                                  daemon=True)
            process.start()
            theirs.close()  # the rank's end lives in the rank: a rank that dies is EOF here
            self.pipes.append(ours)
            self.processes.append(process)
        for pipe in self.pipes:
            self._reply(pipe)

    def _reply(self, pipe):
        status, value = pipe.recv()
        if status == "crash":  # a scheduler that raises takes the server down
            print(f"stand-in: a TP rank crashed:\n{value}", flush=True)
            os._exit(1)
        return value

    def call(self, method: str, request=None) -> list:
        with self._lock:  # one call at a time on the pipes (routes run in threads), as SGLang's queue does
            for pipe in self.pipes:
                pipe.send((method, request))
            return [self._reply(pipe) for pipe in self.pipes]

    def merged(self, method: str, request) -> tuple[bool, str]:
        replies = self.call(method, request)
        return all(ok for ok, _ in replies), " | ".join(message for _, message in replies)


class PrefixCache:
    """Finished sequences (prompt and output but the last token) with their routed experts and
    which computation routed each position; the least recently used go first past ``capacity``
    tokens (0: unbounded)."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.entries = capacity, {}  # tokens -> (rows, origins); insertion order = use order

    def match(self, prompt: list[int]) -> tuple[int, np.ndarray | None, list]:
        """The longest cached prefix of ``prompt`` (all but its last token at most): its length,
        rows and origins."""
        best, found = 0, None
        for key in self.entries:
            common = next((i for i, (a, b) in enumerate(zip(key, prompt)) if a != b), min(len(key), len(prompt)))
            if common > best:
                best, found = common, key
        best = min(best, len(prompt) - 1)
        if found is None or best <= 0:
            return 0, None, []
        rows, origins = self.entries.pop(found)
        self.entries[found] = (rows, origins)  # just used
        return best, rows[:best], origins[:best]

    def insert(self, tokens: tuple[int, ...], rows: np.ndarray, origins: list) -> None:
        if not tokens:
            return
        self.entries.pop(tokens, None)
        self.entries[tokens] = (rows, origins)
        while self.capacity and sum(len(key) for key in self.entries) > self.capacity and len(self.entries) > 1:
            self.entries.pop(next(iter(self.entries)))  # evicted

    def clear(self) -> None:
        self.entries.clear()


CACHE = PrefixCache(CONTROLS.standin_prefix_cache_tokens)


def _experts(tokens: list[int], rows: range, version_of, salt: int, rid: str) -> tuple[np.ndarray, list]:
    """Made-up routed experts of positions ``rows`` as SGLang lays them out (int32, every hidden
    layer, dense layers zero), and each position's origin (server, request, version, salt): from
    this server, the tokens up to the position, the weights version that routed it and the
    request's space retractions so far (``salt``: each a prefill of every position again in
    another batch)."""
    experts = MODEL.get("num_experts") or MODEL["num_local_experts"]  # transformers 5 writes the latter
    layers, topk = MODEL["num_hidden_layers"], MODEL["num_experts_per_tok"]
    dense = set(MODEL.get("mlp_only_layers") or [])
    out = np.zeros((len(rows), layers, topk), dtype=np.int32)
    origins, digest = [], 0
    for row in range(rows.stop):
        digest = (digest * 1_000_003 + tokens[row] + 1) % (1 << 61)  # the tokens up to this position
        if row < rows.start:
            continue
        version = version_of(row)
        rng = random.Random(f"{ARGS.port}/{digest}/{version}" + (f"/prefill{salt}" if salt else ""))
        for layer in range(layers):
            if layer not in dense:
                out[row - rows.start, layer] = rng.sample(range(experts), topk)
        origins.append((ARGS.port, rid, version, salt))
    return out, origins


def _segments(origins: list, offset: int = 0) -> list:
    """``origins`` run-length coded: ``[end, port, rid, version, salt]`` per run (rows counted from ``offset``)."""
    runs = []
    for row, origin in enumerate(origins, start=offset):
        if runs and tuple(runs[-1][1:]) == tuple(origin):
            runs[-1][0] = row + 1
        else:
            runs.append([row + 1, *origin])
    return runs


def _routed_experts(request: "Request", spans: list[dict]) -> tuple[np.ndarray, list]:
    """What SGLang reports for a finished request, every position ``[0, prompt + output − 1)``:
    the routed experts and each one's origin. Which version routed a position depends on the
    pause a weight update came with: ``retract`` frees the request's KV cache and SGLang prefills
    prompt + output again with the weights of the continue, so every position reports the
    request's last version (its last token's, from its ``weight_versions`` spans); ``in_place``
    keeps the cache, so a position keeps the version that processed it (the prompt: the
    prefill's, token 0's; position q ≥ P − 1: token q − P + 1's). A request never retracted keeps
    the cached routing of the prefix its first prefill took from the cache."""
    versions = [_version_number(span["version"]) for span in spans for _ in range(span["start"], span["end"])]
    last = _version_number(spans[-1]["version"])
    with LOCK:
        pauses = [call["mode"] for call in STATE["calls"] if call["call"] == "pause_generation"]
    in_place = bool(pauses) and pauses[-1] == "in_place"
    tokens = request.prompt + request.output_ids
    rows = len(request.prompt) + len(versions) - 1
    cached = 0 if request.retractions else min(request.cached, rows)
    fresh, origins = _experts(tokens, range(cached, rows),
                              lambda row: versions[max(0, row - len(request.prompt) + 1)] if in_place and versions
                              else last, request.space_retractions, request.rid)
    if cached:
        return np.concatenate([request.cached_rows[:cached], fresh]), list(request.cached_origins[:cached]) + origins
    return fresh, origins


def _version_number(version: str) -> int:
    return 0 if version == "default" else int(version)


def _logprob(position: int, version: str) -> float:
    return -0.1 * (position + 1) - 0.01 * _version_number(version)


def _response_length(cap: int, rng: random.Random) -> int:
    if CONTROLS.standin_lengths == "short":
        return min(cap, 3 + rng.randrange(5))
    if rng.random() < 0.3:
        return cap
    return max(1, min(cap, int(math.exp(rng.uniform(0.0, math.log(cap))))))


class Request:
    """One request decoding: what SGLang's ``Req`` holds that the version rule reads."""

    def __init__(self, rid: str, prompt: list[int], params: dict) -> None:
        seed = params.get("sampling_seed")
        self.rid, self.prompt = rid, prompt
        self.rng = random.Random(seed if seed is not None else rid)
        self.budget = _response_length(params.get("max_new_tokens") or 16, self.rng)
        self.stops = set(params.get("stop_token_ids") or [])
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.weight_version_events: list = []  # SGLang's WeightVersionEvent, appended by its own rule
        self.finish = {"type": "length", "length": self.budget}
        self.done = False
        self.max_new_tokens = params.get("max_new_tokens") or 16
        self.retractions = 0  # every retraction, a pause's included (SGLang's retraction_count)
        self.space_retractions = 0
        self.prefilled = False  # its first prefill has begun: cached_tokens is known
        self.cached, self.cached_rows, self.cached_origins = 0, None, []
        self.to_prefill = 0  # positions still to prefill (chunked prefill) before the next token
        # every prefill: (output tokens then, the origins of the positions before its routing start)
        self.prefills: list[tuple[int, list]] = []
        self.routing_start = 0
        self.reprefill = False  # a pause retracted it: the next step prefills it again

    def prefill(self, version: str) -> None:
        """A prefill (the first, or again after a retraction) begins: what routes the positions
        before ``routing_start`` from now on."""
        tokens = self.prompt + self.output_ids
        if not self.prefilled:  # SGLang counts cached_tokens at the first prefill only
            self.prefilled = True
            with LOCK:
                self.cached, self.cached_rows, self.cached_origins = CACHE.match(self.prompt)
        reuse = 0 if self.retractions else self.cached
        _, fresh = _experts(tokens, range(min(reuse, self.routing_start), self.routing_start),
                            lambda row: _version_number(version), self.space_retractions, self.rid)
        self.prefills.append((len(self.output_ids),
                              _segments(list(self.cached_origins[:min(reuse, self.routing_start)]) + fresh)))
        self.to_prefill = len(tokens) - reuse

    def step(self, version: str) -> None:
        chunk = CONTROLS.standin_chunked_prefill
        if chunk and self.to_prefill > chunk:  # a chunk of the prompt; no token yet
            self.to_prefill -= chunk
            return
        self.to_prefill = 0
        if CONTROLS.standin_stop_at_end and self.stops and len(self.output_ids) + 1 >= self.budget:
            token = self.rng.choice(sorted(self.stops))
        else:
            token = self.rng.randrange(MODEL["vocab_size"])
        self.logprobs.append(_logprob(len(self.output_ids), version))
        self.output_ids.append(token)
        if token in self.stops:
            self.finish, self.done = {"type": "stop", "matched": token}, True
        elif len(self.output_ids) >= self.budget:
            self.done = True

    def answer(self, want_routing: bool, version: str) -> dict:
        from sglang.srt.utils.weight_versions import add_weight_versions_to_meta_info, compute_weight_version_spans

        tokens = self.output_ids
        meta = {"id": self.rid, "finish_reason": self.finish, "prompt_tokens": len(self.prompt),
                "completion_tokens": len(tokens), "num_retractions": self.retractions, "cached_tokens": self.cached,
                "output_token_logprobs": [(lp, t, None) for lp, t in zip(self.logprobs, tokens)]}
        spans = compute_weight_version_spans(self.weight_version_events, current_version=version,
                                             num_output_tokens=len(tokens))
        add_weight_versions_to_meta_info(meta, spans, len(tokens))
        rows, origins = _routed_experts(self, meta["weight_versions"])
        with LOCK:
            if tokens:  # what SGLang's radix cache keeps of a finished request
                CACHE.insert(tuple(self.prompt + tokens[:-1]), rows, origins)
            _record({"call": "request", "rid": self.rid, "prompt_len": len(self.prompt), "start": self.routing_start,
                     "cached_tokens": self.cached, "output_len": len(tokens), "versions": meta["weight_versions"],
                     "retractions": self.retractions, "space_retractions": self.space_retractions,
                     "prefills": self.prefills, "reported": _segments(origins[self.routing_start:], self.routing_start)},
                    keep=False)
        if want_routing and ARGS.enable_return_routed_experts:  # without the flag SGLang silently omits it
            meta["routed_experts"] = base64.b64encode(rows[self.routing_start:].tobytes()).decode()
        return {"output_ids": tokens, "meta_info": meta}


LIVE: set = set()  # requests decoding (or paused), for the version rule


class Scheduler:
    """One queue, admission by the KV pool's tokens, one decoding step for every running request."""

    def __init__(self) -> None:
        self.waiting: list[tuple[Request, asyncio.Event]] = []
        self.running: list[tuple[Request, asyncio.Event]] = []
        self.capacity = CONTROLS.standin_kv_tokens
        self.used = 0  # KV tokens held by the running requests
        self.steps = 0
        self.kv_sum = self.running_sum = 0.0  # sums over decoding steps, for the averages
        self.trace: list[tuple[float, float, bool]] = []  # per step: time, KV pool use, a request waiting
        self.last_arrival = 0.0
        self.task: asyncio.Task | None = None

    @staticmethod
    def _tokens(request: Request) -> int:
        """What admission reserves for a request: its true length, or SGLang's estimate of it."""
        if CONTROLS.standin_new_token_ratio:
            return len(request.prompt) + max(len(request.output_ids) + 1,
                                             math.ceil(CONTROLS.standin_new_token_ratio * request.max_new_tokens))
        return len(request.prompt) + request.budget

    def _retract_for_space(self) -> None:
        """Before a decoding step: while the running requests' next tokens overflow the pool,
        retract in SGLang's order (``ScheduleBatch._get_decode_retraction_order``)."""
        if not (CONTROLS.standin_new_token_ratio and self.capacity):
            return
        self.running.sort(key=lambda item: (len(item[0].output_ids), -len(item[0].prompt)), reverse=True)
        while len(self.running) > 1 and sum(len(r.prompt) + len(r.output_ids) + 1 for r, _ in self.running) > self.capacity:
            request, event = self.running.pop()
            request.retractions += 1
            request.space_retractions += 1
            STATE["space_retractions"] += 1
            self.waiting.insert(0, (request, event))
        self.used = sum(self._tokens(r) for r, _ in self.running)

    async def run(self, requests: list[Request]) -> None:
        """Queue ``requests`` and return when every one is finished."""
        events = [asyncio.Event() for _ in requests]
        with LOCK:
            LIVE.update(requests)
            self.waiting += list(zip(requests, events))
            self.last_arrival = time.monotonic()
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._loop())
        try:
            for event in events:
                await event.wait()
        finally:
            with LOCK:
                LIVE.difference_update(requests)

    def _admit(self) -> None:
        while self.waiting:
            request, event = self.waiting[0]
            need = self._tokens(request)
            if self.capacity and self.running and self.used + need > self.capacity:
                return
            self.waiting.pop(0)
            self.running.append((request, event))
            self.used += need
            request.prefill(STATE["version"])  # its first, or again after a retraction for space

    async def _loop(self) -> None:
        while True:
            if STATE["paused"] or not (self.running or self.waiting):
                await asyncio.sleep(0.005)  # SGLang holds new requests and stops decoding while paused
                continue
            self._admit()
            self._retract_for_space()
            _forward_pass()
            with LOCK:  # one decoding step of every running request, under one version
                for request, _ in self.running:
                    if request.reprefill:  # retracted by a pause: prefilled again with the weights of now
                        request.reprefill = False
                        request.prefill(STATE["version"])
                    request.step(STATE["version"])
                    STATE["tokens"] += 0 if str(request.rid).startswith("HEALTH_CHECK") else 1
                self.steps += 1
                self.kv_sum += self.used / self.capacity if self.capacity else 0.0
                self.running_sum += len(self.running)
                self.trace.append((time.monotonic(), self.used / self.capacity if self.capacity else 0.0,
                                   bool(self.waiting)))
            for request, event in [item for item in self.running if item[0].done]:
                self.running.remove((request, event))
                event.set()
            self.used = sum(self._tokens(r) for r, _ in self.running)
            delay = CONTROLS.standin_token_delay + CONTROLS.standin_seq_delay * len(self.running)
            await asyncio.sleep(delay)

    def stats(self) -> dict:
        """Averages over decoding steps; ``supplied_kv_use`` over the steps during which the client
        still had requests to send or a request waited (before the run's drain, which no client
        can fill)."""
        steps = max(1, self.steps)
        supplied = [use for t, use, waiting in self.trace if waiting or t <= self.last_arrival]
        return {"kv_capacity_tokens": self.capacity, "mean_kv_use": self.kv_sum / steps,
                "mean_running": self.running_sum / steps, "steps": self.steps,
                "supplied_kv_use": sum(supplied) / max(1, len(supplied)), "supplied_steps": len(supplied)}


SCHEDULER = Scheduler()


def _forward_pass() -> None:
    """A forward pass reads the weights and writes the KV cache: on released memory (the pages
    unmapped by the memory saver) the real server dies of an illegal memory access."""
    if ARGS.enable_memory_saver and STATE["released"]:
        print(f"stand-in: forward pass with {STATE['released']} released: illegal memory access, server "
              "exits", flush=True)
        os._exit(1)


class TokenizerManager:
    """What SGLang's HTTP routes call; weight and memory calls go to every TP rank."""

    gracefully_exit = False
    is_generation = True

    def __init__(self, ranks: Ranks, server_args) -> None:
        from sglang.srt.managers.tokenizer_manager import ServerStatus

        self.ranks = ranks
        self.server_args = server_args  # what /server_info reports
        self.startup_time = time.time()
        self.server_status = ServerStatus.Up
        self.last_receive_tstamp = 0.0  # the health route waits for an answer newer than its start
        self.rid_to_state: dict = {}

    def is_ready(self) -> bool:
        return True

    async def get_internal_state(self):
        """A round trip through every rank, as SGLang's asks its schedulers (a stopped rank
        never answers)."""
        versions = await asyncio.to_thread(self.ranks.call, "version")
        return [{"weight_version": versions[0], "effective_max_running_requests_per_dp": self.server_args.max_running_requests
                 or 4096, "memory_usage": {"token_capacity": CONTROLS.standin_kv_tokens or None}}]

    async def _all(self, method: str, obj, log: dict | None = None):
        with LOCK:
            _record({"call": method, **(log or {})})
        return await asyncio.to_thread(self.ranks.merged, method, obj)

    async def begin_weight_update(self, obj, request=None):
        return await self._all("begin_weight_update", obj)

    async def end_weight_update(self, obj, request=None):
        return await self._all("end_weight_update", obj)

    async def _update(self, method: str, obj, log: dict):
        """A weight update; a changed version is recorded on every live request with output
        (SGLang's scheduler does this after the update, ``record_weight_version_change``)."""
        from sglang.srt.utils.weight_versions import record_weight_version_events

        old = STATE["version"]
        result = await self._all(method, obj, log)
        new = (await asyncio.to_thread(self.ranks.call, "version"))[0]
        if new != old:
            with LOCK:
                record_weight_version_events(list(LIVE), old_version=old)
                STATE["version"] = new
                CACHE.clear()  # no KV of the old weights is reused
        return result

    async def update_weights_from_tensor(self, obj, request=None):
        return await self._update("update_weights_from_tensor", obj,
                                  {"load_format": obj.load_format, "entries": len(obj.serialized_named_tensors),
                                   "version": obj.weight_version, "flush_cache": obj.flush_cache})

    async def update_weights_from_distributed(self, obj, request=None):
        return await self._update("update_weights_from_distributed", obj,
                                  {"tensors": len(obj.names), "version": obj.weight_version,
                                   "load_format": obj.load_format, "dtypes": sorted(set(obj.dtypes)),
                                   "scales": sum(name.endswith("_scale_inv") for name in obj.names)})

    async def init_weights_update_group(self, obj, request=None):
        return await self._all("init_weights_update_group", obj, {"rank_offset": obj.rank_offset,
                                                                   "world_size": obj.world_size,
                                                                   "master_address": obj.master_address})

    async def destroy_weights_update_group(self, obj, request=None):
        return await self._all("destroy_weights_update_group", obj, {"group_name": obj.group_name})

    async def _memory(self, method: str, obj) -> None:
        with LOCK:  # SGLang's idle check: requests retracted by a pause wait; any other is running
            running = bool(LIVE) and not (STATE["paused"] and STATE["pause_mode"] == "retract")
        await asyncio.to_thread(self.ranks.call, "set_running", running)
        await self._all(method, obj, {"tags": obj.tags})
        released = (await asyncio.to_thread(self.ranks.call, "offload_tags"))[0]
        with LOCK:
            STATE["released"] = released

    async def release_memory_occupation(self, obj, request=None):
        await self._memory("release_memory_occupation", obj)
        with LOCK:
            STATE["releases"] += 1
            dies = STATE["releases"] == CONTROLS.standin_die_after_release and _once("died")
        if dies:  # the colocated trainer holds the devices now: the process dies under it
            threading.Timer(CONTROLS.standin_die_delay, os._exit, args=(1,)).start()

    async def resume_memory_occupation(self, obj, request=None):
        await self._memory("resume_memory_occupation", obj)

    async def pause_generation(self, obj):
        with LOCK:
            _record({"call": "pause_generation", "mode": obj.mode})
            STATE["paused"], STATE["pause_mode"] = True, obj.mode
            if obj.mode == "retract":  # SGLang retracts the running batch (retract_all → reset_for_retract),
                for request, _ in SCHEDULER.running:  # the request in chunked prefill too
                    request.retractions += 1
                    request.reprefill = True

    async def continue_generation(self, obj):
        with LOCK:
            _record({"call": "continue_generation"})
            STATE["paused"], STATE["pause_mode"] = False, None

    async def flush_cache(self, timeout_s=None):
        from sglang.srt.managers.io_struct import FlushCacheReqOutput

        with LOCK:
            _record({"call": "flush_cache"})
            CACHE.clear()
        return FlushCacheReqOutput(success=True)

    def abort_request(self, **kwargs) -> None:
        pass

    def create_abort_task(self, obj):
        return None

    def generate_request(self, obj, request=None):
        async def answer():
            health = str(obj.rid).startswith("HEALTH_CHECK")  # SGLang's /health generates too: not counted
            with LOCK:
                STATE["generate_calls"] += 0 if health else 1
                calls = STATE["generate_calls"]
                _record({"call": "generate", "health": health, "released": list(STATE["released"])}, keep=False)
            if not health and CONTROLS.standin_die_after and calls >= CONTROLS.standin_die_after and _once("died"):
                os._exit(1)  # mid-batch: the requests in flight get no answer
            batch = isinstance(obj.rid, list)
            rids = obj.rid if batch else [obj.rid]
            prompts = obj.input_ids if batch else [obj.input_ids]
            params = obj.sampling_params if batch else [obj.sampling_params]
            requests = [Request(r, p, s or {}) for r, p, s in zip(rids, prompts, params)]
            for request in requests:  # one per body, as SGLang's io_struct splits it
                request.routing_start = obj.routed_experts_start_len or 0
            await SCHEDULER.run(requests)
            outs = [r.answer(obj.return_routed_experts, STATE["version"]) for r in requests]
            self.last_receive_tstamp = time.time()
            yield outs if batch else outs[0]

        return answer()


def _dropping_one_generate(app):
    """The app, but the N-th ``POST /generate`` has its connection closed once its body is read,
    with no answer (what a client sees when the server closes a keep-alive connection it sends on)."""

    async def dropping(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/generate":
            with LOCK:
                STATE["generate_posts"] += 1
                drop = STATE["generate_posts"] == CONTROLS.standin_drop_generate and _once("dropped")
                if drop:
                    _record({"call": "dropped_generate"})
            if drop:
                await receive()
                send.__self__.transport.close()  # uvicorn's request cycle: its connection
                return
        await app(scope, receive, send)

    return dropping


def main() -> None:
    import uvicorn
    from sglang.srt.entrypoints import http_server

    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    from sglang.srt.entrypoints.engine import _server_args_for_logging

    server_args = ServerArgs.from_cli_args(ARGS)
    print(f"server_args={_server_args_for_logging(server_args)}", flush=True)  # as SGLang logs them at start
    _record({"call": "start", "model_path": server_args.model_path, "quantization": server_args.quantization})
    publish(server_args, role="tokenizer")  # as SGLang's tokenizer process does
    ranks = Ranks(ARGS.tp_size, ARGS.model_path)
    STATE["version"] = ranks.call("version")[0]
    http_server.set_global_state(http_server._GlobalState(tokenizer_manager=TokenizerManager(ranks, server_args),
                                                          template_manager=None, scheduler_info={}))
    if ARGS.api_key or ARGS.admin_api_key:  # as SGLang's launcher does (single tokenizer worker)
        from sglang.srt.utils.auth import add_api_key_middleware

        add_api_key_middleware(http_server.app, api_key=ARGS.api_key, admin_api_key=ARGS.admin_api_key)

    if ARGS.enable_metrics:  # SGLang's Prometheus exposition; the one counter the client reads
        from fastapi.responses import PlainTextResponse

        @http_server.app.get("/metrics")
        async def metrics():
            with LOCK:
                retracted = STATE["space_retractions"]
            return PlainTextResponse("# TYPE sglang:num_retracted_requests_total counter\n"
                                     f'sglang:num_retracted_requests_total{{model_name="standin",tp_rank="0"}} '
                                     f"{float(retracted)}\n"
                                     f'sglang:num_retracted_requests_created{{model_name="standin",tp_rank="0"}} '
                                     f"{time.time()}\n")

    @http_server.app.get("/standin/running")
    async def standin_running():  # ours: each running request's id, output tokens so far and tokens left
        with LOCK:
            return [{"rid": request.rid, "output": len(request.output_ids),
                     "left": request.budget - len(request.output_ids)} for request, _ in SCHEDULER.running]

    @http_server.app.get("/standin/state")
    async def standin_state():  # ours: what the ranks hold, and the calls received
        fingerprints, versions, origins = ranks.call("fingerprints"), ranks.call("version"), ranks.call("origins")
        with LOCK:
            return {"fingerprints": fingerprints, "versions": versions, "origins": origins,
                    "calls": list(STATE["calls"]), "tokens": STATE["tokens"], "paused": STATE["paused"],
                    "released": list(STATE["released"]), "scheduler": SCHEDULER.stats(),
                    "generate_calls": STATE["generate_calls"], "generate_posts": STATE["generate_posts"],
                    "args": {"memory_saver": ARGS.enable_memory_saver, "tp_size": ARGS.tp_size}}

    print(f"sglang stand-in on {ARGS.host}:{ARGS.port}, tp {ARGS.tp_size}, model {ARGS.model_path}", flush=True)
    uvicorn.run(_dropping_one_generate(http_server.app) if CONTROLS.standin_drop_generate else http_server.app, host=ARGS.host, port=ARGS.port, lifespan="off", log_level="warning")


if __name__ == "__main__":
    main()
