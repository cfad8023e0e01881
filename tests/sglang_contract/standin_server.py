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

Test controls (``--standin-*``, removed before SGLang parses the rest): ``--standin-die-after N``
exits on the N-th ``/generate`` (once per ``--standin-marker-dir``).
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
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)  # SGLang's own flags: ours must be among them
    args = parser.parse_args(theirs)
    args.device = "cpu"  # the stand-in's ranks compute nothing on a device
    return args, controls.parse_args(ours)


ARGS, CONTROLS = _parse()
MODEL = json.loads((Path(ARGS.model_path) / "config.json").read_text())
LOCK = threading.Lock()
STATE = {"generate_calls": 0, "calls": [], "paused": False}


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


def _generation(rid: str, prompt: list[int], params: dict, want_routing: bool, version: str) -> dict:
    seed = params.get("sampling_seed")
    rng = random.Random(seed if seed is not None else rid)
    budget = min(params.get("max_new_tokens") or 16, 3 + rng.randrange(5))
    stops = set(params.get("stop_token_ids") or [])
    tokens, finish = [], {"type": "length", "length": budget}
    for _ in range(budget):
        token = rng.randrange(MODEL["vocab_size"])
        tokens.append(token)
        if token in stops:
            finish = {"type": "stop", "matched": token}
            break
    meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt), "completion_tokens": len(tokens),
            "output_token_logprobs": [(-0.1 * (i + 1), t, None) for i, t in enumerate(tokens)],
            "weight_version": version}
    if want_routing and ARGS.enable_return_routed_experts:  # without the flag SGLang silently omits it
        meta["routed_experts"] = _routed_experts(len(prompt) + len(tokens) - 1, rng)
    return {"output_ids": tokens, "meta_info": meta}


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

    async def update_weights_from_tensor(self, obj, request=None):
        return await self._all("update_weights_from_tensor", obj,
                               {"load_format": obj.load_format, "entries": len(obj.serialized_named_tensors),
                                "version": obj.weight_version, "flush_cache": obj.flush_cache})

    async def update_weights_from_distributed(self, obj, request=None):
        return await self._all("update_weights_from_distributed", obj,
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
            with LOCK:
                STATE["generate_calls"] += 0 if health else 1
                calls = STATE["generate_calls"]
            if not health and CONTROLS.standin_die_after and calls >= CONTROLS.standin_die_after and _once("died"):
                os._exit(1)  # mid-batch: the requests in flight get no answer
            version = (await asyncio.to_thread(self.ranks.call, "version"))[0]
            batch = isinstance(obj.rid, list)
            rids = obj.rid if batch else [obj.rid]
            prompts = obj.input_ids if batch else [obj.input_ids]
            params = obj.sampling_params if batch else [obj.sampling_params]
            outs = [_generation(r, p, s or {}, obj.return_routed_experts, version)
                    for r, p, s in zip(rids, prompts, params)]
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
    http_server.set_global_state(http_server._GlobalState(tokenizer_manager=TokenizerManager(ranks),
                                                          template_manager=None, scheduler_info={}))

    @http_server.app.get("/standin/state")
    async def standin_state():  # ours: what the ranks hold, and the calls received
        fingerprints, versions, origins = ranks.call("fingerprints"), ranks.call("version"), ranks.call("origins")
        with LOCK:
            return {"fingerprints": fingerprints, "versions": versions, "origins": origins,
                    "calls": list(STATE["calls"]),
                    "args": {"memory_saver": ARGS.enable_memory_saver, "tp_size": ARGS.tp_size}}

    print(f"sglang stand-in on {ARGS.host}:{ARGS.port}, tp {ARGS.tp_size}, model {ARGS.model_path}", flush=True)
    uvicorn.run(http_server.app, host=ARGS.host, port=ARGS.port, lifespan="off", log_level="warning")


if __name__ == "__main__":
    main()
