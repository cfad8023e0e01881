"""Bytes per parameter of each kind of training state, as the trainer's optimizer path keeps them.

Matches :mod:`bpo_megatron.trainer.optimizer`:

* weights in the model's dtype (``model.params_dtype``: bf16 on GPUs, fp32 on CPU);
* gradients in Megatron DDP's main-grad buffers, always fp32 (``grad_reduce_in_fp32``);
* Adam's two moments in fp32, plus an fp32 master copy of the weights when they are bf16
  (Megatron's mixed-precision optimizer); fp32 weights are updated in place (``FP32Optimizer``);
* with the distributed optimizer (the GPU path) master weights and moments are sharded over data
  parallelism: dense parameters over DP, expert parameters over expert DP. The grad buffers are
  not sharded (they are reduce-scattered in place); Megatron pads them per bucket, by less than
  64 elements per parameter and lcm(dp, 128) per bucket, which is ignored here.
"""

from __future__ import annotations

from dataclasses import dataclass

from bpo_megatron.planner.params import StageParams

_DTYPE_BYTES = {"fp32": 4, "bf16": 2}
_FP32 = 4


@dataclass(frozen=True)
class Precision:
    param_bytes: int
    grad_bytes: int = _FP32
    master_bytes: int = 0
    moment_bytes: int = 2 * _FP32  # exp_avg and exp_avg_sq

    @classmethod
    def of(cls, params_dtype: str) -> Precision:
        param_bytes = _DTYPE_BYTES[params_dtype]
        return cls(param_bytes=param_bytes, master_bytes=0 if param_bytes == _FP32 else _FP32)

    @property
    def optimizer_bytes(self) -> int:
        """Optimizer state per parameter (master copy and moments)."""
        return self.master_bytes + self.moment_bytes


@dataclass(frozen=True)
class StaticMemory:
    """Bytes one rank holds for the whole run: weights, gradients and optimizer states."""

    weights: int
    grads: int
    optimizer_replicated: int  # every DP rank holds all of its parameters' states
    optimizer_distributed: int  # states sharded over DP / expert DP
    distributed: bool  # which of the two the trainer uses

    @property
    def optimizer(self) -> int:
        return self.optimizer_distributed if self.distributed else self.optimizer_replicated

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def static_memory(params: StageParams, precision: Precision, *, dp: int, expert_dp: int,
                  distributed_optimizer: bool) -> StaticMemory:
    # with the distributed optimizer each DP rank owns 1/dp of the dense and 1/expert_dp of the
    # expert parameters' states
    owned = -(-params.dense // dp) + -(-params.expert // expert_dp)
    return StaticMemory(weights=params.total * precision.param_bytes,
                        grads=params.total * precision.grad_bytes,
                        optimizer_replicated=params.total * precision.optimizer_bytes,
                        optimizer_distributed=owned * precision.optimizer_bytes,
                        distributed=distributed_optimizer)
