"""Megatron-Core's data-parallel wrapper and optimizer, set up for the platform we run on.

Two paths, chosen in :func:`_plan` from :mod:`bpo_megatron.platform` and nowhere else:

* GPU: the model's own precision (bf16 in practice) with fp32 master weights and Adam moments
  in Megatron's distributed optimizer (sharded over data parallelism), fp32 gradient reduction
  overlapped with the backward pass.
* CPU: fp32 throughout, one ``FP32Optimizer`` per parameter kind, gradients all-reduced
  synchronously. Needs ``bpo_megatron.megatron.ensure_megatron_cpu_compat()``.

``OptimizerSettings.distributed`` overrides the platform's choice of optimizer: ``true`` on a CPU
shards the fp32 moments over data parallelism with Megatron's distributed optimizer (gradients
reduce-scattered, parameters all-gathered over gloo), the optimizer and checkpoint format of the
GPU path; ``false`` on a GPU keeps every moment on every data-parallel rank.

Update rule. Megatron's ``"adam"`` with ``decoupled_weight_decay=True`` is AdamW: torch's
``torch.optim.AdamW`` without TE/apex (switched to torch's fused kernel, :func:`fuse_torch_adam`),
TE or apex ``FusedAdam(adam_w_mode=True)`` otherwise. Each step does
``p ← p·(1 − lr·wd) − lr·m̂/(√v̂ + eps)``, so the per-step decay is ``lr·wd``.
Biases and every 1-D parameter (norm weights) get no weight decay, Megatron's default grouping.
Megatron only applies that grouping (``wd_mult``) through its LR scheduler; we run without one,
so :func:`build_optimizer` applies it to the param groups itself.

Gradient scale over data parallelism. Megatron's DDP (``average_in_collective=False``) multiplies
every gradient by ``1/dp`` and then sums over the data-parallel group; expert gradients are
scaled by the same ``1/dp`` and summed over the smaller expert-data-parallel group (an expert
already received the tokens of all EP ranks through the all-to-all). The reduced gradient is the
average of the per-rank gradients. Megatron's schedules also divide each micro-batch loss (and
the MoE auxiliary loss) by the number of micro-batches, so per-micro-batch means give the
gradient of the global-batch mean when all micro-batches weigh the same. In general the step's
gradient is ``(1/dp)·Σ_ranks (1/M)·Σ_micro-batches ∇loss``: a micro-batch whose term weighs ``w``
of the global objective must return ``dp · M · w`` times that term (M micro-batches per rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from bpo_megatron import platform

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig
    from megatron.core.transformer import TransformerConfig


DDP_BUCKET_ELEMENTS = 40_000_000  # Megatron DDP's default bucket up to dp 40, kept at any dp (ddp_config)


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW hyper-parameters; the defaults are the paper's.

    ``grad_clip`` is the maximum global L2 norm of the gradient (``math.inf`` disables
    clipping; the norm is still computed and reported).
    """

    lr: float = 1e-6  # the learning rate (constant)
    betas: tuple[float, float] = (0.9, 0.98)  # AdamW's β1, β2
    eps: float = 1e-8  # AdamW's ε
    weight_decay: float = 0.1  # AdamW's decoupled weight decay
    grad_clip: float = 1.0
    # shard master weights and Adam moments over data parallelism (Megatron's distributed optimizer,
    # ZeRO-1); None: the platform's choice (on with GPUs, off on CPUs)
    distributed: bool | None = None

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"optimizer.betas must be two values in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ValueError(f"optimizer.eps must be > 0, got {self.eps}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        if not self.grad_clip > 0:
            raise ValueError(
                "optimizer.grad_clip must be > 0 (math.inf disables clipping), "
                f"got {self.grad_clip}"
            )


@dataclass(frozen=True)
class _Plan:
    """What differs between the GPU and the CPU path."""

    distributed_optimizer: bool  # master weights and moments sharded over data parallelism
    overlap_grad_reduce: bool  # gradient reduction runs during the backward pass
    half_precision_allowed: bool  # bf16/fp16 params need the mixed-precision optimizers


