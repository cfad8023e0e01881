"""The local spec's MoE experts as two stacked parameters and two grouped GEMMs per layer.

Megatron's ``SequentialMLP`` (the experts module of the local spec, used whenever
transformer-engine is absent) holds one ``MLP`` per local expert, reads ``tokens_per_expert`` on the
host (``tolist``) and runs each expert on its slice of the permuted tokens: one host sync and a
handful of ops per expert per layer, in forward and backward, and two parameters per expert, each
with its own gradient hook and optimizer entry (1,024 of the kit model's 1,139 parameters).
:class:`GroupedSequentialMLP` computes the same function with one parameter per projection and layer,
``fc1_weight`` ``[E_local, ffn·(2 if gated)/etp, h]`` and ``fc2_weight`` ``[E_local, h, ffn/etp]``
(expert ``e``'s slice is exactly the weight ``local_experts.{e}.linear_fc1/2`` holds), and two
``torch._grouped_mm`` calls whose group offsets are the cumulative token counts, kept on the
tokens' device (no ``tolist``).

It is built from Megatron's own ``SequentialMLP`` (same random draws, so a seed gives the same
weights either way), whose experts' weights are stacked once; every attribute Megatron's DDP,
optimizer, grad norm and TP code read from those weights (``allreduce``, which puts them in the
expert-data-parallel buffers under expert parallelism; ``tensor_model_parallel``,
``partition_stride``; ``partition_dim`` moved past the new expert axis) is carried over. What the
rest of the project sees by name is ``SequentialMLP``'s: the sharded state dict
(:mod:`~bpo_megatron.models.stacked_expert_state`; distributed checkpoints load either way), and the
per-expert views :func:`per_expert` gives the HF weight map, export, weight sync and loaders.

Same numerics up to summation order: fc1, the (gated) activation with the clamp and offset Megatron
applies, the routing probabilities multiplied after the activation in the same dtype order, fc2.
Expert tensor parallelism needs no code here: with ``expert_tensor_parallel_size > 1`` (or expert
parallelism) the expert linears skip their own communication (``explicit_expert_comm``) and the
token dispatcher gathers and reduce-scatters, so each rank multiplies by its local shards exactly as
the experts' linears would. What the grouped path does not compute (biases, fp8/fp4 padding,
transformer-engine activations, fused bias-activation kernels, delayed weight-gradient
computation, other linear modules) is refused when the module is built.

``_grouped_mm`` saves the stacked parameters themselves for its backward (no copy) and the int32
group offsets. ``torch._grouped_mm`` takes any float dtype on CPU; on CUDA it has a bf16 kernel on
sm90+ and loops over the groups otherwise, and wants its operands 16-byte aligned: a parameter's
own allocation is, and so is its place in DDP's parameter buffer (the distributed optimizer starts
every parameter at a multiple of 64 elements).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP

from bpo_megatron.models import stacked_expert_state


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: ``_grouped_mm``'s backward refuses
    the zero-stride (expanded) gradients that e.g. a ``sum()`` produces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.contiguous()


class GroupedSequentialMLP(MegatronModule):
    """``SequentialMLP``'s function, initial weights and checkpoints with the local experts' weights
    held as two stacked parameters and run as two ``torch._grouped_mm`` calls (module docstring)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, **kwargs):
        experts = SequentialMLP(num_local_experts, config, submodules, pg_collection, **kwargs)
        super().__init__(config=experts.config)  # SequentialMLP's copy with ffn_hidden_size = moe_ffn_hidden_size
        _check_supported(experts)
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = experts.ep_group, experts.tp_group, experts.dp_group
        local = experts.local_experts
        self.fc1_weight = _stacked([expert.linear_fc1.weight for expert in local])  # [E, ffn(x2)/etp, h]
        self.fc2_weight = _stacked([expert.linear_fc2.weight for expert in local])  # [E, h, ffn/etp]
        # SequentialMLP's linears write an (empty) extra state per expert; it comes back at load
        self.register_load_state_dict_post_hook(stacked_expert_state.accept_extra_states)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """``SequentialMLP``'s sharded state dict: per expert, the same keys, shapes, offsets and
        replica ids, each expert's tensors views of the stacked parameters."""
        return stacked_expert_state.sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """The experts' outputs for the permuted tokens (grouped by expert, ``tokens_per_expert``
        rows each) and no bias, as ``SequentialMLP.forward`` returns them."""
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
        intermediate = _ContiguousGrad.apply(torch._grouped_mm(hidden, self.fc1_weight.transpose(1, 2),
                                                               offs=offsets))
        if config.gated_linear_unit:
            x_glu, x_linear = torch.chunk(intermediate, 2, dim=-1)
            if (val := getattr(config, "activation_func_clamp_value", None)) is not None:
                x_glu = x_glu.clamp(min=None, max=val)
                x_linear = x_linear.clamp(min=-val, max=val)
            intermediate = config.activation_func(x_glu) * (x_linear + getattr(config, "glu_linear_offset", 0.0))
        else:
            intermediate = config.activation_func(intermediate)
        intermediate = (intermediate * permuted_probs.unsqueeze(-1)).to(intermediate.dtype)

        output = _ContiguousGrad.apply(torch._grouped_mm(intermediate, self.fc2_weight.transpose(1, 2),
                                                         offs=offsets))
        return output, None


