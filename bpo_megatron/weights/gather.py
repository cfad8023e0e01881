"""Stream Hugging Face tensors out of a live, sharded Megatron model (export and weight sync).

Every rank of the world iterates :func:`iter_hf_weights` with its model chunk. One collective
(:meth:`ExportPlan.build`) tells every rank who holds which piece of which weight and which of
Megatron's process groups it belongs to; then each weight travels to ``dst`` over those groups
only, with collectives (no point-to-point pair between arbitrary ranks, so NCCL opens no
communicator beyond Megatron's own):

1. **tensor**: its tensor-parallel shards (TP for dense weights, expert-TP for experts) are
   gathered onto the first rank of that group (``gather``), which merges them through the
   weight's layout into its Hugging Face tensors (vocabulary padding dropped) and casts them to
   the export dtype;
2. **expert**: under expert parallelism, the experts with the same local index on every rank of
   an expert-parallel group travel together in one ``gather`` onto the group's first rank;
3. **pipeline**: if that rank is not ``dst``, it broadcasts the tensors over its pipeline group
   (Megatron puts ``dst`` = 0 in it; any other ``dst`` goes over the world).

Data-parallel replicas send nothing (the lowest-ranked replica of each shard is the one that
travels). ``dst`` holds at most one *unit* at a time (a weight, or one expert per
expert-parallel rank), so memory is bounded by that, never by the model.

The generator must be run to the end on every rank: ranks other than ``dst`` yield nothing but
take part in the collectives while it runs (:func:`weight_stream` yields on every rank, with the
tensor only on ``dst``, for a consumer that must know where the stream is everywhere).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.weights.layouts import LAYOUTS, LayoutContext
from bpo_megatron.weights.local_weights import LocalWeight, local_weights, unwrap
from bpo_megatron.weights.names import (
    RULES_BY_NAME,
    WeightKey,
    expected_keys,
    model_dims,
    sort_key,
)

_DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16)}
_GROUP_KINDS = ("tensor", "expert_tensor", "expert", "pipeline")


@dataclass(frozen=True)
class PlannedWeight:
    key: WeightKey
    sources: tuple[int, ...]  # global rank holding each TP shard (the lowest replica), in shard order
    shard_shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    @property
    def holder(self) -> int:
        """The rank that merges the shards (the first of its tensor-parallel group)."""
        return self.sources[0]


@dataclass(frozen=True)
class Unit:
    """Weights that travel together: one, or one expert per rank of ``expert_group`` (the
    weight at position i is held by ``expert_group[i]``), gathered onto ``expert_group[0]``."""

    weights: tuple[PlannedWeight, ...]
    expert_group: tuple[int, ...] = ()

    @property
    def holder(self) -> int:
        return self.expert_group[0] if self.expert_group else self.weights[0].holder


@dataclass(frozen=True)
class ExportPlan:
    """How every weight travels; the same on every rank. Reusable for as long as the model's
    layout does not change (build once, sync weights every step)."""

    units: tuple[Unit, ...]
    pipeline_groups: tuple[tuple[int, ...], ...]  # each global rank's pipeline group

    @classmethod
    def build(cls, model: torch.nn.Module, hf: HFModelConfig) -> ExportPlan:
        """Collective over the default group: every rank must call it."""
        tied = unwrap(model).share_embeddings_and_output_weights
        mine = [(w.key, w.shard, w.num_shards, tuple(w.param.shape), str(w.param.dtype))
                for w in local_weights(model)
                if not (tied and w.rule.tied_to)]  # a tied output layer is the embedding again
        groups = {kind: tuple(dist.get_process_group_ranks(group)) for kind, group in _groups().items()}
        reports: list[tuple | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, (mine, groups))
        holders: dict[WeightKey, dict[int, tuple[int, tuple[int, ...], str]]] = {}
        counts: dict[WeightKey, int] = {}
        for rank, (inventory, _) in enumerate(reports):
            for key, shard, num_shards, shape, dtype in inventory:
                counts.setdefault(key, num_shards)
                holders.setdefault(key, {}).setdefault(shard, (rank, shape, dtype))
        _check_complete(holders, counts, hf)
        rank_groups = [report[1] for report in reports]
        weights = []
        for key in sorted(holders, key=sort_key):
            pieces = [holders[key][shard] for shard in range(counts[key])]
            weight = PlannedWeight(key, tuple(p[0] for p in pieces), tuple(p[1] for p in pieces),
                                   _DTYPES[pieces[0][2]])
            _check_tensor_group(weight, rank_groups)
            weights.append(weight)
        return cls(_units(weights, rank_groups), tuple(groups["pipeline"] for groups in rank_groups))


def _groups() -> dict[str, dist.ProcessGroup]:
    """This rank's Megatron process groups the export travels over."""
    from megatron.core import parallel_state as ps

    return {"tensor": ps.get_tensor_model_parallel_group(),
            "expert_tensor": ps.get_expert_tensor_parallel_group(),
            "expert": ps.get_expert_model_parallel_group(),
            "pipeline": ps.get_pipeline_model_parallel_group()}


