"""Benchmark: the embedded rollout engine and trainer → engine weight sync, each against a plain
PyTorch reference measured in the same run.

(a) Generation: :class:`~bpo_megatron.rollout.hf.engine.HFEngine` (log μ of every token, with and
    without routed-expert capture) against transformers' own ``model.generate`` sampling the same
    model, batch and settings (temperature, no top-k/top-p, a fixed number of new tokens). Tokens/s
    (median and best of the repeats) and the ratio to ``generate``.
(b) Weight sync at world size 1: the trainer's Megatron model streamed as Hugging Face tensors
    in buckets by its own export (``TrainActor.export_weights``, what a weight sync sends) → an
    ``HFEngine`` in the same process, and over the ``shared_memory`` and ``object_store``
    transports to one in a Ray actor of its own, against the floor for moving the same bytes in one process (``copy_`` of every
    tensor into a preallocated clone). Seconds, bytes/s and the ratio to the copy.

Every measurement runs in a fresh one-thread process (a gloo world of size 1, which the trainer
needs anyway).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.testing.models import random_checkpoint

MiB = 2**20

# Qwen3-MoE shapes. "tiny" is the test kit's tiny_qwen3_moe (bpo_megatron/testing/configs); "bench" is large enough (≈240 MB of
# fp32 weights) that a weight sync takes a measurable time on CPU.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=200, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 num_experts=4, num_experts_per_tok=2, max_position_embeddings=256),
    "bench": dict(vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  num_experts=16, num_experts_per_tok=4, max_position_embeddings=1024),
}


def model_config(size: str):
    """A transformers ``Qwen3MoeConfig`` of one of :data:`MODEL_SIZES` (fp32, untied, no biases)."""
    from transformers import Qwen3MoeConfig

    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(MODEL_SIZES)}")
    return Qwen3MoeConfig(**MODEL_SIZES[size], norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6,
                          tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
                          torch_dtype="float32")


@dataclass(frozen=True)
class BenchConfig:
    prompts: int = 16
    new_tokens: int = 32
    temperature: float = 1.0
    repeats: int = 10
    generation_model: str = "tiny"
    sync_model: str = "bench"
    bucket_mb: int = 64
    seed: int = 0


# ----------------------------------------------------------------------------- (a) generation
GENERATION_METHODS = ("transformers.generate", "hf-engine", "hf-engine+capture")


def _prompts(cfg: BenchConfig, vocab: int) -> list[list[int]]:
    """Prompts of 4–12 tokens: real batches are ragged, so both sides pay for left padding."""
    gen = torch.Generator().manual_seed(cfg.seed)
    lengths = torch.randint(4, 13, (cfg.prompts,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _generate_with_transformers(model, prompts: list[list[int]], cfg: BenchConfig) -> int:
    """Plain sampling with ``model.generate`` (left-padded batch); returns the new tokens made."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    # no end-of-sequence token: every row makes exactly new_tokens tokens, as on the engine side
    settings = GenerationConfig(do_sample=True, temperature=cfg.temperature, top_k=0, top_p=1.0,
                                max_new_tokens=cfg.new_tokens, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=settings)
    return (out.shape[1] - width) * len(prompts)


def _generate_with_engine(engine, prompts: list[list[int]], cfg: BenchConfig, seed: int) -> int:
    from bpo_megatron.rollout import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.new_tokens, seed=seed)
    samples = engine.generate([GenerationRequest(f"p{i}", tuple(p), params) for i, p in enumerate(prompts)])
    return sum(s.response_tokens.numel() for s in samples)


def _generation_rank(cfg: BenchConfig, model_dir: str) -> dict[str, dict]:
    from bpo_megatron.rollout.hf.engine import HFEngine

    plain = HFEngine(model_dir, capture_routing=False)
    captured = HFEngine(model_dir, capture_routing=True)
    prompts = _prompts(cfg, plain.model.config.vocab_size)
    runs = {
        "transformers.generate": lambda seed: _generate_with_transformers(plain.model, prompts, cfg),
        "hf-engine": lambda seed: _generate_with_engine(plain, prompts, cfg, seed),
        "hf-engine+capture": lambda seed: _generate_with_engine(captured, prompts, cfg, seed),
    }
    results: dict[str, dict] = {name: {"seconds": [], "tokens": 0} for name in runs}
    for repeat in range(cfg.repeats + 1):  # the first round warms up
        for name, run_once in runs.items():  # interleaved, so drift in machine load hits all alike
            torch.manual_seed(cfg.seed + repeat)
            start = time.perf_counter()
            tokens = run_once(cfg.seed + repeat)
            elapsed = time.perf_counter() - start
            if repeat:
                results[name]["seconds"].append(elapsed)
                results[name]["tokens"] = tokens
    return results


