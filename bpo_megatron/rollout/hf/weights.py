"""The weights of a live transformers model, addressed by their Hugging Face on-disk names.

transformers 5 keeps the experts of a MoE layer (Qwen3-MoE, GLM-4.5) fused in memory: ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` holds, for expert ``e``, its gate rows ``[:I]`` followed by its up rows ``[I:]``, and
``mlp.experts.down_proj`` ``[E, H, I]`` stacks the down projections. Checkpoints are still written with
one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj``,
``down_proj`` ``[H, I]``), and those on-disk names are the wire format of weight sync. This module maps
every on-disk name to the view of the in-memory parameter it occupies, so a sync copies in place
without materialising the per-expert layout.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from bpo_megatron.weight_sync.delta import Sparse, scatter


def _fused_experts(module: nn.Module) -> bool:
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.ndim == 3):
        return False
    # The decorator of transformers' fused experts records the layout; only the one Qwen3-MoE
    # and GLM-4.5 use (gate and up concatenated, [out, in] per expert, no biases) is mapped here.
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True) \
            or getattr(module, "has_bias", False):
        raise ValueError(f"{type(module).__name__}: fused experts layout (transposed/interleaved/bias) "
                         "is not supported; expected gate_up_proj [E, 2I, H] and down_proj [E, H, I]")
    experts, double_inter, hidden = gate_up.shape
    if double_inter % 2 or tuple(down.shape) != (experts, hidden, double_inter // 2):
        raise ValueError(f"{type(module).__name__}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                         f"{tuple(down.shape)} do not form [E, 2I, H] / [E, H, I]")
    return True


def _expert_views(prefix: str, experts: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        yield f"{prefix}.{e}.gate_proj.weight", gate_up[e, :inter]
        yield f"{prefix}.{e}.up_proj.weight", gate_up[e, inter:]
        yield f"{prefix}.{e}.down_proj.weight", down[e]


def hf_weight_views(model: nn.Module) -> dict[str, torch.Tensor]:
    """On-disk name -> a view sharing storage with the model's parameter, in parameter order.

    Tied weights appear once, under the name ``save_pretrained`` writes (``named_parameters`` drops
    the duplicate, as saving does). Persistent buffers a checkpoint carries (a router's
    ``e_score_correction_bias``) follow the parameters; the rotary tables, which are not saved, do not.
    """
    fused = {name: module for name, module in model.named_modules() if _fused_experts(module)}
    views: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if owner in fused:
            if leaf == "gate_up_proj":  # emit all experts of the module once, at its first parameter
                views.update(_expert_views(owner, fused[owner]))
            continue
        views[name] = param.detach()
    saved = set(model.state_dict(keep_vars=True))
    views.update((name, buffer.detach()) for name, buffer in model.named_buffers() if name in saved)
    return views


class HFWeights:
    """Reads and overwrites a model's weights by on-disk name, refusing anything that does not fit."""

    def __init__(self, model: nn.Module) -> None:
        self._views = hf_weight_views(model)

    def names(self) -> list[str]:
        return list(self._views)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, live view); the views alias the model, clone them to keep a snapshot."""
        yield from self._views.items()

    def _view(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is None:
            raise ValueError(f"update_weights: {name!r} is not a weight of this model (expected Hugging "
                             f"Face on-disk names such as {next(iter(self._views))!r})")
        return view

    def load(self, name: str, tensor: torch.Tensor | Sparse) -> int:
        """Copy ``tensor`` into the weight called ``name`` (a :class:`Sparse` piece of a delta: its
        values at its indices); returns the bytes received. A fused weight (the experts'
        ``gate_up_proj``) is written through the view of its on-disk part, so a delta's flat
        indices are those of the on-disk tensor.

        Checks come first, so a refused tensor leaves the model untouched.
        """
        view = self._view(name)
        if isinstance(tensor, Sparse):  # a delta's changed elements (weight_sync.delta), written in place
            return scatter(view, tensor)
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"update_weights: {name!r} must be a floating-point tensor, got {kind}")
        if tensor.shape != view.shape:
            raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model "
                             f"expects {tuple(view.shape)}")
        with torch.no_grad():
            view.copy_(tensor)
        return tensor.numel() * tensor.element_size()
