"""One RL step of a ~1B-parameter MoE (random weights) on one device: rollout with routing capture
(embedded engine), log-prob recompute and a training step with R3 replay (Megatron, one optimizer
step over all samples), the weight sync into the engine, and the trainer's offload/onload.

Padded against packed micro-batches: the same samples, cut to RL's long-tailed response lengths
(30% whole, the rest log-uniform down to 1/16), are scored and trained padded
(``rl_micro_batch`` samples per micro-batch) and packed (a budget of ``rl_micro_batch`` full-length
samples), on the same weights: both tokens per second, and the packed log-probs against the
padded ones.

Throughput is tokens per second; model FLOPs utilisation counts the matrix products a token
needs and causal attention (:mod:`bpo_megatron.gpu_smoke.flops`, the kit's one count), ×3 for
forward + backward, against the device's data-sheet bf16 peak.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from bpo_megatron import platform
from bpo_megatron.gpu_smoke.common import build_actor, device_name, single_rank_world, timed
from bpo_megatron.gpu_smoke.flops import forward_flops, train_flops
from bpo_megatron.testing import long_tailed, random_tokens, train_samples, write_config
from bpo_megatron.gpu_smoke.profiles import Profile, bf16_peak_flops, finite
from bpo_megatron.gpu_smoke.report import Outcome


def _engine(profile: Profile, model_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from bpo_megatron.models.options import TORCH_DTYPES
    from bpo_megatron.rollout.hf.engine import HFEngine

    config = AutoConfig.from_pretrained(str(model_dir))
    torch.manual_seed(0)
    with torch.device(platform.device()):  # random weights initialised where they live
        model = AutoModelForCausalLM.from_config(config, dtype=TORCH_DTYPES[profile.dtype])
    model.requires_grad_(False)
    return HFEngine(model, capture_routing=True, max_batch_rows=profile.rl_prompts * profile.rl_n)


def run(profile: Profile, workdir: Path) -> Outcome:
    from bpo_megatron.models import HFModelConfig
    from bpo_megatron.weights.names import parameter_counts
    from bpo_megatron.rollout import GenerationRequest, SamplingParams
    from bpo_megatron.weights.buckets import DEFAULT_BUCKET_BYTES

    out = Outcome("rl_throughput")
    config = profile.large_model
    hf = HFModelConfig.load(config)
    total_params, active_params = parameter_counts(hf)
    peak = bf16_peak_flops(device_name()) if platform.has_cuda() else None
    times: dict[str, float] = {}

    engine = _engine(profile, write_config(config, workdir / "large_moe"))
    warm = [GenerationRequest("warm", (1, 2, 3), SamplingParams(max_new_tokens=4))]
    engine.generate(warm)
    requests = [GenerationRequest(f"p{i}", p, SamplingParams(temperature=1.0, n=profile.rl_n,
                                                              max_new_tokens=profile.rl_new_tokens, seed=i))
                for i, p in enumerate(random_tokens(profile.rl_prompts, profile.rl_prompt_tokens, hf.vocab_size, seed=7))]
    with timed(times, "rollout_s"):
        samples = engine.generate(requests)
    generated = sum(s.response_tokens.numel() for s in samples)
    prompt_tokens = sum(s.prompt_tokens.numel() for s in samples)
    # prefill: every prompt once per response (the engine does not share prefixes); decode: per token
    rollout_flops = forward_flops(hf, [s.prompt_tokens.numel() + s.response_tokens.numel() - 1
                                       for s in samples]).total
    train = train_samples(samples, torch.randn(len(samples), generator=torch.Generator().manual_seed(0)))
    positions = [s.tokens.numel() - 1 for s in train]

    with single_rank_world():
        actor = build_actor(profile, config, replay=True, micro_batch_size=profile.rl_micro_batch, lr=1e-6)
        actor.train_step(train[: profile.rl_micro_batch])  # warm-up: kernels, allocator, optimizer state
        with timed(times, "logprobs_s"):
            actor.compute_logprobs(train)
        if platform.has_cuda():
            torch.cuda.reset_peak_memory_stats()
        with timed(times, "train_s"):
            metrics = actor.train_step(train)
        peak_train = torch.cuda.max_memory_allocated() if platform.has_cuda() else 0
        varied = long_tailed(train, seed=1)
        budget = profile.rl_micro_batch * (profile.rl_prompt_tokens + profile.rl_new_tokens)
        batching = {"padded": actor.trainer_cfg, "packed": replace(actor.trainer_cfg, max_tokens_per_micro_batch=budget)}
        scored, varied_metrics = {}, {}
        for name, trainer_cfg in batching.items():  # both scored on the same weights
            actor.trainer_cfg = trainer_cfg
            scored[name] = actor.compute_logprobs(varied)
        for name, trainer_cfg in batching.items():  # then one step each, timed
            actor.trainer_cfg = trainer_cfg
            with timed(times, f"{name}_train_s"):
                varied_metrics[name] = actor.train_step(varied)
        actor.trainer_cfg = batching["padded"]
        with timed(times, "sync_s"):  # what a sync sends (the actor's export), into an engine in this process
            synced = sum(engine.update_weights(bucket)
                         for bucket in actor.export_weights(DEFAULT_BUCKET_BYTES, views=True))
        with timed(times, "offload_s"):
            offloaded = actor.offload()
        with timed(times, "onload_s"):
            actor.onload()
        with timed(times, "second_offload_s"):  # pinned host buffers reused
            actor.offload()
        with timed(times, "second_onload_s"):
            actor.onload()
        actor.close()
    engine.shutdown()

    varied_positions = sum(s.tokens.numel() - 1 for s in varied)
    packed_gap = max(float((p - q).abs().max()) for p, q in zip(scored["packed"].logprobs, scored["padded"].logprobs))
    step_flops = train_flops(hf, positions).total
    logprob_flops = forward_flops(hf, positions).total
    mfu = (lambda flops, seconds: flops / seconds / peak) if peak else (lambda flops, seconds: float("nan"))
    out.numbers.update(
        model=f"{hf.num_hidden_layers} layers, hidden {hf.hidden_size}, {hf.num_experts} experts top-{hf.num_experts_per_tok}, "
              f"vocab {hf.vocab_size}",
        total_params_b=total_params / 1e9, active_params_b=active_params / 1e9,
        samples=len(samples), prompt_tokens=prompt_tokens, response_tokens=generated,
        rollout_decode_path=engine.decode_path,
        rollout_s=times["rollout_s"], rollout_tokens_per_s=generated / times["rollout_s"],
        rollout_mfu=mfu(rollout_flops, times["rollout_s"]),
        logprobs_s=times["logprobs_s"], logprobs_tokens_per_s=sum(positions) / times["logprobs_s"],
        logprobs_mfu=mfu(logprob_flops, times["logprobs_s"]),
        train_s=times["train_s"], train_tokens_per_s=sum(positions) / times["train_s"],
        train_mfu=mfu(step_flops, times["train_s"]), train_peak_allocated_gib=peak_train / 2**30,
        micro_batches=metrics["num_micro_batches"], loss=metrics["loss"], grad_norm=metrics["grad_norm"],
        varied_positions=varied_positions,
        padded_train_tokens_per_s=varied_positions / times["padded_train_s"],
        packed_train_tokens_per_s=varied_positions / times["packed_train_s"],
        packed_speedup=times["padded_train_s"] / times["packed_train_s"],
        padded_micro_batches=varied_metrics["padded"]["num_micro_batches"],
        packed_micro_batches=varied_metrics["packed"]["num_micro_batches"],
        packed_logp_max_abs_diff=packed_gap,
        weight_sync_s=times["sync_s"], weight_sync_gb_per_s=synced / times["sync_s"] / 1e9,
        offload_gb=offloaded / 1e9, offload_s=times["offload_s"], onload_s=times["onload_s"],
        second_offload_s=times["second_offload_s"], second_onload_s=times["second_onload_s"],
        bf16_peak_tflops=(peak or float("nan")) / 1e12,
    )
    out.require(generated == len(samples) * profile.rl_new_tokens,
                f"every response ran to {profile.rl_new_tokens} tokens ({generated} generated)")
    out.require(finite(metrics["loss"], metrics["grad_norm"]), "the training step is finite")
    out.require(finite(varied_metrics["packed"]["loss"], varied_metrics["padded"]["loss"]),
                "padded and packed training steps are finite")
    out.require(packed_gap <= profile.logp_mean_tol,
                f"packed log-probs equal the padded ones (max |Δ| {packed_gap:.2e} ≤ {profile.logp_mean_tol})")
    out.require(synced > 0, f"the engine took the trainer's weights ({synced / 1e9:.2f} GB)")
    out.notes.append(f"Rollout: the embedded engine (decode path {engine.decode_path}, all responses in one "
                     "batch; rollout_decode compares the paths), not SGLang; "
                     "training: Megatron's local spec (no transformer-engine on this machine), experts "
                     "computed one after another. These are floors, not what a tuned cluster reaches.")
    return out
