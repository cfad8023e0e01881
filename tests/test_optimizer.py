"""Megatron-Core's DDP and optimizer on CPU, as set up by ``bpo_megatron.trainer.optimizer``.

At world size 1 one step of the tiny MoE GPT through DDP, ``finalize_model_grads`` and Megatron's
optimizer must equal plain PyTorch: ``clip_grad_norm_`` and ``torch.optim.AdamW`` with Megatron's
no-weight-decay set (biases and 1-D params). Every parallel layout must then reproduce the
world-size-1 step on the same global batch: same grad norm, same parameters afterwards (each
layout saves a distributed checkpoint that is loaded back at world size 1).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import tiny_gpt as tg
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.trainer.optimizer import OptimizerSettings

WORLD_TIMEOUT_S = 120.0
NORM_REL_TOL = 1e-5
PARAM_REL_TOL = 1e-6
# A large lr makes the step visible far above PARAM_REL_TOL; the clip is far below the tiny
# model's grad norm (~1.25), so clipping is active. eps is raised from the paper's 1e-8: Adam's
# first step is lr·g/(|g| + eps) per element, which turns the fp32 roundoff of a layout's
# reduction order in a near-zero gradient element (|δg| ~ 1e-10 here) into an update difference
# of up to lr·|δg|/eps: ~3e-6 of a weight matrix at eps=1e-8 under TP=2. At eps=1e-4 what is
# left is the roundoff of the gradients themselves (≤ ~4e-7 relative, sequence-parallel norms).
SETTINGS = OptimizerSettings(lr=1e-3, betas=(0.9, 0.98), eps=1e-4, weight_decay=0.1, grad_clip=0.05)
# The global batch of a step: two micro-batches, split over data-parallel ranks.
GLOBAL_BATCH_SEEDS = (0, 1)


def rel_diff(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-12)


def tensor_rel_diff(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value - reference).norm() / reference.norm().clamp_min(1e-12)).item()


def assert_params_match(
    params: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor],
) -> None:
    """Every parameter equals the reference within PARAM_REL_TOL, and the step moved it by far
    more than that (so the comparison says something about the update)."""
    assert params.keys() == reference.keys()
    for name, ref in reference.items():
        assert tensor_rel_diff(params[name], ref) <= PARAM_REL_TOL, name
        assert tensor_rel_diff(ref, initial[name]) > 50 * PARAM_REL_TOL, name


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's default: biases and 1-D params (norm weights) are not weight-decayed."""
    return name.endswith(".bias") or param.dim() == 1


def named_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


# --------------------------------------------------------------------------------------------
# Rank functions (module level so that the gloo ranks can import them)
# --------------------------------------------------------------------------------------------


