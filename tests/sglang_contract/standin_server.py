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
token boundary when paused (SGLang retracts at a scheduler step), and that the routed experts are
random (under ``retract`` SGLang re-prefills the prefix with the new weights).

Test controls (``--standin-*``, removed before SGLang parses the rest): ``--standin-die-after N``
exits on the N-th ``/generate`` (once per ``--standin-marker-dir``); ``--standin-token-delay S``
sleeps S seconds after each decoding step (a generation long enough to be paused).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
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
    controls.add_argument("--standin-marker-dir", default="")
    controls.add_argument("--standin-token-delay", type=float, default=0.0)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)  # SGLang's own flags: ours must be among them
    args = parser.parse_args(theirs)
    args.device = "cpu"  # the stand-in's ranks compute nothing on a device
    return args, controls.parse_args(ours)


ARGS, CONTROLS = _parse()
MODEL = json.loads((Path(ARGS.model_path) / "config.json").read_text())
LOCK = threading.Lock()
STATE = {"generate_calls": 0, "calls": [], "paused": False, "tokens": 0}


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
        from standin_rank import rank_main

        ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self.pipes, self.processes = [], []
        for rank in range(tp_size):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=rank_main, args=(rank, model_dir, theirs), daemon=True)
            process.start()
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


def _routed_experts(rows: int, rng: random.Random) -> str:
    experts = MODEL.get("num_experts") or MODEL["num_local_experts"]  # transformers 5 writes the latter
    layers, topk = MODEL["num_hidden_layers"], MODEL["num_experts_per_tok"]
    dense = set(MODEL.get("mlp_only_layers") or [])
    out = np.zeros((rows, layers, topk), dtype=np.int32)
    for layer in range(layers):
        if layer not in dense:
            for row in range(rows):
                out[row, layer] = rng.sample(range(experts), topk)
    return base64.b64encode(out.tobytes()).decode()


def _version_number(version: str) -> int:
    return 0 if version == "default" else int(version)


def _logprob(position: int, version: str) -> float:
    return -0.1 * (position + 1) - 0.01 * _version_number(version)


class Request:
    """One request decoding: what SGLang's ``Req`` holds that the version rule reads."""

    def __init__(self, rid: str, prompt: list[int], params: dict) -> None:
        seed = params.get("sampling_seed")
        self.rid, self.prompt = rid, prompt
        self.rng = random.Random(seed if seed is not None else rid)
        self.budget = min(params.get("max_new_tokens") or 16, 3 + self.rng.randrange(5))
        self.stops = set(params.get("stop_token_ids") or [])
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.weight_version_events: list = []  # SGLang's WeightVersionEvent, appended by its own rule
        self.finish = {"type": "length", "length": self.budget}
        self.done = False

    def step(self, version: str) -> None:
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
                "completion_tokens": len(tokens),
                "output_token_logprobs": [(lp, t, None) for lp, t in zip(self.logprobs, tokens)]}
        spans = compute_weight_version_spans(self.weight_version_events, current_version=version,
                                             num_output_tokens=len(tokens))
        add_weight_versions_to_meta_info(meta, spans, len(tokens))
        if want_routing and ARGS.enable_return_routed_experts:  # without the flag SGLang silently omits it
            meta["routed_experts"] = _routed_experts(len(self.prompt) + len(tokens) - 1, self.rng)
        return {"output_ids": tokens, "meta_info": meta}


LIVE: set = set()  # requests decoding (or paused), for the version rule


