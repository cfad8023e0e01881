"""The trainer's weights as Hugging Face-named buckets, without Ray (every rank takes part)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from bpo_megatron.convert import iter_hf_weights
from bpo_megatron.rollout.weight_buckets import buckets, on_host


def export_weights(actor, bucket_bytes: int, *, dtype: torch.dtype | None = None, host: bool = False,
                   all_ranks: bool = False, views: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of at most ``bucket_bytes`` of the actor's model under Hugging Face on-disk names,
    in ``dtype`` when given, copied to host memory with ``host`` (else where the model lives).
    Every rank must iterate (each sends its shards to global rank 0); only rank 0 gets buckets,
    or every rank with ``all_ranks``. With ``views`` a tensor may be a view of a parameter (no
    copy), for a consumer that copies it before the model changes."""
    stream = iter_hf_weights(actor.model, actor.hf, dst=0, all_ranks=all_ranks, dtype=dtype, views=views)
    yield from buckets(on_host(stream) if host else stream, bucket_bytes)
