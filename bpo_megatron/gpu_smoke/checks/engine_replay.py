"""The embedded engine on the device: it generates with routing capture (``rollout.hf.decode=auto``:
its step as a CUDA graph on a GPU in bf16, op by op elsewhere), and the trainer (same weights, R3
on) scores the samples: log π agrees with the engine's log μ and every token goes to the experts
the engine recorded. Free routing (no replay) is measured for contrast."""

from __future__ import annotations

from pathlib import Path

import torch

from bpo_megatron import platform
from bpo_megatron.gpu_smoke.common import build_actor, single_rank_world, timed
from bpo_megatron.testing import DispatchRecorder, random_model_dir, random_tokens, same_expert_sets, train_samples
from bpo_megatron.gpu_smoke.profiles import Profile
from bpo_megatron.gpu_smoke.report import Outcome

TEMPERATURE = 1.0
MICRO_BATCH = 4


def run(profile: Profile, workdir: Path) -> Outcome:
    from bpo_megatron.models import HFModelConfig
    from bpo_megatron.models.options import TORCH_DTYPES
    from bpo_megatron.rollout import GenerationRequest, SamplingParams
    from bpo_megatron.rollout.hf.engine import HFEngine

    out = Outcome("engine_replay")
    config = profile.small_model
    hf = HFModelConfig.load(config)
    model_dir = random_model_dir(config, workdir / "small_moe", seed=0)
    times: dict[str, float] = {}
    engine = HFEngine(model_dir, capture_routing=True, dtype=TORCH_DTYPES[profile.dtype], device=platform.device())
    prompts = random_tokens(profile.engine_prompts, 24, hf.vocab_size, seed=5)
    requests = [GenerationRequest(f"p{i}", p, SamplingParams(temperature=TEMPERATURE, n=profile.engine_n,
                                                              max_new_tokens=profile.engine_new_tokens, seed=10 + i))
                for i, p in enumerate(prompts)]
    with timed(times, "generate_s"):
        samples = engine.generate(requests)
    decode_path = engine.decode_path
    engine.shutdown()
    del engine
    generated = sum(s.response_tokens.numel() for s in samples)
    on_device = [s for s in samples if s.routed_experts is not None and s.routed_experts.device.type != "cpu"]
    advantages = torch.tensor([float((s.response_tokens % 2 == 0).float().mean()) - 0.5 for s in samples])
    train = train_samples(samples, advantages)

    with single_rank_world():
        actor = build_actor(profile, config, replay=True, micro_batch_size=MICRO_BATCH, weights=model_dir,
                            temperature=TEMPERATURE)
        watch = DispatchRecorder(actor.model, hf.num_experts_per_tok)
        with timed(times, "score_s"):
            replayed = actor.compute_logprobs(train)
        dispatched = watch.per_sample(actor, train)
        free = actor.compute_logprobs(train, record_routing=True)
        actor.close()

    gaps = torch.cat([(mine - s.rollout_logprobs).abs() for mine, s in zip(replayed.logprobs, samples, strict=True)])
    free_gaps = torch.cat([(mine - s.rollout_logprobs).abs() for mine, s in zip(free.logprobs, samples, strict=True)])
    replay_same = torch.cat([same_expert_sets(d, s.routed_experts).flatten() for d, s in zip(dispatched, samples)])
    free_same = torch.cat([same_expert_sets(t, s.routed_experts).flatten() for t, s in zip(free.routed_experts, samples)])
    out.numbers.update(
        engine_dtype=profile.dtype, decode_path=decode_path, samples=len(samples), response_tokens=generated,
        routed_pairs=int(replay_same.numel()), generate_s=times["generate_s"],
        generate_tokens_per_s=generated / times["generate_s"], score_s=times["score_s"],
        r3_logp_mean_abs_diff=float(gaps.mean()), r3_logp_max_abs_diff=float(gaps.max()),
        r3_routing_agreement=float(replay_same.float().mean()),
        free_logp_mean_abs_diff=float(free_gaps.mean()), free_logp_max_abs_diff=float(free_gaps.max()),
        free_routing_disagreement=1.0 - float(free_same.float().mean()),
        routing_dtype=str(samples[0].routed_experts.dtype).replace("torch.", ""),
    )
    out.require(len(samples) == profile.engine_prompts * profile.engine_n and generated > 0,
                f"{len(samples)} samples, {generated} response tokens generated on {platform.device().type} "
                f"(decode path {decode_path})")
    out.require(not on_device, f"samples leave the engine as host tensors ({len(on_device)} hold device routing)")
    out.require(float(replay_same.float().mean()) == 1.0,
                f"R3: every (token, MoE layer) goes to the engine's experts "
                f"({float(replay_same.float().mean()):.4%} of {replay_same.numel()})")
    out.require(float(gaps.mean()) <= profile.logp_mean_tol,
                f"R3: mean |log π − log μ| ≤ {profile.logp_mean_tol:g} ({profile.dtype} engine and trainer; got "
                f"{float(gaps.mean()):.2e}, max {float(gaps.max()):.2e})")
    return out