class TokenizerManager:
    """What SGLang's HTTP routes call; weight and memory calls go to every TP rank."""

    gracefully_exit = False
    is_generation = True

    def __init__(self, ranks: Ranks) -> None:
        from sglang.srt.managers.tokenizer_manager import ServerStatus

        self.ranks = ranks
        self.server_status = ServerStatus.Up
        self.last_receive_tstamp = 0.0  # the health route waits for an answer newer than its start
        self.rid_to_state: dict = {}

    def is_ready(self) -> bool:
        return True

    async def _all(self, method: str, obj, log: dict | None = None):
        with LOCK:
            STATE["calls"].append({"call": method, **(log or {})})
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
        return result

    async def update_weights_from_tensor(self, obj, request=None):
        return await self._update("update_weights_from_tensor", obj,
                                  {"load_format": obj.load_format, "entries": len(obj.serialized_named_tensors),
                                   "version": obj.weight_version, "flush_cache": obj.flush_cache})

    async def update_weights_from_distributed(self, obj, request=None):
        return await self._update("update_weights_from_distributed", obj,
                                  {"tensors": len(obj.names), "version": obj.weight_version})

    async def init_weights_update_group(self, obj, request=None):
        return await self._all("init_weights_update_group", obj, {"rank_offset": obj.rank_offset,
                                                                   "world_size": obj.world_size})

    async def destroy_weights_update_group(self, obj, request=None):
        return await self._all("destroy_weights_update_group", obj, {"group_name": obj.group_name})

    async def release_memory_occupation(self, obj, request=None):
        await self._all("release_memory_occupation", obj, {"tags": obj.tags})

    async def resume_memory_occupation(self, obj, request=None):
        await self._all("resume_memory_occupation", obj, {"tags": obj.tags})

    async def pause_generation(self, obj):
        with LOCK:
            STATE["calls"].append({"call": "pause_generation", "mode": obj.mode})
            STATE["paused"] = True

    async def continue_generation(self, obj):
        with LOCK:
            STATE["calls"].append({"call": "continue_generation"})
            STATE["paused"] = False

    async def flush_cache(self, timeout_s=None):
        from sglang.srt.managers.io_struct import FlushCacheReqOutput

        with LOCK:
            STATE["calls"].append({"call": "flush_cache"})
        return FlushCacheReqOutput(success=True)

    def abort_request(self, **kwargs) -> None:
        pass

    def create_abort_task(self, obj):
        return None

    def generate_request(self, obj, request=None):
        async def answer():
            health = str(obj.rid).startswith("HEALTH_CHECK")  # SGLang's /health generates too: not counted
            while STATE["paused"] and not health:  # SGLang holds new requests while paused
                await asyncio.sleep(0.01)
            with LOCK:
                STATE["generate_calls"] += 0 if health else 1
                calls = STATE["generate_calls"]
            if not health and CONTROLS.standin_die_after and calls >= CONTROLS.standin_die_after and _once("died"):
                os._exit(1)  # mid-batch: the requests in flight get no answer
            batch = isinstance(obj.rid, list)
            rids = obj.rid if batch else [obj.rid]
            prompts = obj.input_ids if batch else [obj.input_ids]
            params = obj.sampling_params if batch else [obj.sampling_params]
            requests = [Request(r, p, s or {}) for r, p, s in zip(rids, prompts, params)]
            with LOCK:
                LIVE.update(requests)
            try:
                while not all(r.done for r in requests):
                    while STATE["paused"]:  # retracted or held in place: decoding resumes on continue
                        await asyncio.sleep(0.01)
                    with LOCK:  # one decoding step of every unfinished request, under one version
                        for r in requests:
                            if not r.done:
                                r.step(STATE["version"])
                                STATE["tokens"] += 0 if health else 1
                    if CONTROLS.standin_token_delay:
                        await asyncio.sleep(CONTROLS.standin_token_delay)
            finally:
                with LOCK:
                    LIVE.difference_update(requests)
            outs = [r.answer(obj.return_routed_experts, STATE["version"]) for r in requests]
            self.last_receive_tstamp = time.time()
            yield outs if batch else outs[0]

        return answer()


def main() -> None:
    import uvicorn
    from sglang.srt.entrypoints import http_server

    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs.from_cli_args(ARGS), role="tokenizer")  # as SGLang's tokenizer process does
    ranks = Ranks(ARGS.tp_size, ARGS.model_path)
    STATE["version"] = ranks.call("version")[0]
    http_server.set_global_state(http_server._GlobalState(tokenizer_manager=TokenizerManager(ranks),
                                                          template_manager=None, scheduler_info={}))

    @http_server.app.get("/standin/state")
    async def standin_state():  # ours: what the ranks hold, and the calls received
        fingerprints, versions, origins = ranks.call("fingerprints"), ranks.call("version"), ranks.call("origins")
        with LOCK:
            return {"fingerprints": fingerprints, "versions": versions, "origins": origins,
                    "calls": list(STATE["calls"]), "tokens": STATE["tokens"], "paused": STATE["paused"],
                    "args": {"memory_saver": ARGS.enable_memory_saver, "tp_size": ARGS.tp_size}}

    print(f"sglang stand-in on {ARGS.host}:{ARGS.port}, tp {ARGS.tp_size}, model {ARGS.model_path}", flush=True)
    uvicorn.run(http_server.app, host=ARGS.host, port=ARGS.port, lifespan="off", log_level="warning")


if __name__ == "__main__":
    main()
