"""The trainer's weights as Hugging Face-named buckets, without Ray (every rank takes part)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from bpo_megatron.convert import ExportPlan, StreamedTensor, weight_stream
from bpo_megatron.convert.local_weights import unwrap
from bpo_megatron.rollout.weight_buckets import buckets
from bpo_megatron.weight_sync.host_staging import HostStaging


def export_weights(actor, bucket_bytes: int, *, dtype: torch.dtype | None = None, host: bool = False,
                   all_ranks: bool = False, views: bool = False, plan: ExportPlan | None = None,
                   staging: HostStaging | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of at most ``bucket_bytes`` of the actor's model under Hugging Face on-disk names,
    in ``dtype`` when given. Every rank must iterate (each takes part in gathering the shards onto
    global rank 0); only rank 0 gets buckets, or every rank with ``all_ranks`` (each bucket is
    then broadcast from rank 0 as one buffer per dtype). ``host`` copies them to host memory
    through ``staging`` (a bucket is then valid until the next is asked for); otherwise they lie
    where the model does. With ``views`` a tensor may be a view of a parameter (no copy), for a
    consumer that copies it before the model changes. ``plan``: the model's
    :class:`~bpo_megatron.convert.ExportPlan`, built once and reused."""
    stream = weight_stream(actor.model, actor.hf, dst=0, dtype=dtype, plan=plan, views=views)
    if all_ranks:
        device = next(unwrap(actor.model).parameters()).device
        for bucket in buckets(stream, bucket_bytes, size=lambda item: item.nbytes):
            yield broadcast_bucket(bucket, device)
        return
    named = ((item.name, item.tensor) for item in stream if item.tensor is not None)
    yield from (staging or HostStaging()).buckets(named, bucket_bytes) if host else buckets(named, bucket_bytes)


def broadcast_bucket(bucket: list[StreamedTensor], device: torch.device, src: int = 0
                     ) -> list[tuple[str, torch.Tensor]]:
    """Rank ``src``'s tensors of the bucket on every rank: one broadcast per dtype of one flat
    buffer (every rank knows the names, shapes and dtypes from the stream), views of it elsewhere."""
    rank = dist.get_rank()
    received: dict[str, torch.Tensor] = {}
    for dtype in dict.fromkeys(item.dtype for item in bucket):
        items = [item for item in bucket if item.dtype == dtype]
        if rank == src:
            flat = torch.cat([item.tensor.reshape(-1) for item in items])
        else:
            flat = torch.empty(sum(torch.Size(item.shape).numel() for item in items), dtype=dtype, device=device)
        dist.broadcast(flat, src=src)
        if rank != src:
            offset = 0
            for item in items:
                numel = torch.Size(item.shape).numel()
                received[item.name] = flat[offset:offset + numel].view(item.shape)
                offset += numel
    return [(item.name, item.tensor if rank == src else received[item.name]) for item in bucket]