def _plan(distributed: bool | None = None) -> _Plan:
    """The platform's path; ``distributed`` (``OptimizerSettings.distributed``) overrides whether
    the optimizer is sharded over data parallelism."""
    if platform.has_cuda():
        return _Plan(distributed_optimizer=True if distributed is None else distributed,
                     overlap_grad_reduce=True, half_precision_allowed=True)
    # Megatron's mixed-precision optimizers accept only CUDA tensors (its distributed one runs in
    # fp32 on CPU with the compat layer, when asked for), and overlapping needs asynchronous
    # communication that gloo on a CPU gains nothing from.
    return _Plan(distributed_optimizer=bool(distributed), overlap_grad_reduce=False,
                 half_precision_allowed=False)


def ddp_config(distributed: bool | None = None) -> DistributedDataParallelConfig:
    """Megatron DDP settings for this platform (``distributed``: ``OptimizerSettings.distributed``)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    plan = _plan(distributed)
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,  # bf16 gradients summed over many ranks lose too much
        overlap_grad_reduce=plan.overlap_grad_reduce,
        # Parameter all-gathers stay synchronous (inside optimizer.step()): overlapped ones
        # complete only in the next forward pass, so weights exported to the rollout engine
        # right after a step would be stale.
        overlap_param_gather=False,
        use_distributed_optimizer=plan.distributed_optimizer,
        # Pre-scale by 1/dp and sum (see the module docstring); the trainer's loss relies on it.
        average_in_collective=False,
        # The distributed optimizer's checkpoint holds one tensor per gradient bucket
        # (optimizer_state.DP_SHARDS): buckets of a size that does not depend on DP keep it
        # loadable at any data-parallel size (Megatron's default grows them as 1e6 × dp above
        # dp 40). Without overlapped reduction Megatron makes one bucket per buffer anyway.
        bucket_size=DDP_BUCKET_ELEMENTS if plan.distributed_optimizer and plan.overlap_grad_reduce else None,
    )


def optimizer_config(
    settings: OptimizerSettings, transformer_config: TransformerConfig
) -> OptimizerConfig:
    """Megatron optimizer settings for this platform and the model's precision."""
    from megatron.core.optimizer import OptimizerConfig

    plan = _plan(settings.distributed)
    half = transformer_config.bf16 or transformer_config.fp16
    if half and not plan.half_precision_allowed:
        raise ValueError(
            "the CPU path trains in fp32: build the model with bf16=False and fp16=False "
            "(Megatron's mixed-precision optimizers need CUDA)"
        )
    return OptimizerConfig(
        optimizer="adam",
        decoupled_weight_decay=True,  # AdamW, also with TE/apex FusedAdam
        lr=settings.lr,
        min_lr=settings.lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.betas[0],
        adam_beta2=settings.betas[1],
        adam_eps=settings.eps,
        clip_grad=settings.grad_clip,
        bf16=transformer_config.bf16,
        fp16=transformer_config.fp16,
        params_dtype=transformer_config.params_dtype,
        use_distributed_optimizer=plan.distributed_optimizer,
    )


def wrap_ddp(
    model_chunks: Sequence[torch.nn.Module], transformer_config: TransformerConfig,
    *, distributed: bool | None = None,
) -> list[DistributedDataParallel]:
    """Wrap each model chunk in Megatron's DDP and hook the chunks into Megatron's schedules.

    As Megatron's own training loop does, ``transformer_config`` gets ``no_sync_func`` (and with
    overlapped reduction ``grad_sync_func``) and ``finalize_model_grads_func``; so
    ``forward_backward_func`` reduces the gradients itself at its end. Call
    ``finalize_model_grads(ddp_chunks)`` yourself only after a backward pass you ran directly.
    ``distributed``: ``OptimizerSettings.distributed`` (the optimizer built over the chunks must
    be given the same).
    """
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    config = ddp_config(distributed)
    chunks = [
        DistributedDataParallel(
            config=transformer_config,
            ddp_config=config,
            module=chunk,
            # Megatron buckets only the first chunk: the reduction of later (virtual pipeline)
            # chunks overlaps with the compute of earlier ones anyway.
            disable_bucketing=index > 0,
        )
        for index, chunk in enumerate(model_chunks)
    ]

    transformer_config.no_sync_func = _per_chunk([chunk.no_sync for chunk in chunks])
    if config.overlap_grad_reduce:
        # launch each chunk's reduction as soon as its last micro-batch's backward is done
        transformer_config.grad_sync_func = _per_chunk([chunk.start_grad_sync for chunk in chunks])
    transformer_config.finalize_model_grads_func = finalize_model_grads
    return chunks


