"""The trainer hands its device memory back for a colocated rollout and takes it again: the memory
allocated on the device before, while offloaded and after, parameters and the optimizer's state
compared bit for bit after the round trip, and the main gradients (dead between steps: freed, not
copied) back as zeros.

The residual a colocated engine shares its GPU with is measured as the device's used memory (the
driver's count, total − free, as NVML reports it: CUDA context, workspaces, NCCL buffers, the
allocator's reserve and whatever a save still references) while offloaded, once alone and once
with a background checkpoint save in flight; it is held against the planner's residual for this
one-rank world, and the largest ``mem_fraction_static`` it leaves room for is reported
(:func:`residual_numbers`)."""

from __future__ import annotations

from pathlib import Path

import torch

from bpo_megatron import platform
from bpo_megatron.gpu_smoke.common import build_actor, single_rank_world, timed
from bpo_megatron.testing import random_model_dir, random_tokens
from bpo_megatron.gpu_smoke.profiles import Profile, finite
from bpo_megatron.gpu_smoke.report import Outcome

GiB = 2**30


def snapshot(actor) -> dict[str, torch.Tensor]:
    """Host copies of everything offloading touches: parameters, main grads, optimizer tensors."""
    from bpo_megatron.trainer.offload import torch_optimizers

    state = {}
    for name, param in actor.model.named_parameters():
        state[f"param:{name}"] = param.detach().to("cpu", copy=True)
        if getattr(param, "main_grad", None) is not None:
            state[f"grad:{name}"] = param.main_grad.to("cpu", copy=True)
    for k, inner in enumerate(torch_optimizers(actor.optimizer)):
        for g, group in enumerate(inner.param_groups):
            for p, param in enumerate(group["params"]):
                state[f"opt{k}.{g}.{p}:param"] = param.detach().to("cpu", copy=True)
                for key, value in inner.state.get(param, {}).items():
                    if torch.is_tensor(value):
                        state[f"opt{k}.{g}.{p}:{key}"] = value.to("cpu", copy=True)
    return state


def _allocated() -> int:
    return torch.cuda.memory_allocated() if platform.has_cuda() else 0


def _device_used() -> int:
    """What the device holds beyond torch's allocations too (CUDA context, cuBLAS workspaces, NCCL
    buffers, the caching allocator's reserve): total − free, this process being its only user."""
    if not platform.has_cuda():
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def residual_numbers(*, used_offloaded: float, used_offloaded_saving: float, total: float,
                     planned: float) -> dict[str, float]:
    """The residual's numbers from the device's used bytes while offloaded (alone, and with a
    background save in flight), its total bytes and the planner's residual for the same world:
    the save's own share, how far the larger residual stays within the planner's (≥ 0 holds), and
    the largest ``mem_fraction_static`` that residual leaves room for beside the engine's runtime
    (:func:`bpo_megatron.planner.plan.largest_pool_fraction`)."""
    from bpo_megatron.planner.plan import largest_pool_fraction

    residual = max(used_offloaded, used_offloaded_saving)
    return dict(device_used_offloaded_saving_gib=used_offloaded_saving / GiB,
                background_save_residual_gib=(used_offloaded_saving - used_offloaded) / GiB,
                planned_residual_gib=planned / GiB, residual_margin_gib=(planned - residual) / GiB,
                mem_fraction_static_allowed=largest_pool_fraction(residual, total))


def _train_samples(hf, count: int, seed: int):
    from bpo_megatron.trainer.samples import TrainSample

    return [TrainSample(tokens=torch.tensor(tokens), response_start=16, rollout_logprobs=torch.full((48,), -9.0),
                        advantage=1.0 if i % 2 else -1.0)
            for i, tokens in enumerate(random_tokens(count, 64, hf.vocab_size, seed=seed))]


