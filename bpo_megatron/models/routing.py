"""Routed experts (R3) of a model, as engines report them and the trainer replays them: one
layout, one place.

Engines report routing over different layer axes: SGLang returns a row for every one of the
model's ``num_hidden_layers`` (dense layers included), the embedded engine and the trainer one per
MoE layer. :meth:`RoutingLayout.select` turns either into ``[positions, MoE layers, top-k]``, and
expert ids travel from there on (Ray, the driver, the trainer's micro-batches) in the smallest
integer type that holds them: ``uint8`` for up to 256 experts (Qwen3-30B-A3B has 128), four times
smaller than SGLang's int32 and eight times smaller than the int64 the routers index with; they
become int64 only on the trainer's device, right before replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bpo_megatron.models.hf_config import HFModelConfig


def expert_id_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype holding expert ids ``0 … num_experts − 1``."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    return torch.int32


class RoutingError(ValueError):
    """Routing an engine returned does not fit the model (never trained on)."""


def check_expert_ids(experts: torch.Tensor, *, num_experts: int, where: str, hint: str = "") -> None:
    """Expert ids ``[..., top-k]`` lie in ``[0, num_experts)`` and no position names an expert
    twice: what every router's top-k satisfies, so anything else is routing of another model or
    damaged data. One pass for the range and one sort of ``top-k`` ids per position."""
    if not experts.numel():
        return
    low, high = int(experts.min()), int(experts.max())
    if low < 0 or high >= num_experts:
        raise RoutingError(f"{where}: routed expert ids must lie in [0, {num_experts}), got [{low}, {high}]"
                           + (f"; {hint}" if hint else ""))
    if experts.shape[-1] > 1:
        ordered = experts.sort(dim=-1).values
        if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
            raise RoutingError(f"{where}: routed experts repeat an expert within one position's top-k")


@dataclass(frozen=True)
class RoutingLayout:
    """The model's MoE layers among its layers, its top-k and number of experts."""

    num_hidden_layers: int
    moe_layers: tuple[int, ...]
    topk: int
    num_experts: int

    @classmethod
    def of(cls, hf: HFModelConfig) -> RoutingLayout:
        return cls(num_hidden_layers=hf.num_hidden_layers, moe_layers=tuple(hf.moe_layers),
                   topk=hf.num_experts_per_tok, num_experts=hf.num_experts)

    @property
    def dtype(self) -> torch.dtype:
        return expert_id_dtype(self.num_experts)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def select(self, routed: torch.Tensor | np.ndarray, *, where: str = "routed experts") -> torch.Tensor:
        """``[positions, MoE layers, top-k]`` in :attr:`dtype` from routing over all layers
        (``[positions, num_hidden_layers, top-k]``) or over the MoE layers only."""
        array = torch.from_numpy(np.array(routed)) if isinstance(routed, np.ndarray) else routed
        if array.dim() != 3 or array.shape[2] != self.topk or \
                array.shape[1] not in (self.num_hidden_layers, self.num_moe_layers):
            raise RoutingError(f"{where}: shape {tuple(array.shape)}, expected [positions, {self.num_hidden_layers} "
                               f"layers (or its {self.num_moe_layers} MoE layers), top-{self.topk}]")
        if array.shape[1] != self.num_moe_layers:  # the full layer axis: keep the MoE layers' rows
            array = array[:, list(self.moe_layers)]
        check_expert_ids(array, num_experts=self.num_experts, where=where,
                         hint=f"the model has {self.num_experts} experts")
        return array.to(self.dtype).contiguous()

    def decode_int32(self, raw: bytes, *, where: str = "routed experts") -> torch.Tensor:
        """Raw little-endian int32 ``[positions, layers, top-k]`` (SGLang's wire format; layers:
        all of the model's), selected as :meth:`select` does."""
        row = 4 * self.num_hidden_layers * self.topk
        if len(raw) % row:
            raise RoutingError(f"{where}: {len(raw)} bytes, not a multiple of 4 x {self.num_hidden_layers} layers "
                               f"x top-{self.topk}")
        return self.select(np.frombuffer(raw, dtype="<i4").reshape(-1, self.num_hidden_layers, self.topk),
                           where=where)
