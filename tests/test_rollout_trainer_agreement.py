"""Rollout engine and trainer agree: same weights give the same log-probabilities and (with R3) the
same experts, and a weight sync leaves the engine holding exactly the trainer's weights.

The engine is the embedded ``HFEngine`` (transformers) in rank 0's process, the trainer a Megatron
``TrainActor`` over the ranks of a gloo world, both started from one random Hugging Face
checkpoint: two independent implementations of the same network. Samples travel from the engine to
every rank as the RL loop sends them (``training_samples``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bpo_megatron import testing as th
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.testing import MODEL_CONFIGS, DispatchRecorder, same_expert_sets

FIXTURE = MODEL_CONFIGS / "tiny_qwen3_moe"
TIMEOUT = 120
MEAN_TOLERANCE = 1e-5  # fp32: KV-cache decoding and Megatron's forward sum in different orders
MAX_TOLERANCE = 1e-4
LAYOUTS = {"ws1": (1, {}), "ep2": (2, dict(ep=2)), "tp2": (2, dict(tp=2)), "tp2_ep2": (2, dict(tp=2, ep=2))}


# ------------------------------------------------------------------------------ rank helpers
def _requests(temperature: float, seed: int):
    """Several prompts of different lengths, n > 1 responses each, no top-k/top-p (the paper's)."""
    from bpo_megatron.rollout import GenerationRequest, SamplingParams

    gen = torch.Generator().manual_seed(seed)
    return [GenerationRequest(f"q{i}", tuple(torch.randint(0, 200, (length,), generator=gen).tolist()),
                              SamplingParams(temperature=temperature, n=4, max_new_tokens=16, seed=seed + i))
            for i, length in enumerate((3, 11, 6, 20))]


def _generate_on_rank0(engine, temperature: float, seed: int):
    """The engine's samples on every rank (the engine itself lives on rank 0)."""
    box = [engine.generate(_requests(temperature, seed)) if engine is not None else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _train_samples(samples):
    """Rewards that vary within each prompt's group, so every response has an advantage."""
    from bpo_megatron.loop.samples import training_samples

    rewards = torch.tensor([float((s.response_tokens < 100).float().mean()) for s in samples])
    train, _ = training_samples(samples, rewards, group_size=4, keep_routing=True)
    return train


def _actor(model_dir: str, layout: dict, temperature: float, lr: float = 1e-3):
    """A trainer whose temperature is the sampling temperature, loaded from the engine's checkpoint."""
    return th.build_actor(model_dir, replay=True, micro_batch_size=4, temperature=temperature, lr=lr,
                          weights=model_dir, **layout)


def _logprob_gaps(scored: list[torch.Tensor], samples) -> torch.Tensor:
    return torch.cat([(mine - s.rollout_logprobs).abs() for mine, s in zip(scored, samples, strict=True)])


# ---------------------------------------------------------------------------- A: agreement
def _agreement(model_dir: str, layout: dict, temperature: float, engine_dtype: str = "fp32") -> dict:
    from bpo_megatron.models.options import TORCH_DTYPES
    from bpo_megatron.rollout.hf.engine import HFEngine

    rank0 = dist.get_rank() == 0
    engine = HFEngine(model_dir, capture_routing=True, dtype=TORCH_DTYPES[engine_dtype]) if rank0 else None
    samples = _generate_on_rank0(engine, temperature, seed=100)
    actor = _actor(model_dir, layout, temperature)
    train = _train_samples(samples)

    watch = DispatchRecorder(actor.model, actor.hf.num_experts_per_tok)
    replayed = actor.compute_logprobs(train)
    dispatched = watch.per_sample(actor, train)
    free = actor.compute_logprobs(train, record_routing=True)
    result = {"samples": len(samples), "layers": len(actor.hf.moe_layers),
              "lengths": [s.response_tokens.numel() for s in samples]}
    gaps = _logprob_gaps(replayed.logprobs, samples)
    free_gaps = _logprob_gaps(free.logprobs, samples)
    replay_same = torch.cat([same_expert_sets(d, s.routed_experts).flatten() for d, s in zip(dispatched, samples)])
    free_same = torch.cat([same_expert_sets(t, s.routed_experts).flatten()
                           for t, s in zip(free.routed_experts, samples)])
    result.update(mean=float(gaps.mean()), max=float(gaps.max()), tokens=gaps.numel(),
                  free_mean=float(free_gaps.mean()), free_max=float(free_gaps.max()),
                  replay_agreement=float(replay_same.float().mean()), routed_pairs=replay_same.numel(),
                  free_disagreement=1.0 - float(free_same.float().mean()))
    # controls: the recorder sees what replay dictates (other experts when told so) ...
    shifted = [dataclasses.replace(t, routed_experts=(t.routed_experts + 1) % actor.hf.num_experts) for t in train]
    watch = DispatchRecorder(actor.model, actor.hf.num_experts_per_tok)
    actor.compute_logprobs(shifted)
    moved = watch.per_sample(actor, shifted)
    result["shifted_agreement"] = float(torch.cat(
        [same_expert_sets(d, t.routed_experts).flatten() for d, t in zip(moved, shifted)]).float().mean())
    result["shifted_vs_engine"] = float(torch.cat(
        [same_expert_sets(d, s.routed_experts).flatten() for d, s in zip(moved, samples)]).float().mean())
    # ... and scoring at another temperature than the engine sampled at disagrees
    actor.trainer_cfg = dataclasses.replace(actor.trainer_cfg, temperature=temperature + 0.5)
    result["wrong_temperature_mean"] = float(_logprob_gaps(actor.compute_logprobs(train).logprobs, samples).mean())
    actor.close()
    return result


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> str:
    return str(tiny_checkpoint(FIXTURE))


@pytest.mark.parametrize("name, temperature", [("ws1", 0.7), ("ep2", 1.0), ("tp2", 0.7)])
def test_trainer_logprobs_with_r3_equal_the_engines(model_dir, name, temperature):
    """Engine samples (several prompts, n=4) scored by the trainer with the engine's routing
    replayed: log π = log μ within fp32 summation noise, and every token goes to the experts the
    engine recorded. Free routing (no replay) is measured and reported."""
    world, layout = LAYOUTS[name]
    results = run_gloo_world(_agreement, world, model_dir, layout, temperature, timeout=TIMEOUT)
    got = results[0]
    for other in results[1:]:  # every rank holds the same (gathered) results
        assert other == got
    print(f"\n[agreement {name} T={temperature}] {got['samples']} samples, {got['tokens']} response tokens, "
          f"{got['routed_pairs']} (token, MoE layer) pairs: R3 mean |Δ log μ| = {got['mean']:.2e}, "
          f"max = {got['max']:.2e}, routing agreement = {got['replay_agreement']:.2%}; free routing: "
          f"disagreement = {got['free_disagreement']:.2%}, mean |Δ| = {got['free_mean']:.2e}, "
          f"max = {got['free_max']:.2e}")
    assert got["samples"] == 16 and min(got["lengths"]) >= 1
    assert got["mean"] <= MEAN_TOLERANCE, got
    assert got["max"] <= MAX_TOLERANCE, got
    assert got["replay_agreement"] == 1.0, got
    assert 0.0 <= got["free_disagreement"] <= 1.0
    assert got["shifted_agreement"] == 1.0 and got["shifted_vs_engine"] == 0.0, "replay must decide the experts"
    assert got["wrong_temperature_mean"] > 100 * MEAN_TOLERANCE, "the check must notice a temperature mismatch"


def test_with_a_bf16_engine_r3_still_routes_every_token_as_the_engine_did(model_dir):
    """rollout.hf.dtype=bf16 opens on a CPU the gap GPU inference kernels open: the engine's
    routing and log μ come from bf16 arithmetic. Replay still sends every token to the engine's
    experts; the trainer's own routing differs on the few near-tied tokens (reported)."""
    got = run_gloo_world(_agreement, 1, model_dir, {}, 1.0, "bf16", timeout=TIMEOUT)[0]
    print(f"\n[agreement ws1 bf16 engine] {got['routed_pairs']} (token, MoE layer) pairs: R3 routing agreement "
          f"= {got['replay_agreement']:.2%}, mean |Δ log μ| = {got['mean']:.2e}; free routing disagreement = "
          f"{got['free_disagreement']:.2%}, mean |Δ| = {got['free_mean']:.2e}")
    assert got["replay_agreement"] == 1.0 and got["shifted_agreement"] == 1.0, got
    assert 100 * MEAN_TOLERANCE < got["mean"] < 0.1, got  # bf16's resolution, far above fp32's
    assert 0.0 <= got["free_disagreement"] < 0.05, got


# ---------------------------------------------------------------------------- B: weight sync
BUCKET_BYTES = 16 * 1024  # several buckets even for the tiny model
CORRUPTED = "model.layers.1.mlp.experts.3.down_proj.weight"


def _flip_lowest_bit(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with the least significant bit of one element flipped: the smallest possible error."""
    bad = tensor.detach().clone().contiguous()
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[bad.element_size()]
    bad.view(-1).view(as_int)[bad.numel() // 2] ^= 1
    return bad


def _push(actor, engine, *, corrupt: str | None = None, dtype: torch.dtype | None = None
          ) -> tuple[dict[str, str], int]:
    """Weight sync: every rank streams its shards; rank 0 sends buckets (in ``dtype``) to the
    engine. Returns the fingerprints of what the trainer sent and the number of buckets (rank 0)."""
    from bpo_megatron.weights import iter_hf_weights
    from bpo_megatron.weights.buckets import buckets
    from bpo_megatron.weights.checksums import fingerprints

    stream = ((name, tensor.detach().to("cpu", dtype)) for name, tensor in iter_hf_weights(actor.model, actor.hf, dst=0))
    if engine is None:
        for _ in stream:  # ranks other than dst send their pieces while the generator runs
            pass
        return {}, 0
    sent: dict[str, str] = {}
    count = 0
    engine.begin_weight_update(1)
    try:
        for bucket in buckets(stream, BUCKET_BYTES):
            sent.update(fingerprints(bucket))
            # in transit: a tensor may alias the trainer's own parameter, so corrupt a copy
            bucket = [(n, _flip_lowest_bit(t) if n == corrupt else t) for n, t in bucket]
            engine.update_weights(bucket)
            count += 1
    finally:
        engine.end_weight_update()
    return sent, count


def _train_and_sync(model_dir: str, layout: dict, engine_dtype: str) -> dict | None:
    from bpo_megatron.models.options import TORCH_DTYPES
    from bpo_megatron.weights.checksums import WeightMismatch, compare, fingerprints
    from bpo_megatron.rollout.hf.engine import HFEngine

    temperature, dtype = 1.0, TORCH_DTYPES[engine_dtype]
    rank0 = dist.get_rank() == 0
    engine = HFEngine(model_dir, capture_routing=True, dtype=dtype) if rank0 else None
    initial = fingerprints(engine.named_hf_weights()) if rank0 else {}
    samples = _generate_on_rank0(engine, temperature, seed=200)
    actor = _actor(model_dir, layout, temperature, lr=1e-3)
    train = _train_samples(samples)
    metrics = actor.train_step(train)

    sent, num_buckets = _push(actor, engine, dtype=dtype)
    result: dict = {"metrics": metrics}
    if rank0:
        held = fingerprints(engine.named_hf_weights())
        compare(sent, held, engine="hf engine")  # raises WeightMismatch on any difference
        result.update(sent=sorted(sent), held=sorted(held), buckets=num_buckets,
                      changed=sorted(n for n in sent if sent[n] != initial[n]),
                      held_dtypes=sorted({str(t.dtype) for _, t in engine.named_hf_weights()}))

    # the engine now samples from the trained weights, and the trainer agrees with it
    after = _generate_on_rank0(engine, temperature, seed=300)
    scored = actor.compute_logprobs(_train_samples(after))
    gaps = _logprob_gaps(scored.logprobs, after)
    result.update(mean=float(gaps.mean()), max=float(gaps.max()))

    # one bit of one tensor flipped in transit is caught, and named
    _, _ = _push(actor, engine, corrupt=CORRUPTED, dtype=dtype)
    if rank0:
        try:
            compare(sent, fingerprints(engine.named_hf_weights()), engine="hf engine")
            result["mismatch"] = None
        except WeightMismatch as exc:
            result["mismatch"] = str(exc)
    actor.close()
    return result if rank0 else None


@pytest.mark.parametrize("name, engine_dtype", [("ws1", "fp32"), ("tp2_ep2", "fp32"), ("ws1", "bf16")])
def test_a_sync_after_training_leaves_the_engine_with_the_trainers_weights(model_dir, name, engine_dtype):
    """fp32 engines hold the trainer's exact weights; a bf16 engine (rollout.hf.dtype) holds
    exactly the bf16 tensors it was sent."""
    world, layout = LAYOUTS[name]
    got = run_gloo_world(_train_and_sync, world, model_dir, layout, engine_dtype, timeout=TIMEOUT)[0]
    print(f"\n[sync {name} {engine_dtype}] {len(got['sent'])} tensors in {got['buckets']} buckets, "
          f"{len(got['changed'])} changed by the step; after sync mean |Δ log μ| = {got['mean']:.2e}, "
          f"max = {got['max']:.2e}")
    assert got["held_dtypes"] == [{"fp32": "torch.float32", "bf16": "torch.bfloat16"}[engine_dtype]]
    assert got["metrics"]["grad_norm"] > 0
    assert got["sent"] == got["held"], "every engine weight must be sent, and only those"
    assert got["buckets"] > 3
    # AdamW moves every weight matrix (weight decay alone would); norms move with their gradients
    assert len(got["changed"]) >= 0.9 * len(got["sent"]), got["changed"]
    if engine_dtype == "fp32":
        assert got["mean"] <= MEAN_TOLERANCE and got["max"] <= MAX_TOLERANCE, got
    else:  # bf16 sampling vs fp32 scoring: the gap GPU inference kernels open, at bf16's resolution
        assert 100 * MEAN_TOLERANCE < got["mean"] < 0.1, got
    assert got["mismatch"] is not None, "a corrupted bucket went unnoticed"
    assert CORRUPTED in got["mismatch"] and "1 tensors differ" in got["mismatch"], got["mismatch"]