def _tensor_kind(key: WeightKey) -> str:
    return "expert_tensor" if RULES_BY_NAME[key[0]].is_expert else "tensor"


def _check_tensor_group(weight: PlannedWeight, rank_groups: list[dict]) -> None:
    """The shards' holders must be one tensor-parallel group, in shard order, of equal shapes."""
    if len(weight.sources) == 1:
        return
    group = rank_groups[weight.holder][_tensor_kind(weight.key)]
    if group != weight.sources or len(set(weight.shard_shapes)) != 1:
        raise RuntimeError(f"{weight.key}: shards held by ranks {list(weight.sources)} with shapes "
                           f"{list(weight.shard_shapes)}, expected one tensor-parallel group {list(group)} "
                           "of equal shards")


def _units(weights: list[PlannedWeight], rank_groups: list[dict]) -> tuple[Unit, ...]:
    """Each weight alone, except experts spread over an expert-parallel group: those with the
    same rule, layer and local index on every rank of the group form one unit."""
    units: dict[tuple, list[PlannedWeight | None]] = {}
    local_index: dict[tuple, int] = {}
    order: dict[tuple, tuple] = {}
    for weight in weights:
        group = rank_groups[weight.holder]["expert"]
        rule, layer, _ = weight.key
        if not RULES_BY_NAME[rule].is_expert or len(group) == 1:
            unit_id: tuple = (weight.key,)
            units[unit_id] = [weight]
        else:
            seen = (rule, layer, weight.holder)
            index = local_index[seen] = local_index.get(seen, -1) + 1
            unit_id = (rule, layer, group, index)
            members = units.setdefault(unit_id, [None] * len(group))
            members[group.index(weight.holder)] = weight
        order.setdefault(unit_id, sort_key(weight.key))
    planned = []
    for unit_id in sorted(units, key=order.__getitem__):
        members = units[unit_id]
        if len(unit_id) == 1:
            planned.append(Unit(tuple(members)))
            continue
        if any(member is None for member in members):
            raise RuntimeError(f"experts {unit_id[:2]} at local index {unit_id[3]}: not every rank of the "
                               f"expert-parallel group {list(unit_id[2])} holds one")
        planned.append(Unit(tuple(members), unit_id[2]))
    return tuple(planned)


def _check_complete(holders: dict, counts: dict[WeightKey, int], hf: HFModelConfig) -> None:
    expected = set(expected_keys(hf))
    missing = sorted(expected - holders.keys(), key=sort_key)
    unexpected = sorted(holders.keys() - expected, key=sort_key)
    partial = [key for key in holders if len(holders[key]) != counts[key]]
    if missing or unexpected or partial:
        raise ValueError(f"the model does not match its config: missing weights {_few(missing)}, "
                         f"unexpected weights {_few(unexpected)}, weights missing TP shards "
                         f"{_few(partial)}")


def _few(keys: list[WeightKey], shown: int = 8) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f"{keys[:shown]}{more}"


@dataclass(frozen=True)
class StreamedTensor:
    """One Hugging Face tensor of the stream, as every rank sees it; ``tensor`` only on ``dst``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensor: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def iter_hf_weights(
    model: torch.nn.Module,
    hf: HFModelConfig,
    *,
    dst: int = 0,
    dtype: torch.dtype | None = None,
    plan: ExportPlan | None = None,
    views: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` on global rank ``dst`` for every Hugging Face tensor of the
    model, each exactly once (other ranks yield nothing; every rank must run it to the end).

    The order is Hugging Face's — embedding, layer by layer, final norm, output layer — except
    that a layer's experts come in the order the expert-parallel gather delivers them. ``dtype``
    casts the tensors (where their shards are merged, before they travel); by default they keep
    the model's dtype, on the model's device. Vocabulary padding rows are dropped; with tied
    embeddings there is no ``lm_head.weight``, as in Hugging Face checkpoints. With ``views`` a
    weight held whole by ``dst`` is yielded as a view of its parameter where its layout allows
    (no copy): for a consumer that copies each tensor before the model changes.
    """
    for item in weight_stream(model, hf, dst=dst, dtype=dtype, plan=plan, views=views):
        if item.tensor is not None:
            yield item.name, item.tensor


