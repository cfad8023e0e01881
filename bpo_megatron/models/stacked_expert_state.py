"""The stacked experts' distributed-checkpoint state, written exactly as Megatron's ``SequentialMLP``
writes its experts', so a checkpoint of either loads into the other at any layout.

``SequentialMLP`` writes, per local expert ``e`` (global index ``g``) and linear, the weight under
the key ``{prefix}experts.linear_fc1.weight`` with the expert as one more sharded axis (``g`` of
``E``), or under ``{prefix}experts.{g}.linear_fc1.weight`` with ``singleton_local_shards``; the gated
fc1 split into its gate and up halves by MLP's SwiGLU factory, each placed in the whole
``[gate; up]`` tensor; the TP split of the expert-TP group; replica ids ``(0, 0, expert-DP rank)``;
and an empty ``_extra_state`` object per linear. Here each stacked parameter is one
``ShardedTensorFactory`` (as Megatron's own ``GroupedMLP`` does) whose ``data`` is the parameter
itself, so Megatron's optimizers find it by identity and apply the same factory to their moments
(``optimizer.state.exp_avg.`` before the key); built, it yields those same per-expert entries with
each expert's slice as data, made by the very helpers ``SequentialMLP``, ``MLP`` and the linears
call; merged after a load, it stacks the experts' tensors back into the parameter's shape. The
extra-state objects are written as ``SequentialMLP`` writes them and accepted back at load.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

# the stacked parameter of each linear, and the axis of a linear's weight its TP split runs along
# (ColumnParallelLinear splits its output rows, RowParallelLinear its input columns)
STACKED = {"linear_fc1": "fc1_weight", "linear_fc2": "fc2_weight"}
_TP_AXIS = {"linear_fc1": 0, "linear_fc2": 1}
_EXTRA_STATE = re.compile(r"(^|\.)local_experts\.\d+\.linear_fc[12]\._extra_state$")


def sharded_state_dict(module, prefix: str, sharded_offsets: tuple, metadata: dict | None) -> dict[str, Any]:
    """The sharded state dict of ``module`` (a
    :class:`~bpo_megatron.models.grouped_experts.GroupedSequentialMLP`): one factory per stacked
    parameter and ``SequentialMLP``'s extra-state objects (module docstring)."""
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    state: dict[str, Any] = {}
    for linear, name in STACKED.items():
        param = getattr(module, name)
        rule = _ExpertWeights(module, linear, prefix, sharded_offsets, metadata)
        state[f"{prefix}{name}"] = ShardedTensorFactory(f"{prefix}experts.{linear}.weight", param, rule.build,
                                                        rule.merge, rule.replica_id(param))
        for e in range(module.num_local_experts):
            extra = f"{prefix}local_experts.{e}.{linear}._extra_state"
            state[extra] = _expert_entries(module, e, linear, param[e], prefix, sharded_offsets, metadata)[extra]
    return state


class _ExpertWeights:
    """Build and merge of one stacked parameter's factory: ``SequentialMLP``'s per-expert weight
    entries of whatever tensor the factory holds (the parameter, or an optimizer moment of its
    shape), and those entries stacked back."""

    def __init__(self, module, linear: str, prefix: str, sharded_offsets: tuple, metadata: dict):
        self.module, self.linear, self.prefix = module, linear, prefix
        self.sharded_offsets, self.metadata = sharded_offsets, metadata

    def _weight_entry(self, e: int, tensor: torch.Tensor):
        key = f"{self.prefix}local_experts.{e}.{self.linear}.weight"
        return _expert_entries(self.module, e, self.linear, tensor, self.prefix, self.sharded_offsets,
                               self.metadata)[key]

    def replica_id(self, param: torch.Tensor) -> tuple[int, ...]:
        """``SequentialMLP``'s replica id of an expert weight (the same for every local expert)."""
        return self._weight_entry(0, param[0]).replica_id

    def build(self, key: str, tensor: torch.Tensor, replica_id, flattened_range) -> list:
        if flattened_range is not None:
            raise ValueError(f"{key}: the stacked experts' state is not written flattened (Megatron's "
                             "deprecated fully_sharded_model_space optimizer format)")
        # The key as it is now: the layer block renames its layers' keys after they are made, and an
        # optimizer puts its own prefix before them; the expert's place in it is SequentialMLP's.
        tail = f"experts.{self.linear}.weight"
        if not key.endswith(tail):
            raise ValueError(f"{key}: expected the key of the stacked experts' factory, ending in {tail}")
        singleton = self.metadata.get("singleton_local_shards", False)
        first = self.module.ep_group.rank() * self.module.num_local_experts
        entries = []
        for e in range(self.module.num_local_experts):
            entry = self._weight_entry(e, tensor[e])
            entry.key = f"{key[: -len(tail)]}experts.{first + e}.{self.linear}.weight" if singleton else key
            entry.replica_id = replica_id
            entries.append(entry.build() if isinstance(entry, ShardedTensorFactory) else entry)
        return entries

    @staticmethod
    def merge(loaded: list) -> torch.Tensor:
        # a gated fc1 comes back as its [gate, up] halves (MLP's SwiGLU factory merges by cat)
        return torch.stack([torch.cat(part) if isinstance(part, list) else part for part in loaded])


def _expert_entries(module, e: int, linear: str, weight: torch.Tensor, prefix: str, sharded_offsets: tuple,
                    metadata: dict) -> dict[str, Any]:
    """What ``SequentialMLP.sharded_state_dict`` holds for local expert ``e``'s ``linear`` whose
    weight is ``weight``: the linear's own entries (``make_sharded_tensors_for_checkpoint`` of its
    weight and extra state), MLP's SwiGLU factory on a gated fc1, the keys moved to the experts'
    shared (or, with ``singleton_local_shards``, per-expert) prefix and the replica ids to the
    expert-data-parallel rank; by ``SequentialMLP``'s local keys."""
    singleton = metadata.get("singleton_local_shards", False)
    expert = module.ep_group.rank() * module.num_local_experts + e
    experts = module.ep_group.size() * module.num_local_experts
    if singleton:
        sharded_prefix, offsets = f"{prefix}experts.{expert}.", sharded_offsets
    else:
        sharded_prefix, offsets = f"{prefix}experts.", (*sharded_offsets, (len(sharded_offsets), expert, experts))
    local_prefix = f"{prefix}local_experts.{e}."
    entries = make_sharded_tensors_for_checkpoint({"weight": weight, "_extra_state": None}, f"{local_prefix}{linear}.",
                                                  {"weight": _TP_AXIS[linear]}, offsets, tp_group=module.tp_group,
                                                  dp_cp_group=metadata["dp_cp_group"])
    weight_key = f"{local_prefix}{linear}.weight"
    if linear == "linear_fc1" and module.config.gated_linear_unit:
        entries[weight_key] = apply_swiglu_sharded_factory(entries[weight_key], offsets, singleton)
    replace_prefix_for_sharding(entries, local_prefix, sharded_prefix)
    for entry in entries.values():
        entry.replica_id = (*entry.replica_id[:2], module.dp_group.rank())
    return entries


def accept_extra_states(module, incompatible_keys) -> None:
    """Load-state-dict post-hook: the per-expert extra states ``SequentialMLP``'s linears write
    (empty) are not unexpected."""
    unexpected = incompatible_keys.unexpected_keys
    unexpected[:] = [key for key in unexpected if not _EXTRA_STATE.search(key)]