@dataclass(frozen=True)
class GenerationRow:
    method: str
    tokens: int  # new tokens per run
    median_tokens_per_s: float
    best_tokens_per_s: float


def _generation_rows(raw: dict[str, dict]) -> list[GenerationRow]:
    return [GenerationRow(name, r["tokens"], r["tokens"] / statistics.median(r["seconds"]),
                          r["tokens"] / min(r["seconds"])) for name, r in raw.items()]


# ---------------------------------------------------------------------------- (b) weight sync
SYNC_METHODS = ("copy_ (reference)", "export (views, no engine)", "sync: engine in this process",
                "sync: shared_memory → engine actor", "sync: object_store → engine actor")


class _EngineHost:
    """An embedded engine in a Ray actor of its own, as ``EngineWorker`` holds one."""

    def __init__(self, model_dir: str) -> None:
        from bpo_megatron.rollout.hf.engine import HFEngine

        torch.set_num_threads(1)
        self.engine = HFEngine(model_dir, capture_routing=False)

    def begin_weight_update(self, version: int) -> None:
        self.engine.begin_weight_update(version)

    def update_weights_packed(self, packed) -> int:
        from bpo_megatron.weight_sync.object_store import unpack

        return self.engine.update_weights(unpack(packed))

    def weight_details(self):
        import ray

        return ray.get_runtime_context().get_node_id(), self.engine.weight_details()

    def end_weight_update(self) -> None:
        self.engine.end_weight_update()

    def fingerprints(self) -> dict[str, str]:
        from bpo_megatron.weights.checksums import fingerprints

        return fingerprints(self.engine.named_hf_weights())


def _sync_rank(cfg: BenchConfig, model_dir: str) -> dict:
    import ray

    from bpo_megatron import testing
    from bpo_megatron.rollout.hf.engine import HFEngine
    from bpo_megatron.rollout.hf.shared_memory import SharedMemory
    from bpo_megatron.weight_sync.object_store import ObjectStore
    from bpo_megatron.weight_sync.transport import EngineEndpoint
    from bpo_megatron.weights.buckets import tensor_bytes
    from bpo_megatron.weights.checksums import fingerprints

    actor = testing.build_actor(model_dir, params_dtype="fp32", micro_batch_size=1, weights=model_dir)
    engine = HFEngine(model_dir, capture_routing=False)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="error")
    remote = ray.remote(_EngineHost).options(num_cpus=0).remote(model_dir)
    shared = ray.remote(_EngineHost).options(num_cpus=0).remote(model_dir)
    node, segment = ray.get(shared.weight_details.remote())
    # what the driver hands each transport: the engine's endpoint (see EngineGroup.weight_endpoints)
    shared_endpoints = [EngineEndpoint(index=0, actor=shared, node=node, details=segment)]
    remote_endpoints = [EngineEndpoint(index=0, actor=remote)]
    shared_sender = SharedMemory()
    bucket_bytes = cfg.bucket_mb * MiB
    # what TrainWorker.push_weights streams: the actor's export (its plan built once and reused, as
    # in a training run), views of the parameters where the transport allows them
    exported = lambda **how: actor.export_weights(bucket_bytes, **how)  # noqa: E731

    # The reference moves exactly the bytes a sync sends, between two buffers of one process.
    sources = [(name, tensor.clone()) for bucket in exported(views=True) for name, tensor in bucket]
    targets = [tensor.clone() for _, tensor in sources]
    nbytes = sum(tensor_bytes(t) for _, t in sources)

    def copy() -> None:
        with torch.no_grad():
            for (_, source), target in zip(sources, targets):
                target.copy_(source)

    def export() -> None:
        for _ in exported(views=True):
            pass

    def in_process() -> None:
        engine.begin_weight_update(engine.weight_version + 1)
        for bucket in exported(views=True):
            engine.update_weights(bucket)
        engine.end_weight_update()

    def through(sender, engine, endpoints) -> None:
        ray.get(engine.begin_weight_update.remote(1))
        sender.prepare(endpoints)
        report = sender.send(exported(host=sender.host_tensors, views=sender.views), version=1)
        ray.get(engine.end_weight_update.remote())
        assert not report["failed"]

    runs = dict(zip(SYNC_METHODS, (copy, export, in_process, lambda: through(shared_sender, shared, shared_endpoints),
                                   lambda: through(ObjectStore(), remote, remote_endpoints))))
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(cfg.repeats + 1):
        for name, run_once in runs.items():
            start = time.perf_counter()
            run_once()
            if repeat:
                seconds[name].append(time.perf_counter() - start)
    sent = fingerprints(sources)
    held = [fingerprints(engine.named_hf_weights()), ray.get(remote.fingerprints.remote()),
            ray.get(shared.fingerprints.remote())]
    shared_sender.close()
    ray.shutdown()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return {"seconds": seconds, "bytes": nbytes, "tensors": len(sources),
            "engine_matches": all(sent == {name: h[name] for name in sent} and set(sent) == set(h) for h in held)}


