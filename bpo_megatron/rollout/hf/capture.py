"""Routed-expert capture (R3) in a transformers MoE model, by forward hooks on the routers.

The router of every supported family is ``layer.mlp.gate`` beside ``layer.mlp.experts``
(transformers 5's ``Qwen3MoeTopKRouter``, ``Glm4MoeTopkRouter``, ``DeepseekV3TopkRouter``) and returns
``(logits, weights, indices)`` with ``indices`` ``[tokens, top_k]``: the experts the layer actually
dispatches each token to, after any expert bias and group limit. A hook
writes them, without a host sync, into a per-batch buffer ``[rows, columns, moe_layers, top_k]``
whose columns are the left-padded token positions of the batch; the engine cuts each sample's real
positions out at the end. Rows are those of the batch's requests that want their routing
(``GenerationRequest.capture_routing``): a forward's other rows are not recorded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bpo_megatron.models.routing import expert_id_dtype


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router of every MoE layer, in layer order (dense layers have no ``mlp.gate``)."""
    return [layer.mlp.gate for layer in model.model.layers
            if isinstance(getattr(layer.mlp, "gate", None), nn.Module) and hasattr(layer.mlp, "experts")]


def num_routed_experts(routers: list[nn.Module]) -> int:
    """The experts each router chooses among (the rows of its weight ``[experts, hidden]``), read
    from the modules: the config names the count differently in each family."""
    return int(routers[0].weight.shape[0])


class RoutingCapture:
    """Hooks on the routers that record, while a batch is open, where each forward's tokens went."""

    def __init__(self, routers: list[nn.Module], *, topk: int, num_experts: int) -> None:
        if not routers:
            raise ValueError("routing capture needs a Mixture-of-Experts model; this one has no MoE layers")
        self.num_layers = len(routers)
        self.topk = topk
        self._dtype = expert_id_dtype(num_experts)
        self._buffer: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None  # None: every row of the buffer, in order
        self._select: torch.Tensor | None = None  # the forward's rows recorded; None: all of them
        self._columns = slice(0, 0)
        self._calls = 0
        self._handles = [router.register_forward_hook(self._hook(layer)) for layer, router in enumerate(routers)]

    def open(self, rows: int, columns: int, device: torch.device) -> None:
        self._buffer = torch.zeros(rows, columns, self.num_layers, self.topk, dtype=self._dtype, device=device)

    def target(self, rows: torch.Tensor | None, first_column: int, width: int,
               select: torch.Tensor | None = None) -> None:
        """Where the tokens of the next forward go: the forward's rows ``select`` (None: all) to
        buffer rows ``rows`` (None: every row, in order), columns from ``first_column``."""
        self._rows, self._select = rows, select
        self._columns = slice(first_column, first_column + width)
        self._calls = 0

    def check_forward(self) -> None:
        """Every MoE layer must have reported the forward just run, or the capture has holes."""
        if self._calls != self.num_layers:
            raise RuntimeError(f"routing capture saw {self._calls} of {self.num_layers} MoE routers in one "
                               "forward; the model's experts bypass `mlp.gate`")

    def close(self) -> torch.Tensor:
        buffer, self._buffer, self._rows, self._select = self._buffer, None, None, None
        return buffer

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int) -> Callable[[nn.Module, tuple, tuple], None]:
        def record(module: nn.Module, inputs: tuple, outputs: tuple) -> None:
            if self._buffer is None:  # a forward outside generation (e.g. a recompute): not ours
                return
            width = self._columns.stop - self._columns.start
            indices = outputs[2].view(-1, width, self.topk)
            if self._select is not None:
                indices = indices[self._select]
            indices = indices.to(self._dtype)
            if self._rows is None:
                self._buffer[:, self._columns, layer] = indices
            else:
                self._buffer[self._rows, self._columns, layer] = indices
            self._calls += 1
        return record
