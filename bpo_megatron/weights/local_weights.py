"""This rank's parameters of a (possibly sharded) Megatron GPTModel, each resolved to its global
weight: which rule, which global layer and expert, and which tensor-parallel shard it is.

Global indices come from the modules themselves (``layer_number`` carries the pipeline offset,
``MoELayer.local_expert_indices`` the expert-parallel offset), so any pipeline split and any
expert-parallel size resolve the same way. Dense weights are split over the tensor-parallel group,
expert weights over the expert-tensor-parallel group. The grouped experts' stacked parameters are
resolved expert by expert, as views under ``SequentialMLP``'s names
(:func:`~bpo_megatron.models.grouped_experts.per_expert`), so both expert modules export and load
alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bpo_megatron.models.grouped_experts import per_expert
from bpo_megatron.weights.layouts import LAYOUTS
from bpo_megatron.weights.names import WeightKey, WeightRule, match_megatron_name


@dataclass(frozen=True)
class LocalWeight:
    name: str  # the Megatron parameter name
    rule: WeightRule
    key: WeightKey
    shard: int  # index of this rank's piece among num_shards (0 of 1 when not split)
    num_shards: int
    # a parameter (one expert's view of a stacked one), or a buffer of a rule that names one (``WeightRule.buffer``)
    param: torch.Tensor


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _tp_coordinates() -> dict[bool, tuple[int, int]]:
    """(rank, size) of the tensor-parallel split, for dense (False) and expert (True) weights."""
    from megatron.core import parallel_state as ps

    return {
        False: (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        True: (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()),
    }


def local_weights(model: torch.nn.Module) -> list[LocalWeight]:
    """Every parameter of this rank's model chunk and every buffer a rule names (the router's
    expert bias), resolved; unknown parameters are an error (other buffers, such as token counts,
    are state of the module, not weights)."""
    model = unwrap(model)
    layers = model.decoder.layers if hasattr(model, "decoder") else []
    coordinates = _tp_coordinates()
    resolved: list[LocalWeight] = []
    unknown: list[str] = []
    latent = bool(model.config.multi_latent_attention)

    def match(name: str) -> tuple[WeightRule, int, int] | None:
        return match_megatron_name(name, latent_attention=latent)

    weights = [(name, param, match(name), False) for name, param in per_expert(model)]
    weights += [(name, buffer, match(name), True) for name, buffer in model.named_buffers()]
    for name, param, found, is_buffer in weights:
        if found is None or found[0].buffer != is_buffer:
            if not is_buffer:
                unknown.append(name)
            continue
        rule, local_layer, local_expert = found
        layer = layers[local_layer].layer_number - 1 if local_layer >= 0 else -1
        expert = (layers[local_layer].mlp.local_expert_indices[local_expert]
                  if local_expert >= 0 else -1)
        shard, num_shards = coordinates[rule.is_expert] if LAYOUTS[rule.layout].splits else (0, 1)
        resolved.append(LocalWeight(name, rule, (rule.name, layer, expert), shard, num_shards, param))
    if unknown:
        raise ValueError("parameters with no Hugging Face counterpart (not a model "
                         f"built by bpo_megatron.models?): {', '.join(unknown)}")
    return resolved
