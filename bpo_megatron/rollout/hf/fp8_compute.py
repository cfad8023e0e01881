"""The embedded engine computing as a block-FP8 server does (``rollout.hf.quantization=fp8``).

FP8 serving (SGLang's ``--quantization fp8`` with 128 × 128 weight blocks) holds each linear
layer's weight in e4m3 with block scales and quantizes the layer's input on the fly in 1 × 128
groups (w8a8). Installed on an engine's transformers model, this module makes every quantized
layer (:func:`bpo_megatron.weights.fp8.quantized`: attention q, k, v, o; the MLP's and the experts'
gate, up and down) compute so:

* a dense projection becomes :class:`Fp8Linear`: its weight (held rounded through e4m3, the
  parameter weight sync writes and fingerprints) is kept beside its e4m3 values and scales, and
  its product is :func:`bpo_megatron.weights.fp8.linear` — one block-scaled ``torch._scaled_mm``
  on a Hopper GPU, the exact emulation elsewhere;
* the fused experts become :class:`Fp8Experts`: their inputs (the tokens, and each expert's
  intermediate activations) are rounded through e4m3 in 1 × 128 groups and multiplied by the
  rounded weights with the grouped GEMM of the engine's dtype (torch has no grouped block-scaled
  FP8 GEMM: the numbers are FP8's, the speed is the dtype's).

Both are modules of the model, so the decode step and a teacher-forced forward of the same model
compute the same numbers. The e4m3 copies are refreshed in place at the end of every weight
update (their addresses are what a captured decode graph reads).
"""

from __future__ import annotations

import torch
from torch import nn

from bpo_megatron.weights import fp8


class Fp8Linear(nn.Module):
    """A bias-free or biased linear layer computing ``x @ Wᵀ`` in block FP8 (see the module)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same parameter: its name, storage and views are unchanged
        self.bias = linear.bias
        q, scale_inv = fp8.quantize(self.weight.detach())
        self.register_buffer("fp8_weight", q, persistent=False)
        self.register_buffer("fp8_scale_inv", scale_inv, persistent=False)

    @torch.no_grad()
    def refresh(self) -> None:
        """Quantize the (rounded) weight again into the e4m3 copy, in place."""
        q, scale_inv = fp8.quantize(self.weight.detach())
        self.fp8_weight.copy_(q)
        self.fp8_scale_inv.copy_(scale_inv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fp8.linear(x.reshape(-1, self.in_features), self.fp8_weight, self.fp8_scale_inv)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class Fp8Experts(nn.Module):
    """transformers' fused experts (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``,
    the same parameters) with their inputs rounded as FP8 serving quantizes them."""

    round_inputs = staticmethod(fp8.round_activations)  # what the decode step's grouped GEMM applies too

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn = experts.gate_up_proj, experts.down_proj, experts.act_fn
        self.num_experts = self.gate_up_proj.shape[0]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        from bpo_megatron.rollout.hf.decode import grouped_experts

        return grouped_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                               self.act_fn, round_inputs=self.round_inputs)


def install(model: nn.Module) -> list[Fp8Linear]:
    """Make ``model``'s quantized layers compute in block FP8 (weights already rounded: the engine
    rounds them at load); returns the :class:`Fp8Linear` layers, to refresh after a weight update."""
    layers: list[Fp8Linear] = []
    for name, module in list(model.named_modules()):
        parent_name, _, child = name.rpartition(".")
        if isinstance(module, nn.Linear) and fp8.quantized(f"{name}.weight"):
            replacement = Fp8Linear(module)
            layers.append(replacement)
        elif child == "experts" and isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) \
                and module.gate_up_proj.ndim == 3:
            replacement = Fp8Experts(module)
        else:
            continue
        setattr(model.get_submodule(parent_name), child, replacement)
    return layers