def _torch_reference_rank() -> dict[str, Any]:
    """Two steps (micro-batches 0, then 1) through DDP + Megatron's optimizer and through plain
    PyTorch; the second step uses Adam's moments and zero_grad()."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    from bpo_megatron.trainer.optimizer import build_optimizer, wrap_ddp, zero_grad

    layout = tg.Layout()
    tg.init_parallel(layout)
    model = tg.build_tiny_gpt(layout)
    reference = tg.build_tiny_gpt(layout)
    reference.load_state_dict(model.state_dict())  # a plain torch copy of the same weights
    initial = named_params(model)

    [ddp] = wrap_ddp([model], model.config)
    optimizer = build_optimizer(SETTINGS, [ddp])
    names = {param: name for name, param in model.named_parameters()}
    megatron_no_decay = sorted(
        names[param]
        for group in optimizer.param_groups
        if group["weight_decay"] == 0.0
        for param in group["params"]
    )
    decay = [p for n, p in reference.named_parameters() if not no_decay(n, p)]
    keep = [p for n, p in reference.named_parameters() if no_decay(n, p)]
    torch_adamw = torch.optim.AdamW(
        [{"params": decay}, {"params": keep, "weight_decay": 0.0}],
        lr=SETTINGS.lr, betas=SETTINGS.betas, eps=SETTINGS.eps,
        weight_decay=SETTINGS.weight_decay,
    )

    steps = []
    for seed in (0, 1):
        batch = tg.make_batch(seed)
        zero_grad([ddp], optimizer)
        tg.forward_losses(ddp, batch).mean().backward()
        finalize_model_grads([ddp])
        update_successful, grad_norm, num_zeros = optimizer.step()

        torch_adamw.zero_grad()
        tg.forward_losses(reference, batch).mean().backward()
        pre_clip_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), SETTINGS.grad_clip)
        torch_adamw.step()
        steps.append({
            "update_successful": update_successful,
            "grad_norm": grad_norm,
            "num_zeros": num_zeros,
            "torch_pre_clip_norm": pre_clip_norm.item(),
        })

    result = {
        "optimizers": [type(opt).__name__ for opt in optimizer.chained_optimizers],
        "megatron_no_decay": megatron_no_decay,
        "torch_no_decay": sorted(n for n, p in reference.named_parameters() if no_decay(n, p)),
        "steps": steps,
        "count_zeros": optimizer.count_zeros(),
        "torch_zeros": sum(int((p.grad == 0).sum()) for p in reference.parameters()),
        # after step() the optimizer's .grad aliases DDP's main grads, clipped in place
        "clipped_grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "torch_clipped_grads": {n: p.grad.clone() for n, p in reference.named_parameters()},
        "initial": initial,
        "params": named_params(model),
        "torch_params": named_params(reference),
    }
    parallel_state.destroy_model_parallel()
    return result


def _layout_step_rank(
    layout: tg.Layout,
    initial_checkpoint: str,
    final_checkpoint: str,
    save_initial: bool,
    settings: OptimizerSettings = SETTINGS,
) -> dict[str, Any]:
    """One optimizer step on the global batch through Megatron's schedule: this rank runs its
    data-parallel share of the micro-batches. Writes the stepped model to ``final_checkpoint``."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from bpo_megatron.trainer.optimizer import build_optimizer, wrap_ddp, zero_grad

    tg.init_parallel(layout)
    model = tg.build_tiny_gpt(layout)
    if save_initial:
        tg.save_checkpoint(model, Path(initial_checkpoint))
    else:
        tg.load_checkpoint(model, Path(initial_checkpoint))
    initial = named_params(model)

    [ddp] = wrap_ddp([model], model.config, distributed=settings.distributed)
    optimizer = build_optimizer(settings, [ddp])
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    seeds = GLOBAL_BATCH_SEEDS[dp_rank::dp_size]

    zero_grad([ddp], optimizer)
    get_forward_backward_func()(
        forward_step_func=tg.mean_loss_forward_step,
        data_iterator=iter([tg.make_batch(seed) for seed in seeds]),
        model=[ddp],
        num_microbatches=len(seeds),
        seq_length=tg.SEQ_LENGTH,
        micro_batch_size=tg.MICRO_BATCH_SIZE,
        forward_only=False,
    )  # reduces the gradients at its end (wrap_ddp set finalize_model_grads_func)
    update_successful, grad_norm, _ = optimizer.step()
    tg.save_checkpoint(model, Path(final_checkpoint))
    result = {
        "optimizers": [type(opt).__name__ for opt in optimizer.chained_optimizers],
        "update_successful": update_successful,
        "grad_norm": grad_norm,
        "dp_size": dp_size,
        "micro_batches": len(seeds),
        "initial": initial,
        "params": named_params(model),
    }
    parallel_state.destroy_model_parallel()
    return result


def _load_params_rank(checkpoint: str) -> dict[str, torch.Tensor]:
    """The parameters of a checkpoint, loaded into the world-size-1 model."""
    from megatron.core import parallel_state

    layout = tg.Layout()
    tg.init_parallel(layout)
    model = tg.build_tiny_gpt(layout)
    tg.load_checkpoint(model, Path(checkpoint))
    params = named_params(model)
    parallel_state.destroy_model_parallel()
    return params


def _gpu_path_configs_rank() -> dict[str, Any]:
    """The Megatron configs chosen when a GPU is present (this process pretends to own one)."""
    import dataclasses

    from bpo_megatron import platform
    from bpo_megatron.trainer import optimizer as trainer_optimizer

    platform.has_cuda = lambda: True
    bf16 = dataclasses.replace(tg.tiny_config(tg.Layout()), bf16=True, params_dtype=torch.bfloat16)
    ddp = trainer_optimizer.ddp_config()
    opt = trainer_optimizer.optimizer_config(SETTINGS, bf16)
    return {
        "ddp": {k: getattr(ddp, k) for k in ("use_distributed_optimizer", "overlap_grad_reduce",
                                             "grad_reduce_in_fp32", "average_in_collective", "bucket_size")},
        "opt": {k: getattr(opt, k) for k in ("use_distributed_optimizer", "bf16", "params_dtype",
                                             "main_params_dtype", "decoupled_weight_decay",
                                             "clip_grad", "adam_beta2")},
    }


