"""The local spec's MoE experts as two grouped GEMMs instead of a Python loop over experts.

Megatron's ``SequentialMLP`` (the experts module of the local spec, used whenever
transformer-engine is absent) reads ``tokens_per_expert`` on the host (``tolist``) and runs each
local expert's ``MLP`` on its slice of the permuted tokens: one host sync and a handful of ops per
expert per layer, in forward and backward. :class:`GroupedSequentialMLP` keeps ``SequentialMLP``'s
modules and parameters as they are (``local_experts.{e}.linear_fc1/2.weight``: the same names,
shapes and sharded state dict, so converters and distributed checkpoints do not change) and
computes the same function with ``torch._grouped_mm``: the experts' weights are stacked at forward
time (``torch.stack``, which autograd routes back to each expert's weight) and the group offsets are
the cumulative token counts, kept on the tokens' device (no ``tolist``).

Same numerics up to summation order: fc1, the (gated) activation with the clamp and offset Megatron
applies, the routing probabilities multiplied after the activation in the same dtype order, fc2.
Expert tensor parallelism needs no code here: with ``expert_tensor_parallel_size > 1`` (or expert
parallelism) the expert linears skip their own communication (``explicit_expert_comm``) and the
token dispatcher gathers and reduce-scatters, so each rank multiplies by its local shards exactly as
the experts' linears would. What the grouped path does not compute (biases, fp8/fp4 padding,
transformer-engine activations, fused bias-activation kernels, delayed weight-gradient
computation, other linear modules) is refused when the module is built.

Cost of the stacking: each forward copies the layer's local expert weights once (``torch.stack``)
and ``_grouped_mm`` keeps the stacked copy for its backward, so a micro-batch in flight holds one
extra copy of every layer's local expert weights until its backward (the parameters themselves and
their gradients are unchanged). ``torch._grouped_mm`` takes any float dtype on CPU; on CUDA it has a
bf16 kernel on sm90+ and loops over the groups otherwise.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: ``_grouped_mm``'s backward refuses
    the zero-stride (expanded) gradients that e.g. a ``sum()`` produces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.contiguous()


class GroupedSequentialMLP(SequentialMLP):
    """``SequentialMLP`` whose forward runs all local experts as two ``torch._grouped_mm`` calls
    (same parameters and parameter names; see the module docstring)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, **kwargs):
        super().__init__(num_local_experts, config, submodules, pg_collection, **kwargs)
        self._check_supported()

    def _check_supported(self) -> None:
        config = self.config
        refused = {
            "add_bias_linear=True (expert biases)": config.add_bias_linear,
            "fp8/fp4 (padded expert inputs)": bool(getattr(config, "fp8", None) or getattr(config, "fp4", None)),
            "use_te_activation_func=True": bool(getattr(config, "use_te_activation_func", False)),
            "bias_activation_fusion=True (fused activation kernels)": config.bias_activation_fusion,
            "delay_wgrad_compute=True": bool(getattr(config, "delay_wgrad_compute", False)),
        }
        unsupported = [name for name, on in refused.items() if on]
        for expert in self.local_experts:
            fc1, fc2 = expert.linear_fc1, expert.linear_fc2
            if type(fc1) is not ColumnParallelLinear or type(fc2) is not RowParallelLinear:
                unsupported.append(f"expert linears {type(fc1).__name__}/{type(fc2).__name__} "
                                   "(only the local spec's ColumnParallelLinear/RowParallelLinear)")
                break
            if fc1.bias is not None or fc2.bias is not None:
                unsupported.append("expert linear biases")
                break
        if unsupported:
            raise ValueError("GroupedSequentialMLP (grouped-GEMM experts of the local spec) does not support "
                             + "; ".join(unsupported) + " — use Megatron's SequentialMLP for these")

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """The experts' outputs for the permuted tokens (grouped by expert, ``tokens_per_expert``
        rows each) and no bias, as ``SequentialMLP.forward`` returns them."""
        if self.num_local_experts == 1:  # one plain MLP call and no host sync already
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        config = self.config
        hidden = permuted_local_hidden_states
        if config.moe_apply_probs_on_input:
            if config.moe_router_topk != 1:
                raise ValueError("`moe_apply_probs_on_input` only works with `moe_router_topk`=1.")
            hidden = (permuted_probs.unsqueeze(-1) * hidden).to(permuted_local_hidden_states.dtype)
            permuted_probs = torch.ones_like(permuted_probs)

        if not torch.is_tensor(tokens_per_expert):
            tokens_per_expert = torch.tensor(tokens_per_expert)
        # offsets (group ends) on the tokens' device; a host count is summed on the host first
        offsets = torch.cumsum(tokens_per_expert, dim=0).to(device=hidden.device, dtype=torch.int32,
                                                           non_blocking=True)
        experts = self.local_experts
        fc1 = torch.stack([expert.linear_fc1.weight for expert in experts])  # [E, ffn(x2)/etp, h]
        fc2 = torch.stack([expert.linear_fc2.weight for expert in experts])  # [E, h, ffn/etp]

        intermediate = _ContiguousGrad.apply(torch._grouped_mm(hidden, fc1.transpose(1, 2), offs=offsets))
        if config.gated_linear_unit:
            x_glu, x_linear = torch.chunk(intermediate, 2, dim=-1)
            if (val := getattr(config, "activation_func_clamp_value", None)) is not None:
                x_glu = x_glu.clamp(min=None, max=val)
                x_linear = x_linear.clamp(min=-val, max=val)
            intermediate = config.activation_func(x_glu) * (x_linear + getattr(config, "glu_linear_offset", 0.0))
        else:
            intermediate = config.activation_func(intermediate)
        intermediate = (intermediate * permuted_probs.unsqueeze(-1)).to(intermediate.dtype)

        output = _ContiguousGrad.apply(torch._grouped_mm(intermediate, fc2.transpose(1, 2), offs=offsets))
        return output, None