@dataclass(frozen=True)
class SyncRow:
    method: str
    bytes: int
    median_s: float
    best_s: float

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.median_s


def _sync_rows(raw: dict) -> list[SyncRow]:
    return [SyncRow(name, raw["bytes"], statistics.median(s), min(s)) for name, s in raw["seconds"].items()]


# -------------------------------------------------------------------------------- reporting
@dataclass
class BenchResult:
    generation: list[GenerationRow] = field(default_factory=list)
    sync: list[SyncRow] = field(default_factory=list)
    sync_tensors: int = 0
    engine_matches: bool = False


def format_table(result: BenchResult, cfg: BenchConfig) -> str:
    reference = next(r for r in result.generation if r.method == "transformers.generate")
    sizes = MODEL_SIZES[cfg.generation_model]
    lines = [
        f"(a) generation: {cfg.prompts} prompts × {cfg.new_tokens} new tokens, temperature "
        f"{cfg.temperature}, model '{cfg.generation_model}' ({sizes['num_hidden_layers']} layers, "
        f"{sizes['num_experts']} experts, hidden {sizes['hidden_size']}), 1 thread, "
        f"{cfg.repeats} runs after a warm-up",
        "",
        "| method | tokens/s (median) | tokens/s (best) | speed vs transformers.generate (median) |",
        "|---|---:|---:|---:|",
    ]
    for row in result.generation:
        lines.append(f"| {row.method} | {row.median_tokens_per_s:.0f} | {row.best_tokens_per_s:.0f} "
                     f"| {row.median_tokens_per_s / reference.median_tokens_per_s:.2f}× |")
    copy = next(r for r in result.sync if r.method == SYNC_METHODS[0])
    sizes = MODEL_SIZES[cfg.sync_model]
    lines += [
        "",
        f"(b) weight sync, world size 1: model '{cfg.sync_model}' ({sizes['num_hidden_layers']} layers, "
        f"{sizes['num_experts']} experts, hidden {sizes['hidden_size']}, vocab {sizes['vocab_size']}), "
        f"{result.sync_tensors} tensors, {copy.bytes / MiB:.1f} MiB fp32, buckets of {cfg.bucket_mb} MiB; "
        f"both engines' fingerprints equal the trainer's: {'yes' if result.engine_matches else 'NO'}",
        "",
        "| method | seconds (median) | seconds (best) | MiB/s (median) | time vs copy_ |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in result.sync:
        lines.append(f"| {row.method} | {row.median_s:.3f} | {row.best_s:.3f} | {row.bytes_per_s / MiB:.0f} "
                     f"| {row.median_s / copy.median_s:.2f}× |")
    return "\n".join(lines)


def run(cfg: BenchConfig, workdir: str | Path | None = None) -> BenchResult:
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as scratch:
        root = Path(workdir or scratch)
        result = BenchResult()
        print(f"[bench] (a) generation, model '{cfg.generation_model}' ...", file=sys.stderr, flush=True)
        gen_dir = random_checkpoint(model_config(cfg.generation_model), root / "generation", seed=cfg.seed)
        (raw,) = run_gloo_world(_generation_rank, 1, cfg, str(gen_dir), timeout=3600)
        result.generation = _generation_rows(raw)
        print(f"[bench] (b) weight sync, model '{cfg.sync_model}' ...", file=sys.stderr, flush=True)
        sync_dir = (gen_dir if cfg.sync_model == cfg.generation_model else
                    random_checkpoint(model_config(cfg.sync_model), root / "sync", seed=cfg.seed))
        (raw,) = run_gloo_world(_sync_rank, 1, cfg, str(sync_dir), timeout=3600)
        result.sync, result.sync_tensors = _sync_rows(raw), raw["tensors"]
        result.engine_matches = raw["engine_matches"]
        return result


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = BenchConfig()
    parser.add_argument("--prompts", type=int, default=defaults.prompts)
    parser.add_argument("--new-tokens", type=int, default=defaults.new_tokens)
    parser.add_argument("--temperature", type=float, default=defaults.temperature)
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--generation-model", choices=sorted(MODEL_SIZES), default=defaults.generation_model)
    parser.add_argument("--sync-model", choices=sorted(MODEL_SIZES), default=defaults.sync_model)
    parser.add_argument("--bucket-mb", type=int, default=defaults.bucket_mb)
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    args = build_parser(parser).parse_args(argv)
    cfg = BenchConfig(prompts=args.prompts, new_tokens=args.new_tokens, temperature=args.temperature,
                      repeats=args.repeats, generation_model=args.generation_model,
                      sync_model=args.sync_model, bucket_mb=args.bucket_mb)
    result = run(cfg)
    print(format_table(result, cfg))
    return 0 if result.engine_matches else 1