def _cpu_refuses_bf16_rank() -> str:
    import dataclasses

    from bpo_megatron.trainer.optimizer import optimizer_config

    bf16 = dataclasses.replace(tg.tiny_config(tg.Layout()), bf16=True, params_dtype=torch.bfloat16)
    with pytest.raises(ValueError) as error:
        optimizer_config(SETTINGS, bf16)
    return str(error.value)


def _optimizer_patch_targets() -> dict[str, Any]:
    """The optimizer-stack objects the compat layer replaces, by a readable name."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as mcore_optimizer

    return {
        "optimizer.torch": mcore_optimizer.torch,
        "optimizer.clip_grad_by_total_norm_fp32": mcore_optimizer.clip_grad_by_total_norm_fp32,
        "clip_grads.torch": clip_grads.torch,
        "clip_grads.l2_norm_impl": clip_grads.l2_norm_impl,
        "clip_grads.clip_grad_by_total_norm_fp32": clip_grads.clip_grad_by_total_norm_fp32,
    }


def _compat_calls_rank(pretend_cuda: bool) -> dict[str, list[str]]:
    from bpo_megatron.megatron import ensure_megatron_cpu_compat

    if pretend_cuda:
        torch.cuda.is_available = lambda: True
    before = _optimizer_patch_targets()
    ensure_megatron_cpu_compat()
    after_first = _optimizer_patch_targets()
    ensure_megatron_cpu_compat()
    after_second = _optimizer_patch_targets()
    return {
        "replaced": [name for name in before if before[name] is not after_first[name]],
        "changed_by_second_call": [
            name for name in after_first if after_first[name] is not after_second[name]
        ],
    }


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_step(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """World size 1: write the initial checkpoint and take the reference step."""
    root = tmp_path_factory.mktemp("optimizer_step")
    initial = str(root / "initial")
    [result] = run_gloo_world(
        _layout_step_rank, 1, tg.Layout(), initial, str(root / "final"), True,
        timeout=WORLD_TIMEOUT_S,
    )
    result["initial_checkpoint"] = initial
    return result


def test_world_size_one_steps_match_torch_adamw() -> None:
    [out] = run_gloo_world(_torch_reference_rank, 1, timeout=WORLD_TIMEOUT_S)
    # without expert parallelism the experts are ordinary data-parallel params
    assert out["optimizers"] == ["FP32Optimizer"]
    assert out["megatron_no_decay"] == out["torch_no_decay"]
    assert any("layernorm" in name for name in out["megatron_no_decay"])
    for step in out["steps"]:
        assert step["update_successful"] is True
        assert step["num_zeros"] is None  # counting zeros is off by default
        assert step["torch_pre_clip_norm"] > 10 * SETTINGS.grad_clip  # clipping is active
        assert rel_diff(step["grad_norm"], step["torch_pre_clip_norm"]) <= PARAM_REL_TOL
    # the embedding rows of tokens absent from the batch have exactly zero gradient
    assert out["count_zeros"] == out["torch_zeros"] > 0
    clipped = torch.cat([g.flatten() for g in out["clipped_grads"].values()]).norm().item()
    assert rel_diff(clipped, SETTINGS.grad_clip) <= 1e-5
    for name, grad in out["torch_clipped_grads"].items():
        assert tensor_rel_diff(out["clipped_grads"][name], grad) <= PARAM_REL_TOL, name
    assert_params_match(out["params"], out["torch_params"], out["initial"])


def _check_layout(
    reference: dict[str, Any], layout: tg.Layout, tmp_path: Path, *, dp_size: int,
    settings: OptimizerSettings = SETTINGS,
) -> list[dict[str, Any]]:
    final = str(tmp_path / "final")
    ranks = run_gloo_world(
        _layout_step_rank, 2, layout, reference["initial_checkpoint"], final, False, settings,
        timeout=WORLD_TIMEOUT_S,
    )
    for out in ranks:
        assert out["dp_size"] == dp_size
        assert out["micro_batches"] == len(GLOBAL_BATCH_SEEDS) // dp_size
        assert out["update_successful"] is True
        assert rel_diff(out["grad_norm"], reference["grad_norm"]) <= NORM_REL_TOL
    [params] = run_gloo_world(_load_params_rank, 1, final, timeout=WORLD_TIMEOUT_S)
    assert_params_match(params, reference["params"], reference["initial"])
    return ranks


def test_reference_step_clips(reference_step) -> None:
    assert reference_step["update_successful"] is True
    assert reference_step["grad_norm"] > 10 * SETTINGS.grad_clip


def test_tensor_parallel_step_matches_world_size_one(reference_step, tmp_path) -> None:
    _check_layout(reference_step, tg.Layout(tp=2), tmp_path, dp_size=1)


def test_expert_parallel_step_matches_world_size_one(reference_step, tmp_path) -> None:
    # EP=2 on two ranks is also DP=2 for the dense params: each rank takes half the batch.
    # Expert params get their own optimizer: their grads are reduced over the expert-data-parallel
    # group (size 1 here) and their norm over the expert model-parallel group.
    ranks = _check_layout(reference_step, tg.Layout(ep=2), tmp_path, dp_size=2)
    assert all(out["optimizers"] == ["FP32Optimizer", "FP32Optimizer"] for out in ranks)


def test_data_parallel_step_matches_world_size_one(reference_step, tmp_path) -> None:
    _check_layout(reference_step, tg.Layout(), tmp_path, dp_size=2)


def test_distributed_optimizer_on_cpu_step_matches_world_size_one(reference_step, tmp_path) -> None:
    # optimizer.distributed: true on a CPU: Megatron's distributed optimizer in fp32, each of the
    # two data-parallel ranks updating its half of the state (gradients reduce-scattered, the
    # parameters all-gathered over gloo); the step equals the unsharded fp32 optimizer's
    import dataclasses

    sharded = dataclasses.replace(SETTINGS, distributed=True)
    ranks = _check_layout(reference_step, tg.Layout(), tmp_path, dp_size=2, settings=sharded)
    assert all(out["optimizers"] == ["DistributedOptimizer"] for out in ranks)


def test_pipeline_parallel_step_matches_world_size_one(reference_step, tmp_path) -> None:
    _check_layout(reference_step, tg.Layout(pp=2), tmp_path, dp_size=1)


def test_gpu_path_uses_distributed_optimizer_with_fp32_master_weights() -> None:
    [out] = run_gloo_world(_gpu_path_configs_rank, 1, timeout=WORLD_TIMEOUT_S)
    assert out["ddp"] == {
        "use_distributed_optimizer": True, "overlap_grad_reduce": True,
        "grad_reduce_in_fp32": True, "average_in_collective": False,
        # the distributed optimizer's checkpoint follows the buckets: their size does not depend on DP
        "bucket_size": 40_000_000,
    }
    assert out["opt"] == {
        "use_distributed_optimizer": True, "bf16": True, "params_dtype": torch.bfloat16,
        "main_params_dtype": torch.float32, "decoupled_weight_decay": True,
        "clip_grad": SETTINGS.grad_clip, "adam_beta2": SETTINGS.betas[1],
    }


def test_cpu_path_refuses_half_precision_models() -> None:
    [message] = run_gloo_world(_cpu_refuses_bf16_rank, 1, timeout=WORLD_TIMEOUT_S)
    assert "bf16=False" in message


def test_optimizer_compat_patches_apply_once_and_only_without_cuda() -> None:
    [cpu] = run_gloo_world(_compat_calls_rank, 1, False, timeout=WORLD_TIMEOUT_S)
    assert cpu["replaced"] == [
        "optimizer.torch",
        "optimizer.clip_grad_by_total_norm_fp32",
        "clip_grads.torch",
        "clip_grads.l2_norm_impl",
        "clip_grads.clip_grad_by_total_norm_fp32",
    ]
    assert cpu["changed_by_second_call"] == []
    [gpu] = run_gloo_world(_compat_calls_rank, 1, True, timeout=WORLD_TIMEOUT_S)
    assert gpu == {"replaced": [], "changed_by_second_call": []}



@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lr", 0.0, "optimizer.lr must be > 0"),
        ("lr", -1e-6, "optimizer.lr must be > 0"),
        ("betas", (0.9, 1.0), "optimizer.betas must be two values in [0, 1)"),
        ("betas", (0.9,), "optimizer.betas must be two values in [0, 1)"),
        ("eps", 0.0, "optimizer.eps must be > 0"),
        ("weight_decay", -0.1, "optimizer.weight_decay must be >= 0"),
        ("grad_clip", 0.0, "optimizer.grad_clip must be > 0"),
    ],
)
def test_settings_validation_names_the_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        OptimizerSettings(**{field: value})


def test_settings_defaults_are_the_papers() -> None:
    settings = OptimizerSettings()
    assert (settings.lr, settings.betas, settings.eps) == (1e-6, (0.9, 0.98), 1e-8)
    assert (settings.weight_decay, settings.grad_clip) == (0.1, 1.0)
    assert OptimizerSettings(grad_clip=math.inf).grad_clip == math.inf
