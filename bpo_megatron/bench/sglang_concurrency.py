"""Benchmark: how full an SGLang server's KV pool stays under the old chunked client (batched posts
of ``requests_per_post`` requests, ``concurrent_posts`` at a time) and under the one-request-per-
sample client (``rollout.sglang.max_inflight``), side by side in one run.

Both run against the SGLang stand-in of ``tests/sglang_contract`` (SGLang 0.5.23's own HTTP
server code; needs ``bash tools/setup.sh --sglang``), started fresh for each client with a KV
pool of ``--kv-tokens`` tokens, response lengths as long-tailed as RL's (30% at the cap, the rest
log-uniform below it), and a decoding step that costs ``--step-ms`` plus ``--seq-us`` per running
sequence. The stand-in admits a request while the pool holds its prompt and response and decodes
every running request each step, as SGLang's scheduler does in outline; it reports the pool's use
and the running sequences averaged over decoding steps, and the pool's use while work waits (until
the client's last request arrived, or while one queued): the run's final drain, which no client
can fill, left out. A batched post holds its requests' slots until its longest answer: the pool
empties while a few long answers finish.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from bpo_megatron.testing import MODEL_CONFIGS

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "tests" / "sglang_contract" / "standin_server.py"
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
FIXTURE = MODEL_CONFIGS / "tiny_qwen3_moe" / "config.json"


def _requests(prompts: int, group: int, max_new_tokens: int, seed: int = 0) -> list:
    from bpo_megatron.rollout import GenerationRequest, SamplingParams

    rng = random.Random(seed)
    return [GenerationRequest(f"p{i}", tuple(rng.randrange(1, 200) for _ in range(rng.randrange(8, 33))),
                              SamplingParams(max_new_tokens=max_new_tokens, n=group, seed=1000 + i))
            for i in range(prompts)]


def _engine(model_dir: Path, args, max_inflight: int | None):
    from bpo_megatron.models import HFModelConfig
    from bpo_megatron.models.routing import RoutingLayout
    from bpo_megatron.rollout.sglang import SGLangConfig, SGLangEngine

    cfg = SGLangConfig(model_path=str(model_dir), launcher=(str(SGLANG_PYTHON), str(STANDIN)), tp_size=1,
                       startup_timeout_s=180, request_timeout_s=600, max_inflight=max_inflight,
                       extra_args=("--standin-kv-tokens", str(args.kv_tokens), "--standin-lengths", "longtail",
                                   "--standin-token-delay", str(args.step_ms / 1000),
                                   "--standin-seq-delay", str(args.seq_us / 1e6)))
    return SGLangEngine(cfg, routing=RoutingLayout.of(HFModelConfig.load(model_dir)))


def chunked_generate(engine, requests: list, requests_per_post: int, concurrent_posts: int) -> list:
    """The client before one request per sample: batched posts, a fixed number at a time."""
    from bpo_megatron.rollout.sglang.engine import PAUSE_MODE
    from bpo_megatron.rollout.sglang.http import request_json
    from bpo_megatron.rollout.sglang.protocol import decode_sample, generate_body
    from bpo_megatron.rollout.types import response_slots

    slots = response_slots(requests)
    chunks = [slots[i:i + requests_per_post] for i in range(0, len(slots), requests_per_post)]

    def post(chunk):
        answers = request_json("POST", f"{engine.base_url}/generate", generate_body(chunk, capture_routing=True),
                               timeout=600, api_key=engine.api_key)
        return [decode_sample(slot, answer, routing=engine.routing, pause_mode=PAUSE_MODE)
                for slot, answer in zip(chunk, answers)]

    with ThreadPoolExecutor(concurrent_posts) as pool:
        return [sample for part in pool.map(post, chunks) for sample in part]


def measure(model_dir: Path, args, client: str) -> dict:
    engine = _engine(model_dir, args, args.max_inflight)
    try:
        requests = _requests(args.prompts, args.group, args.max_new_tokens)
        start = time.perf_counter()
        if client == "chunked":
            samples = chunked_generate(engine, requests, args.requests_per_post, args.concurrent_posts)
        else:
            samples = engine.generate(requests)
        seconds = time.perf_counter() - start
        stats = engine.endpoint().get("standin/state", timeout=30)["scheduler"]
    finally:
        engine.shutdown()
    tokens = sum(s.response_tokens.numel() for s in samples)
    return {"client": client, "samples": len(samples), "tokens": tokens, "seconds": seconds,
            "kv_use": stats["mean_kv_use"], "supplied": stats["supplied_kv_use"], "running": stats["mean_running"],
            "steps": stats["steps"]}


def table(rows: list[dict], args) -> str:
    old, new = rows
    lines = [f"SGLang stand-in, KV pool {args.kv_tokens} tokens, {args.prompts} prompts × {args.group} samples, "
             f"responses ≤ {args.max_new_tokens} tokens (30% at the cap, log-uniform below), "
             f"step {args.step_ms} ms + {args.seq_us} µs per running sequence",
             "| client | KV pool in use while work waits | KV pool in use, whole run | sequences running (mean) | "
             "decoding steps | wall s | response tokens/s |", "|---|---|---|---|---|---|---|"]
    names = {"chunked": f"chunked: posts of {args.requests_per_post}, {args.concurrent_posts} at a time",
             "per-sample": f"one request per sample, max_inflight {args.max_inflight}"}
    for row in rows:
        lines.append(f"| {names[row['client']]} | {row['supplied']:.3f} | {row['kv_use']:.3f} | {row['running']:.1f} | "
                     f"{row['steps']} | {row['seconds']:.2f} | {row['tokens'] / row['seconds']:.0f} |")
    lines.append(f"| ratio (one per sample / chunked) | {new['supplied'] / max(old['supplied'], 1e-9):.2f}× | "
                 f"{new['kv_use'] / max(old['kv_use'], 1e-9):.2f}× | "
                 f"{new['running'] / max(old['running'], 1e-9):.2f}× | | {new['seconds'] / old['seconds']:.2f}× | "
                 f"{(new['tokens'] / new['seconds']) / (old['tokens'] / old['seconds']):.2f}× |")
    return "\n".join(lines)


def run(args) -> list[dict]:
    from bpo_megatron.testing.models import random_checkpoint

    if not SGLANG_PYTHON.exists():
        raise SystemExit("this benchmark needs SGLang's environment: bash tools/setup.sh --sglang")
    with tempfile.TemporaryDirectory() as work:
        config = {**json.loads(FIXTURE.read_text()), "num_hidden_layers": 2}
        (Path(work) / "config.json").write_text(json.dumps(config))
        model_dir = random_checkpoint(Path(work) / "config.json", Path(work) / "model", seed=0)
        return [measure(model_dir, args, client) for client in ("chunked", "per-sample")]


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kv-tokens", type=int, default=16384)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--seq-us", type=float, default=20.0)
    parser.add_argument("--requests-per-post", type=int, default=12)  # the 30B recipe's old settings
    parser.add_argument("--concurrent-posts", type=int, default=8)
    parser.add_argument("--max-inflight", type=int, default=512)
    args = parser.parse_args(argv)
    rows = run(args)
    print(table(rows, args))
    return 0
