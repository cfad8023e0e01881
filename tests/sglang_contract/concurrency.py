"""How full an SGLang server's KV pool stays under the client's one request per sample
(``rollout.sglang.max_inflight``), against the SGLang stand-in beside this file (SGLang 0.5.23's
own HTTP server code; needs ``bash tools/setup.sh --sglang``).

    .venv/bin/python tests/sglang_contract/concurrency.py [--kv-tokens 16384 --prompts 64 ...]

The stand-in starts with a KV pool of ``--kv-tokens`` tokens, response lengths as long-tailed as
RL's (30% at the cap, the rest log-uniform below it), and a decoding step that costs ``--step-ms``
plus ``--seq-us`` per running sequence. It admits a request while the pool holds its prompt and
response and decodes every running request each step, as SGLang's scheduler does in outline; it
reports the pool's use and the running sequences averaged over decoding steps, and the pool's use
while work waits (until the client's last request arrived, or while one queued): the run's final
drain, which no client can fill, left out. (The batched client this was first measured against is
retired; its numbers stay in docs/benchmarks.md.)
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from bpo_megatron.testing import MODEL_CONFIGS

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parent / "standin_server.py"
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


def measure(model_dir: Path, args) -> dict:
    engine = _engine(model_dir, args, args.max_inflight)
    try:
        requests = _requests(args.prompts, args.group, args.max_new_tokens)
        start = time.perf_counter()
        samples = engine.generate(requests)
        seconds = time.perf_counter() - start
        stats = engine.endpoint().get("standin/state", timeout=30)["scheduler"]
    finally:
        engine.shutdown()
    tokens = sum(s.response_tokens.numel() for s in samples)
    return {"samples": len(samples), "tokens": tokens, "seconds": seconds,
            "kv_use": stats["mean_kv_use"], "supplied": stats["supplied_kv_use"], "running": stats["mean_running"],
            "steps": stats["steps"]}


def table(row: dict, args) -> str:
    return "\n".join([
        f"SGLang stand-in, KV pool {args.kv_tokens} tokens, {args.prompts} prompts × {args.group} samples, "
        f"responses ≤ {args.max_new_tokens} tokens (30% at the cap, log-uniform below), "
        f"step {args.step_ms} ms + {args.seq_us} µs per running sequence",
        "| client | KV pool in use while work waits | KV pool in use, whole run | sequences running (mean) | "
        "decoding steps | wall s | response tokens/s |", "|---|---|---|---|---|---|---|",
        f"| one request per sample, max_inflight {args.max_inflight} | {row['supplied']:.3f} | {row['kv_use']:.3f} | "
        f"{row['running']:.1f} | {row['steps']} | {row['seconds']:.2f} | {row['tokens'] / row['seconds']:.0f} |"])


def run(args) -> dict:
    from bpo_megatron.testing.models import random_checkpoint

    if not SGLANG_PYTHON.exists():
        raise SystemExit("this measurement needs SGLang's environment: bash tools/setup.sh --sglang")
    with tempfile.TemporaryDirectory() as work:
        config = {**json.loads(FIXTURE.read_text()), "num_hidden_layers": 2}
        (Path(work) / "config.json").write_text(json.dumps(config))
        model_dir = random_checkpoint(Path(work) / "config.json", Path(work) / "model", seed=0)
        return measure(model_dir, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-tokens", type=int, default=16384)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--seq-us", type=float, default=20.0)
    parser.add_argument("--max-inflight", type=int, default=512)
    args = parser.parse_args(argv)
    print(table(run(args), args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