def weight_stream(model: torch.nn.Module, hf: HFModelConfig, *, dst: int = 0, dtype: torch.dtype | None = None,
                  plan: ExportPlan | None = None, views: bool = False) -> Iterator[StreamedTensor]:
    """:func:`iter_hf_weights` as every rank sees it: each tensor's name, shape and dtype on every
    rank, the tensor itself on ``dst`` only."""
    plan = plan or ExportPlan.build(model, hf)
    rank = dist.get_rank()
    mine: dict[tuple[WeightKey, int], LocalWeight] = {(w.key, w.shard): w for w in local_weights(model)}
    device = next(unwrap(model).parameters()).device
    groups = {tuple(dist.get_process_group_ranks(group)): group for group in _groups().values()}
    world = tuple(range(dist.get_world_size()))
    groups.setdefault(world, dist.group.WORLD)
    dims = model_dims(hf)
    ctx = LayoutContext(num_query_groups=hf.num_key_value_heads, vocab_size=hf.vocab_size)
    for unit in plan.units:
        rule = RULES_BY_NAME[unit.weights[0].key[0]]
        shapes = rule.hf_shapes(dims)
        # a buffer (the router's expert bias) keeps its own dtype, fp32, as transformers keeps it
        unit_dtype = None if rule.buffer else dtype
        out_dtype = unit_dtype or unit.weights[0].dtype
        held: list[list[torch.Tensor]] = []  # the unit's weights held here: each as its HF tensors
        for weight in unit.weights:
            merged = _tensor_step(weight, mine, rank, groups, ctx, shapes, unit_dtype,
                                  copy=not views and rank == dst)
            if merged is not None:
                held = [merged]
        if unit.expert_group and rank in unit.expert_group:
            held = _expert_step(unit, held[0], rank, groups[unit.expert_group])
        pipeline = plan.pipeline_groups[unit.holder]
        if unit.holder != dst:
            pipeline = pipeline if dst in pipeline else world
            if rank in pipeline:
                held = _pipeline_step(unit, held, rank, groups[pipeline], shapes, out_dtype, device)
        for position, weight in enumerate(unit.weights):
            names = rule.hf_names(weight.key[1], weight.key[2])
            tensors = held[position] if rank == dst else [None] * len(names)
            for name, shape, tensor in zip(names, shapes, tensors):
                yield StreamedTensor(name, shape, out_dtype, tensor)
        del held


def _tensor_step(weight: PlannedWeight, mine: dict, rank: int, groups: dict, ctx: LayoutContext,
                 shapes: list[tuple[int, ...]], dtype: torch.dtype | None, copy: bool) -> list[torch.Tensor] | None:
    """The weight's shards gathered onto its holder and merged into its HF tensors there (None
    elsewhere; the other shard holders send theirs)."""
    if rank not in weight.sources:
        return None
    shard = mine[(weight.key, weight.sources.index(rank))].param.detach()
    if len(weight.sources) == 1:
        shards = [shard]
    else:
        shards = ([torch.empty_like(shard) for _ in weight.sources] if rank == weight.holder else None)
        dist.gather(shard.contiguous(), shards, dst=weight.holder, group=groups[weight.sources])
        if rank != weight.holder:
            return None
    rule = RULES_BY_NAME[weight.key[0]]
    tensors = LAYOUTS[rule.layout].merge(shards, shapes, ctx, copy=copy)
    for name, tensor, shape in zip(rule.hf_names(weight.key[1], weight.key[2]), tensors, shapes):
        if tuple(tensor.shape) != shape:
            raise RuntimeError(f"{name}: assembled shape {list(tensor.shape)}, expected {list(shape)}")
    return tensors if dtype is None else [tensor.to(dtype) for tensor in tensors]


def _expert_step(unit: Unit, tensors: list[torch.Tensor], rank: int, group: dist.ProcessGroup
                 ) -> list[list[torch.Tensor]]:
    """Every rank of the expert-parallel group gives its expert; the first rank gets them all."""
    first = unit.expert_group[0]
    gathered: list[list[torch.Tensor]] = [[] for _ in unit.expert_group]
    for tensor in tensors:
        tensor = tensor.contiguous()
        received = [torch.empty_like(tensor) for _ in unit.expert_group] if rank == first else None
        dist.gather(tensor, received, dst=first, group=group)
        for position, piece in enumerate(received or []):
            gathered[position].append(piece)
    return gathered if rank == first else []


def _pipeline_step(unit: Unit, held: list[list[torch.Tensor]], rank: int, group: dist.ProcessGroup,
                   shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device
                   ) -> list[list[torch.Tensor]]:
    """The unit's holder broadcasts it over a group holding ``dst``; every member receives it."""
    if rank != unit.holder:
        held = [[torch.empty(shape, dtype=dtype, device=device) for shape in shapes] for _ in unit.weights]
    for tensors in held:
        for i, tensor in enumerate(tensors):
            tensors[i] = tensor = tensor.contiguous()
            dist.broadcast(tensor, src=unit.holder, group=group)
    return held
