"""A stand-in for ``python -m sglang.launch_server`` (SGLang needs CUDA, the tests run on CPU).

It speaks SGLang's native HTTP protocol with SGLang's field names and encodings, generates
deterministic fake tokens, joins weight-update groups over gloo, and can be told to die or stall
so the engine client's recovery paths can be exercised.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import pickle
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--mem-fraction-static", type=float)
    # test controls
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--die-after", type=int, default=0, help="exit on the N-th /generate (once per marker)")
    p.add_argument("--stall-rid", default="", help="first request holding this rid never answers")
    p.add_argument("--marker-dir", default="")
    p.add_argument("--log-requests", default="", help="append every /generate rid list here")
    return p.parse_args()


ARGS = parse_args()
STATE = {"generate_calls": 0, "paused": False, "weights": {}, "group": None}
LOCK = threading.Lock()


def once(name: str) -> bool:
    """True the first time ``name`` is asked for across restarts of this server."""
    path = os.path.join(ARGS.marker_dir, name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL)
        os.close(fd)
        return True
    except FileExistsError:
        return False


def fake_generation(rid: str, prompt: list[int], params: dict) -> dict:
    seed = params.get("sampling_seed")
    rng = random.Random(seed if seed is not None else rid)
    budget = min(params.get("max_new_tokens", 16), 3 + rng.randrange(5))
    stops = set(params.get("stop_token_ids") or [])
    tokens, finish = [], {"type": "length", "length": budget}
    for _ in range(budget):
        token = rng.randrange(100)
        tokens.append(token)
        if token in stops:
            finish = {"type": "stop", "matched": token}
            break
    triples = [[-0.1 * (i + 1), t, None] for i, t in enumerate(tokens)]
    meta = {"id": rid, "finish_reason": finish, "output_token_logprobs": triples,
            "prompt_tokens": len(prompt), "completion_tokens": len(tokens)}
    if ARGS.enable_return_routed_experts:
        rows = len(prompt) + len(tokens) - 1
        pos = np.arange(rows)[:, None, None]
        layer = np.arange(ARGS.layers)[None, :, None]
        k = np.arange(ARGS.topk)[None, None, :]
        experts = ((pos + layer + k) % ARGS.experts).astype(np.int32)
        meta["routed_experts"] = base64.b64encode(experts.tobytes()).decode()
    return {"output_ids": tokens, "meta_info": meta}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet
        pass

    def _reply(self, code: int, body=None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length", 0))
        return json.loads(self.rfile.read(length) or b"{}")

    def do_GET(self) -> None:
        if self.path in ("/health", "/health_generate"):
            return self._reply(200)
        if self.path == "/debug/weights":
            blob = base64.b64encode(pickle.dumps(STATE["weights"])).decode()
            return self._reply(200, {"weights": blob})
        return self._reply(404, {"error": self.path})

    def do_POST(self) -> None:
        body = self._body()
        route = getattr(self, "post_" + self.path.strip("/"), None)
        if route is None:
            return self._reply(404, {"error": self.path})
        return route(body)

    def post_generate(self, body: dict) -> None:
        with LOCK:
            STATE["generate_calls"] += 1
            calls = STATE["generate_calls"]
        if ARGS.log_requests:
            with open(ARGS.log_requests, "a") as log:
                log.write(json.dumps(body["rid"]) + "\n")
        if ARGS.die_after and calls >= ARGS.die_after and once("died"):
            os._exit(1)  # mid-batch: no answer for the requests in flight
        if ARGS.stall_rid and ARGS.stall_rid in body["rid"] and once("stalled"):
            time.sleep(60)
        answers = [fake_generation(rid, prompt, params)
                   for rid, prompt, params in zip(body["rid"], body["input_ids"], body["sampling_params"])]
        return self._reply(200, answers)

    def post_pause_generation(self, body: dict) -> None:
        STATE["paused"] = True
        return self._reply(200, {"success": True})

    def post_continue_generation(self, body: dict) -> None:
        STATE["paused"] = False
        return self._reply(200, {"success": True})

    def post_flush_cache(self, body: dict) -> None:
        return self._reply(200, {"success": True})

    def post_init_weights_update_group(self, body: dict) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore(body["master_address"], body["master_port"], body["world_size"],
                              is_master=False, timeout=timeout)
        STATE["group"] = dist.ProcessGroupGloo(store, body["rank_offset"], body["world_size"], timeout)
        return self._reply(200, {"success": True, "message": "ok"})

    def post_update_weights_from_distributed(self, body: dict) -> None:
        import torch

        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            STATE["group"].broadcast(tensor, 0).wait()
            STATE["weights"][name] = tensor
        return self._reply(200, {"success": True, "message": "ok"})

    def post_update_weights_from_tensor(self, body: dict) -> None:
        named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
        STATE["weights"].update(named)
        return self._reply(200, {"success": True, "message": "ok"})


if __name__ == "__main__":
    print(f"fake sglang server on {ARGS.host}:{ARGS.port} model={ARGS.model_path}", flush=True)
    ThreadingHTTPServer((ARGS.host, ARGS.port), Handler).serve_forever()
    sys.exit(0)
