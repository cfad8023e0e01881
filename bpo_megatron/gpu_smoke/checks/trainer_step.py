"""The Qwen3-MoE trainer in the profile's precision (on a GPU: bf16 weights, Megatron's
distributed optimizer, the CUDA RNG) against an independent fp32 CPU reference: transformers'
model holding exactly the trainer's weights. Each layer spec that can run here trains from the
same weights: the local spec (``model.layer_spec=local``, the supported path) always, and
transformer-engine's (``model.layer_spec=transformer_engine``) where a GPU and transformer-engine
are present; ``layer_specs`` in the report says which ran."""

from __future__ import annotations

from pathlib import Path

import torch

from bpo_megatron import platform
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


def layer_specs_here() -> list[str]:
    """The layer specs this check trains (``model.layer_spec``): the local spec everywhere,
    transformer-engine's too where it can run (a GPU, transformer-engine installed)."""
    from bpo_megatron.models.options import layer_spec_refusal

    usable = layer_spec_refusal("transformer_engine", gpu=platform.has_cuda()) is None
    return ["local", *(["transformer_engine"] if usable else [])]


def _steps_against_reference(profile: Profile, config: dict, hf, model_dir: Path, layer_spec: str) -> dict:
    """One actor of ``layer_spec`` from ``model_dir``'s weights: its log-probs and step-0 loss against
    transformers' fp32 reference holding the same weights, then STEPS steps on the same batch."""
    from bpo_megatron.losses import BatchTotals, policy_loss
    from bpo_megatron.trainer.samples import TrainSample, collate

    count, prompt, response = (8, 16, 48) if profile.device == "cuda" else (4, 4, 6)
    actor = build_actor(profile, config, replay=False, micro_batch_size=count, lr=1e-4, weights=model_dir,
                        model_options={"layer_spec": layer_spec})
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
    return {"optimizers": optimizers, "param": param, "staged": (staged_equal, staged_pinned, staged_count),
            "ref_loss": float(ref_loss), "gaps": gaps, "steps": steps, "count": count, "response": response}


def _require(out: Outcome, profile: Profile, measured: dict, label: str) -> None:
    """The pass criteria of one layer spec's run (``label`` prefixes each)."""
    param, optimizers, gaps = measured["param"], measured["optimizers"], measured["gaps"]
    staged_equal, staged_pinned, staged_count = measured["staged"]
    losses = [m["loss"] for m in measured["steps"]]
    norms = [m["grad_norm"] for m in measured["steps"]]
    rel = abs(losses[0] - measured["ref_loss"]) / abs(measured["ref_loss"])
    if profile.device == "cuda":
        out.require(param.dtype == torch.bfloat16 and param.is_cuda,
                    f"{label}bf16 weights on the GPU ({param.dtype}, {param.device})")
        out.require(all(name == "DistributedOptimizer" for name in optimizers),
                    f"{label}Megatron's distributed optimizer ({', '.join(optimizers)})")
        out.require(staged_pinned, f"{label}the host export's buckets lie in pinned memory")
    out.require(staged_equal, f"{label}the host export (bucketed, staged) equals the direct export "
                              f"({staged_count} tensors)")
    out.require(rel <= profile.loss_rel_tol,
                f"{label}step-0 loss {losses[0]:.6f} = fp32 CPU reference {measured['ref_loss']:.6f} within "
                f"{profile.loss_rel_tol:g} relative (got {rel:.2e})")
    out.require(float(gaps.mean()) <= profile.logp_mean_tol,
                f"{label}mean |log π − reference| ≤ {profile.logp_mean_tol:g} (got {float(gaps.mean()):.2e}, "
                f"max {float(gaps.max()):.2e})")
    out.require(finite(*losses, *norms), f"{label}finite loss and grad norm over {STEPS} steps")
    out.require(losses[-1] < losses[0],
                f"{label}training on the batch lowers its loss ({losses[0]:.5f} → {losses[-1]:.5f})")


def _numbers(measured: dict) -> dict:
    losses = [m["loss"] for m in measured["steps"]]
    gaps = measured["gaps"]
    return dict(
        params_dtype=str(measured["param"].dtype).replace("torch.", ""), param_device=str(measured["param"].device),
        optimizers=", ".join(measured["optimizers"]), samples=measured["count"],
        response_tokens=measured["count"] * measured["response"], reference_loss_fp32_cpu=measured["ref_loss"],
        loss_step0=losses[0], loss_rel_diff=abs(losses[0] - measured["ref_loss"]) / abs(measured["ref_loss"]),
        logp_mean_abs_diff=float(gaps.mean()), logp_max_abs_diff=float(gaps.max()),
        losses=", ".join(f"{v:.5f}" for v in losses),
        grad_norms=", ".join(f"{m['grad_norm']:.4f}" for m in measured["steps"]),
        train_step_s=", ".join(f"{m['train_time_s']:.3f}" for m in measured["steps"]),
    )


def run(profile: Profile, workdir: Path) -> Outcome:
    """Each layer spec of :func:`layer_specs_here` from the same weights; the local spec's numbers
    under their own names, transformer-engine's prefixed ``te_``; ``layer_specs`` says which ran."""
    from bpo_megatron.models import HFModelConfig
    from bpo_megatron.models.options import layer_spec_refusal

    out = Outcome("trainer_step")
    config = profile.small_model
    hf = HFModelConfig.load(config)
    model_dir = random_model_dir(config, workdir / "small_moe", seed=0)
    specs = layer_specs_here()
    out.numbers["layer_specs"] = ", ".join(specs)
    with single_rank_world():
        for layer_spec in specs:
            measured = _steps_against_reference(profile, config, hf, model_dir, layer_spec)
            local = layer_spec == "local"
            out.numbers.update({(key if local else f"te_{key}"): value for key, value in _numbers(measured).items()})
            _require(out, profile, measured, "" if local else "model.layer_spec=transformer_engine: ")
    if "transformer_engine" not in specs:
        out.notes.append("model.layer_spec=transformer_engine not run: "
                         f"{layer_spec_refusal('transformer_engine', gpu=platform.has_cuda())}")
    return out
