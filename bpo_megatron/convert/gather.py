"""Stream Hugging Face tensors out of a live, sharded Megatron model (export and weight sync).

Every rank of the world calls :func:`iter_hf_weights` with its model chunk. One collective
(:meth:`ExportPlan.build`) tells every rank who holds which piece of which weight; then the
weights are assembled one at a time, in Hugging Face order: for each TP shard the lowest global
rank holding it sends it to ``dst`` (point-to-point; the other replicas, over data parallelism or
TP for unsplit weights, send nothing), ``dst`` merges the shards through the weight's layout and
yields the Hugging Face tensors. Only ``dst`` holds a merged weight, and only one at a time, so
memory is bounded by the largest single weight (an embedding, or one QKV / one expert's fc1),
never by the model. Pipeline stages and expert-parallel ranks are covered by the same rule:
whoever holds the piece sends it.

The generator must be run to the end on every rank (ranks other than ``dst`` yield nothing but
send their pieces while it runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bpo_megatron.convert.layouts import LAYOUTS, LayoutContext
from bpo_megatron.convert.local_weights import LocalWeight, local_weights, unwrap
from bpo_megatron.convert.names import (
    RULES_BY_NAME,
    WeightKey,
    expected_keys,
    model_dims,
    sort_key,
)
from bpo_megatron.models.hf_config import HFModelConfig

_DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16)}


@dataclass(frozen=True)
class PlannedWeight:
    key: WeightKey
    sources: tuple[int, ...]  # global rank that sends each TP shard, in shard order
    shard_shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ExportPlan:
    """Who sends which piece of every weight; the same on every rank. Reusable for as long as
    the model's layout does not change (e.g. build once, sync weights every step)."""

    weights: tuple[PlannedWeight, ...]

    @classmethod
    def build(cls, model: torch.nn.Module, hf: HFModelConfig) -> ExportPlan:
        """Collective over the default group: every rank must call it."""
        tied = unwrap(model).share_embeddings_and_output_weights
        mine = [(w.key, w.shard, w.num_shards, tuple(w.param.shape), str(w.param.dtype))
                for w in local_weights(model)
                if not (tied and w.rule.tied_to)]  # a tied output layer is the embedding again
        inventories: list[list | None] = [None] * dist.get_world_size()
        dist.all_gather_object(inventories, mine)
        holders: dict[WeightKey, dict[int, tuple[int, tuple[int, ...], str]]] = {}
        counts: dict[WeightKey, int] = {}
        for rank, inventory in enumerate(inventories):
            for key, shard, num_shards, shape, dtype in inventory:
                counts.setdefault(key, num_shards)
                holders.setdefault(key, {}).setdefault(shard, (rank, shape, dtype))
        _check_complete(holders, counts, hf)
        weights = []
        for key in sorted(holders, key=sort_key):
            pieces = [holders[key][shard] for shard in range(counts[key])]
            weights.append(PlannedWeight(key, tuple(p[0] for p in pieces),
                                         tuple(p[1] for p in pieces), _DTYPES[pieces[0][2]]))
        return cls(tuple(weights))


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


def iter_hf_weights(
    model: torch.nn.Module,
    hf: HFModelConfig,
    *,
    dst: int = 0,
    all_ranks: bool = False,
    dtype: torch.dtype | None = None,
    plan: ExportPlan | None = None,
    views: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every Hugging Face tensor of the model, each exactly once.

    Call on every rank of the world with its model chunk. Tensors are yielded on global rank
    ``dst`` only (other ranks yield nothing), or on every rank with ``all_ranks=True`` (each
    tensor is then broadcast from ``dst``). ``dtype`` casts the yielded tensors (e.g. to the
    checkpoint's); by default they keep the model's dtype and device. Vocabulary padding rows are
    dropped; with tied embeddings there is no ``lm_head.weight``, as in Hugging Face checkpoints.
    With ``views`` a weight held whole by ``dst`` is yielded as a view of its parameter where its
    layout allows (no copy): for a consumer that copies each tensor before the model changes.
    """
    plan = plan or ExportPlan.build(model, hf)
    rank = dist.get_rank()
    mine: dict[tuple[WeightKey, int], LocalWeight] = {
        (w.key, w.shard): w for w in local_weights(model)}
    device = next(unwrap(model).parameters()).device
    dims = model_dims(hf)
    ctx = LayoutContext(num_query_groups=hf.num_key_value_heads, vocab_size=hf.vocab_size)
    for planned in plan.weights:
        rule = RULES_BY_NAME[planned.key[0]]
        names = rule.hf_names(planned.key[1], planned.key[2])
        hf_shapes = rule.hf_shapes(dims)
        shards = _collect(planned, mine, rank, dst, device)
        tensors: list[torch.Tensor] = []
        if rank == dst:
            tensors = LAYOUTS[rule.layout].merge(shards, hf_shapes, ctx, copy=not views)
            del shards
            for name, tensor, shape in zip(names, tensors, hf_shapes):
                if tuple(tensor.shape) != shape:
                    raise RuntimeError(f"{name}: assembled shape {list(tensor.shape)}, "
                                       f"expected {list(shape)}")
        if all_ranks:
            tensors = [t.contiguous() for t in tensors]  # what a broadcast sends
            if rank != dst:
                tensors = [torch.empty(shape, dtype=planned.dtype, device=device)
                           for shape in hf_shapes]
            for tensor in tensors:
                dist.broadcast(tensor, src=dst)
        for name, tensor in zip(names, tensors):
            yield name, (tensor if dtype is None else tensor.to(dtype))


def _collect(planned: PlannedWeight, mine: dict[tuple[WeightKey, int], LocalWeight], rank: int,
             dst: int, device: torch.device) -> list[torch.Tensor]:
    """On ``dst``: every TP shard of the weight, in order. Elsewhere: send what this rank owns."""
    shards: list[torch.Tensor] = []
    for shard, (source, shape) in enumerate(zip(planned.sources, planned.shard_shapes)):
        if rank == dst:
            if source == rank:
                shards.append(mine[(planned.key, shard)].param.detach())
            else:
                buffer = torch.empty(shape, dtype=planned.dtype, device=device)
                dist.recv(buffer, src=source)
                shards.append(buffer)
        elif rank == source:
            dist.send(mine[(planned.key, shard)].param.detach().contiguous(), dst=dst)
    return shards