def _stacked(weights: list[torch.nn.Parameter]) -> torch.nn.Parameter:
    """One parameter ``[E, out, in]`` of the experts' equal-shaped weights, with their attributes
    (the tensor-parallel split moved one axis on, past the experts)."""
    attributes = [dict(vars(weight)) for weight in weights]
    if any(a != attributes[0] for a in attributes):
        raise RuntimeError(f"the experts' weights carry different attributes: {attributes}")
    stacked = torch.nn.Parameter(torch.stack([weight.detach() for weight in weights]),
                                 requires_grad=weights[0].requires_grad)
    for name, value in attributes[0].items():
        setattr(stacked, name, value)
    if "partition_dim" in attributes[0]:
        stacked.partition_dim = attributes[0]["partition_dim"] + 1
    return stacked


def _check_supported(experts: SequentialMLP) -> None:
    config = experts.config
    refused = {
        "add_bias_linear=True (expert biases)": config.add_bias_linear,
        "fp8/fp4 (padded expert inputs)": bool(getattr(config, "fp8", None) or getattr(config, "fp4", None)),
        "use_te_activation_func=True": bool(getattr(config, "use_te_activation_func", False)),
        "bias_activation_fusion=True (fused activation kernels)": config.bias_activation_fusion,
        "delay_wgrad_compute=True": bool(getattr(config, "delay_wgrad_compute", False)),
    }
    unsupported = [name for name, on in refused.items() if on]
    for expert in experts.local_experts:
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


def per_expert(model: torch.nn.Module, named=None):
    """``(name, tensor)`` for every parameter of ``model`` (or of ``named``, pairs of its parameter
    names and tensors shaped like them, e.g. gradients or optimizer moments), each layer's stacked
    experts' parameters as their local experts' slices (detached views) under ``SequentialMLP``'s
    names and in its order (``….local_experts.{e}.linear_fc1.weight``, then ``linear_fc2``, expert by
    expert): the names the HF weight map, the export and the loaders resolve, and by which a
    grouped model compares with a sequential one."""
    stacked: dict[str, tuple[str, int]] = {}  # stacked parameter's name -> (its module's name prefix, local experts)
    for prefix, module in model.named_modules():
        if isinstance(module, GroupedSequentialMLP):
            at = f"{prefix}." if prefix else ""
            stacked.update({at + name: (at, module.num_local_experts) for name in stacked_expert_state.STACKED.values()})
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in model.named_parameters() if named is None else named:
        if name not in stacked:
            yield name, tensor
            continue
        at, experts = stacked[name]
        mine = held.setdefault(at, {})
        mine[name[len(at):]] = tensor.detach()
        if len(mine) < len(stacked_expert_state.STACKED):
            continue
        for e in range(experts):
            for linear, param in stacked_expert_state.STACKED.items():
                yield f"{at}local_experts.{e}.{linear}.weight", mine[param][e]
        del held[at]