def run(profile: Profile, workdir: Path) -> Outcome:
    from bpo_megatron.models import HFModelConfig

    out = Outcome("trainer_offload")
    config = profile.small_model
    hf = HFModelConfig.load(config)
    model_dir = random_model_dir(config, workdir / "small_moe", seed=0)
    times: dict[str, float] = {}
    with single_rank_world():
        actor = build_actor(profile, config, replay=False, micro_batch_size=4, weights=model_dir)
        actor.train_step(_train_samples(hf, 8, seed=1))  # gradients and Adam moments exist from here on
        before = snapshot(actor)
        allocated_before = _allocated()
        with timed(times, "offload_s"):
            moved = actor.offload()
        allocated_offloaded = _allocated()
        device_used_offloaded = _device_used()  # the residual a colocated engine shares its GPU with
        storages_left = sum(p.untyped_storage().nbytes() for p in actor.model.parameters())
        with timed(times, "onload_s"):
            back = actor.onload()
        allocated_after = _allocated()
        after = snapshot(actor)
        metrics = actor.train_step(_train_samples(hf, 8, seed=2))
        with timed(times, "second_offload_s"):  # host buffers are reused from here on
            actor.offload()
        with timed(times, "second_onload_s"):
            actor.onload()
        # a background save in flight (a forked writer; the trainer may still reference what it
        # staged from) while the trainer offloads for the next rollout, as a colocated run does
        actor.save(str(workdir / "offload_checkpoints"), background=True)
        saving = actor.saves.in_flight
        actor.offload()
        device_used_offloaded_saving = _device_used()
        actor.onload()
        published = actor.finish_saves()
        actor.close()

    kept = [k for k in before if not k.startswith("grad:")]
    differ = sorted(k for k in kept if not torch.equal(before[k], after[k]))
    nonzero_grads = sorted(k for k in after if k.startswith("grad:") and bool(after[k].any()))
    freed = allocated_before - allocated_offloaded
    out.numbers.update(
        bytes_moved=moved, tensors_compared=len(kept), allocated_before_gib=allocated_before / GiB,
        allocated_offloaded_gib=allocated_offloaded / GiB, allocated_after_onload_gib=allocated_after / GiB,
        device_used_offloaded_gib=device_used_offloaded / GiB,
        offload_s=times["offload_s"], onload_s=times["onload_s"],
        offload_gb_per_s=moved / times["offload_s"] / 1e9, onload_gb_per_s=back / times["onload_s"] / 1e9,
        second_offload_gb_per_s=moved / times["second_offload_s"] / 1e9,
        second_onload_gb_per_s=moved / times["second_onload_s"] / 1e9,
        parameter_storage_bytes_while_offloaded=storages_left, loss_after_onload=metrics["loss"],
    )
    if platform.has_cuda():
        from bpo_megatron.planner.rollout import trainer_residual

        planned = trainer_residual(tp=1, pp=1, ep=1, etp=1, dp=1, expert_dp=1).total  # this one-rank world
        out.numbers.update(residual_numbers(used_offloaded=device_used_offloaded,
                                            used_offloaded_saving=device_used_offloaded_saving,
                                            total=torch.cuda.mem_get_info()[1], planned=planned))
        out.require(out.numbers["residual_margin_gib"] >= 0,
                    f"the device memory used while offloaded, a background save in flight, is within the planner's "
                    f"residual ({max(device_used_offloaded, device_used_offloaded_saving) / GiB:.2f} of "
                    f"{planned / GiB:.2f} GiB); mem_fraction_static up to "
                    f"{out.numbers['mem_fraction_static_allowed']:.3f} leaves room for it")
    out.require(bool(saving) and published is not None,
                f"a background save was in flight while offloaded and was published after ({published})")
    out.require(storages_left == 0, f"every parameter's storage is empty while offloaded ({storages_left} bytes left)")
    if platform.has_cuda():
        out.require(freed >= 0.99 * moved,
                    f"torch.cuda.memory_allocated drops by what was moved ({freed / GiB:.3f} of {moved / GiB:.3f} GiB)")
        out.require(allocated_after == allocated_before,
                    f"onload restores the allocation exactly ({allocated_after} vs {allocated_before} bytes)")
    out.require(not differ, f"parameters and optimizer state bit-identical after onload "
                            f"({len(differ)} of {len(kept)} differ{': ' + ', '.join(differ[:3]) if differ else ''})")
    out.require(not nonzero_grads, f"main grads come back zeroed ({len(nonzero_grads)} not: "
                                   f"{', '.join(nonzero_grads[:3])})")
    out.require(finite(metrics["loss"], metrics["grad_norm"]), "a train step after onload is finite")
    return out
