"""The Qwen3-MoE trainer in the profile's precision (on a GPU: bf16 weights, Megatron's
distributed optimizer, the CUDA RNG, local spec without transformer-engine) against an
independent fp32 CPU reference: transformers' model holding exactly the trainer's weights."""

from __future__ import annotations

from pathlib import Path

import torch

from bpo_megatron.gpu_smoke.common import build_actor, single_rank_world
from bpo_megatron.testing import random_model_dir, random_tokens
from bpo_megatron.gpu_smoke.profiles import Profile, finite
from bpo_megatron.gpu_smoke.report import Outcome

STEPS = 3


def _reference_model(actor, hf, model_dir: Path):
    """transformers' Qwen3-MoE in fp32 on the CPU, holding the trainer's weights upcast exactly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bpo_megatron.rollout.hf.weights import HFWeights
    from bpo_megatron.weights.gather import iter_hf_weights

    config = AutoConfig.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    weights = HFWeights(model)
    for name, tensor in iter_hf_weights(actor.model, hf, dst=0):
        weights.load(name, tensor.detach().float().cpu())
    return model


def _host_export(actor, hf) -> tuple[bool, bool, int]:
    """The weights as the host transports take them (buckets through the pinned staging buffer,
    copied while the next tensors are gathered): (every tensor equal to the direct export, every
    staged tensor pinned, tensors)."""
    from bpo_megatron.weights.gather import iter_hf_weights

    bucket = 4 << 20
    direct = {name: tensor.detach().cpu().clone() for name, tensor in iter_hf_weights(actor.model, hf, dst=0)}
    equal, pinned, seen = True, True, []
    for staged in actor.export_weights(bucket, host=True):  # the trainer's own plan and staging buffer
        for name, tensor in staged:
            seen.append(name)
            equal &= tensor.device.type == "cpu" and torch.equal(tensor, direct[name])
            pinned &= tensor.is_pinned() or tensor.nbytes > bucket
    return equal and sorted(seen) == sorted(direct), pinned, len(seen)


def run(profile: Profile, workdir: Path) -> Outcome:
    from bpo_megatron.losses import BatchTotals, policy_loss
    from bpo_megatron.models import HFModelConfig
    from bpo_megatron.trainer.samples import TrainSample, collate

    out = Outcome("trainer_step")
    config = profile.small_model
    hf = HFModelConfig.load(config)
    model_dir = random_model_dir(config, workdir / "small_moe", seed=0)
    count, prompt, response = (8, 16, 48) if profile.device == "cuda" else (4, 4, 6)
    with single_rank_world():
        actor = build_actor(profile, config, replay=False, micro_batch_size=count, lr=1e-4, weights=model_dir)
        optimizers = [type(o).__name__ for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]
        param = next(actor.model.parameters())
        reference = _reference_model(actor, hf, model_dir)
        staged_equal, staged_pinned, staged_count = _host_export(actor, hf)

        tokens = torch.tensor(random_tokens(count, prompt + response, hf.vocab_size, seed=1))
        with torch.no_grad():
            logits = reference(input_ids=tokens[:, :-1]).logits.float()
        ref_logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [b, s]
        wiggle = 0.05 * torch.sin(torch.arange(response, dtype=torch.float32))  # ratios ≠ 1: weights and masks act
        samples = [TrainSample(tokens=tokens[i], response_start=prompt,
                               rollout_logprobs=ref_logp[i, prompt - 1:] - wiggle,
                               advantage=0.5 + i / count)  # one sign: the loss is not a difference
                   for i in range(count)]
        micro = collate(samples)
        totals = BatchTotals(tokens=float(count * response), sequences=float(count))
        ref_loss, _ = policy_loss(ref_logp, micro.rollout_logprobs, micro.advantages, micro.loss_mask,
                                  actor.loss_cfg, totals=totals)

        scored = actor.compute_logprobs(samples)
        gaps = torch.cat([(mine - ref_logp[i, prompt - 1:]).abs() for i, mine in enumerate(scored.logprobs)])
        steps = [actor.train_step(samples) for _ in range(STEPS)]
        actor.close()

    losses = [m["loss"] for m in steps]
    norms = [m["grad_norm"] for m in steps]
    rel = abs(losses[0] - float(ref_loss)) / abs(float(ref_loss))
    out.numbers.update(
        params_dtype=str(param.dtype).replace("torch.", ""), param_device=str(param.device),
        optimizers=", ".join(optimizers), samples=count, response_tokens=count * response,
        reference_loss_fp32_cpu=float(ref_loss), loss_step0=losses[0], loss_rel_diff=rel,
        logp_mean_abs_diff=float(gaps.mean()), logp_max_abs_diff=float(gaps.max()),
        losses=", ".join(f"{v:.5f}" for v in losses), grad_norms=", ".join(f"{v:.4f}" for v in norms),
        train_step_s=", ".join(f"{m['train_time_s']:.3f}" for m in steps),
    )
    if profile.device == "cuda":
        out.require(param.dtype == torch.bfloat16 and param.is_cuda, f"bf16 weights on the GPU ({param.dtype}, {param.device})")
        out.require(all(name == "DistributedOptimizer" for name in optimizers),
                    f"Megatron's distributed optimizer ({', '.join(optimizers)})")
        out.require(staged_pinned, "the host export's buckets lie in pinned memory")
    out.require(staged_equal, f"the host export (bucketed, staged) equals the direct export ({staged_count} tensors)")
    out.require(rel <= profile.loss_rel_tol,
                f"step-0 loss {losses[0]:.6f} = fp32 CPU reference {float(ref_loss):.6f} within "
                f"{profile.loss_rel_tol:g} relative (got {rel:.2e})")
    out.require(float(gaps.mean()) <= profile.logp_mean_tol,
                f"mean |log π − reference| ≤ {profile.logp_mean_tol:g} (got {float(gaps.mean()):.2e}, "
                f"max {float(gaps.max()):.2e})")
    out.require(finite(*losses, *norms), f"finite loss and grad norm over {STEPS} steps")
    out.require(losses[-1] < losses[0], f"training on the batch lowers its loss ({losses[0]:.5f} → {losses[-1]:.5f})")
    return out
