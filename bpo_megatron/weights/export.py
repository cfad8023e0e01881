"""The trainer's weights as Hugging Face-named buckets, without Ray (every rank takes part).

:meth:`~bpo_megatron.trainer.actor.TrainActor.export_weights` calls it with the plan and the
staging buffer it keeps for the model's life; benchmarks and the GPU kit go through the actor too,
so what they measure is what a weight sync sends.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.weights.buckets import buckets
from bpo_megatron.weights.flat_bucket import FlatBucket
from bpo_megatron.weights.gather import ExportPlan, StreamedTensor, weight_stream
from bpo_megatron.weights.host_staging import HostStaging
from bpo_megatron.weights.local_weights import unwrap


def export_weights(model, hf: HFModelConfig | None, bucket_bytes: int, *, dtype: torch.dtype | None = None,
                   host: bool = False, all_ranks: bool = False, views: bool = False, plan: ExportPlan | None = None,
                   staging: HostStaging | None = None) -> Iterator[list[tuple[str, torch.Tensor]] | FlatBucket]:
    """Buckets of at most ``bucket_bytes`` of ``model`` under Hugging Face on-disk names, in
    ``dtype`` when given, a load group's tensors in one bucket (:mod:`~bpo_megatron.weights.buckets`).
    Every rank must iterate (each takes part in gathering the shards onto global rank 0); only rank 0 gets buckets, or every rank with ``all_ranks``: each bucket is then
    a :class:`~bpo_megatron.weights.flat_bucket.FlatBucket` on the model's device, packed by
    rank 0 and broadcast to the others in one buffer (:func:`broadcast_bucket`), which a transport
    hands on without copying it again. ``host`` copies them to host memory through ``staging`` (a
    bucket is then valid until the next is asked for); otherwise they lie where the model does.
    With ``views`` a tensor may be a view of a parameter (no copy), for a consumer that copies it
    before the model changes (a FlatBucket is such a copy). ``plan``: the model's
    :class:`~bpo_megatron.weights.gather.ExportPlan`, built once and reused."""
    stream = weight_stream(model, hf, dst=0, dtype=dtype, plan=plan, views=views)
    if all_ranks:
        device = next(unwrap(model).parameters()).device
        for bucket in buckets(stream, bucket_bytes, size=lambda item: item.nbytes, name=lambda item: item.name):
            yield broadcast_bucket(bucket, device)
        return
    named = ((item.name, item.tensor) for item in stream if item.tensor is not None)
    yield from (staging or HostStaging()).buckets(named, bucket_bytes) if host else buckets(named, bucket_bytes)


def broadcast_bucket(bucket: list[StreamedTensor], device: torch.device, src: int = 0) -> FlatBucket:
    """Rank ``src``'s tensors of the bucket on every rank, in one buffer on ``device`` laid out as
    :func:`~bpo_megatron.weights.flat_bucket.layout` says (every rank knows the names, shapes
    and dtypes from the stream): rank ``src`` packs its tensors into it (their one copy) and one
    broadcast fills it on the others, whatever the dtypes."""
    flat = FlatBucket.empty([(item.name, item.shape, item.dtype) for item in bucket], device)
    if dist.get_rank() == src:
        flat.fill(item.tensor for item in bucket)
    dist.broadcast(flat.buffer, src=src)
    return flat