def _per_chunk(funcs: list[Callable[..., Any]]) -> Callable[..., Any] | list[Callable[..., Any]]:
    # Megatron's schedules take one function for a single chunk and a list for virtual pipelining.
    return funcs[0] if len(funcs) == 1 else funcs


def build_optimizer(
    settings: OptimizerSettings, ddp_chunks: Sequence[DistributedDataParallel]
) -> MegatronOptimizer:
    """Megatron's optimizer over the DDP chunks (a ``ChainedOptimizer``: dense and, for MoE,
    expert parameters, each with their own grad-norm group).

    ``optimizer.step()`` returns ``(update_successful, grad_norm, num_zeros)``: ``grad_norm`` is
    the global pre-clip L2 norm over all model-parallel ranks, the same on every rank.
    """
    from megatron.core.optimizer import get_megatron_optimizer

    transformer_config = ddp_chunks[0].config
    sharded = _plan(settings.distributed).distributed_optimizer
    if any(chunk.ddp_config.use_distributed_optimizer != sharded for chunk in ddp_chunks):
        raise ValueError(f"optimizer.distributed={settings.distributed} asks for a {'' if sharded else 'non-'}"
                         "distributed optimizer over DDP chunks wrapped for the other kind: pass the same "
                         "value to wrap_ddp(distributed=...)")
    optimizer = get_megatron_optimizer(
        optimizer_config(settings, transformer_config), list(ddp_chunks)
    )
    # wd_mult is 0 for biases and 1-D params; Megatron's scheduler would fold it into each
    # group's weight_decay at every step, and without a scheduler nobody else does.
    for group in optimizer.param_groups:
        group["weight_decay"] = settings.weight_decay * group["wd_mult"]
    fuse_torch_adam(optimizer)
    # Megatron's schedules scale the loss with this (1 except for fp16 loss scaling).
    transformer_config.grad_scale_func = optimizer.scale_loss
    return optimizer


def fuse_torch_adam(optimizer: MegatronOptimizer) -> int:
    """Switch every torch ``Adam``/``AdamW`` inside ``optimizer`` (what Megatron builds without
    transformer-engine or apex, on a GPU as on a CPU) to torch's fused kernel, with a step counter
    of its own for every parameter, float32 on the parameter's device; returns how many it switched.

    Torch's default (single-tensor) Adam keeps each parameter's step counter on the host and reads
    it back (``.item()``) for every parameter at every step: one host read per parameter (145 of a
    step's 151 in ``bpo-megatron bench ops``, more with every parameter a model adds). The fused
    kernel updates every parameter of a device and dtype at once and reads nothing. The update
    rule is the same; the values agree within fp32 rounding order (``tests/test_optimizer.py``).

    Call it after the optimizer is built and after a state is loaded into it: a loaded param group
    takes the saved one's flags (a checkpoint written before the switch says ``fused=None``), and
    Megatron's distributed-optimizer loader hands every parameter one shared host step tensor,
    which any in-place ``step += 1`` would advance once per parameter.
    """
    switched = 0
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            continue  # transformer-engine's or apex's fused Adam, or none on this rank
        inner.defaults.update(fused=True, foreach=None)
        for group in inner.param_groups:
            group.update(fused=True, foreach=None)
            for param in group["params"]:
                state = inner.state.get(param, {})
                if "step" in state:
                    state["step"] = torch.as_tensor(state["step"]).to(device=param.device, dtype=torch.float32,
                                                                    copy=True)
        switched += 1
    return switched


def zero_grad(
    ddp_chunks: Sequence[DistributedDataParallel], optimizer: MegatronOptimizer
) -> None:
    """Clear gradients before the next step: DDP's main-grad buffers, where backward
    accumulates, and the ``.grad`` aliases the optimizer set on the params."""
    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


__all__ = [
    "OptimizerSettings",
    "build_optimizer",
    "ddp_config",
    "fuse_torch_adam",
    "optimizer_config",
    "wrap_ddp",
    "zero_grad",
]
