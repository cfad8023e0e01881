"""This rank's parameters of a (possibly sharded) Megatron GPTModel, each resolved to its global
weight: which rule, which global layer and expert, and which tensor-parallel shard it is.

Global indices come from the modules themselves (``layer_number`` carries the pipeline offset,
``MoELayer.local_expert_indices`` the expert-parallel offset), so any pipeline split and any
expert-parallel size resolve the same way. Dense weights are split over the tensor-parallel group,
expert weights over the expert-tensor-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bpo_megatron.weights.layouts import LAYOUTS
from bpo_megatron.weights.names import WeightKey, WeightRule, match_megatron_name


@dataclass(frozen=True)
class LocalWeight:
    name: str  # the Megatron parameter name
    rule: WeightRule
    key: WeightKey
    shard: int  # index of this rank's piece among num_shards (0 of 1 when not split)
    num_shards: int
    param: torch.nn.Parameter


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
    """Every parameter of this rank's model chunk, resolved; unknown parameters are an error."""
    model = unwrap(model)
    layers = model.decoder.layers if hasattr(model, "decoder") else []
    coordinates = _tp_coordinates()
    resolved: list[LocalWeight] = []
    unknown: list[str] = []
    for name, param in model.named_parameters():
        found = match_megatron_name(name)
        if found is None:
            unknown.append(name)
            continue
        rule, local_layer, local_expert = found
        layer = layers[local_layer].layer_number - 1 if local_layer >= 0 else -1
        expert = (layers[local_layer].mlp.local_expert_indices[local_expert]
                  if local_expert >= 0 else -1)
        shard, num_shards = coordinates[rule.is_expert] if LAYOUTS[rule.layout].splits else (0, 1)
        resolved.append(LocalWeight(name, rule, (rule.name, layer, expert), shard, num_shards, param))
    if unknown:
        raise ValueError("parameters with no Hugging Face counterpart (not a Qwen3 / Qwen3-MoE "
                         f"model built by bpo_megatron.models?): {', '.join(unknown)}")
    return resolved
