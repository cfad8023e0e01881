"""A trainer rank's side of a weight sync (:func:`send_weights`): export → dtype → the engines'
quantized form → fingerprints → the transport."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, TypedDict

from bpo_megatron.weight_sync.plan import SyncPlan
from bpo_megatron.weight_sync.transport import Bucket, EngineEndpoint, Transport
from bpo_megatron.weights.checksums import fingerprint


class SentReport(TypedDict):
    bytes: int  # what this rank sent (each bucket once, however many engines received it)
    failed: list[int]  # positions (in the endpoints) of the engines found lost meanwhile
    seconds: float  # the export and the send
    fingerprints: dict[str, str]  # what was sent, by tensor (rank 0 with the plan's verify; else empty)


def send_weights(actor: Any, transport: Transport, plan: SyncPlan, endpoints: list[EngineEndpoint], version: int, *,
                 rank: int) -> SentReport:
    """The model of ``actor`` (a train actor: its ``export_weights``) as Hugging Face tensors in
    buckets of the plan's size, in the plan's ``dtype``, each linear weight in the form the
    engines hold it (the plan's ``quantization``; a flattened bucket too), fingerprinted with the
    plan's ``verify`` (rank 0), sent over ``transport`` (this rank's, prepared for ``endpoints``)
    as the ``version``-th update.

    Every rank takes part in gathering the shards; rank 0 alone sends, or every rank for a
    transport that sends from every GPU (``every_rank``): the others return an empty report."""
    start = time.perf_counter()
    stream = actor.export_weights(plan.bucket_bytes, dtype=plan.dtype, host=transport.host_tensors,
                                  all_ranks=transport.every_rank, views=transport.views)
    if rank != 0 and not transport.every_rank:
        for _ in stream:  # this rank's shards go to rank 0 while the stream runs
            pass
        return {"bytes": 0, "failed": [], "seconds": 0.0, "fingerprints": {}}
    sent: dict[str, str] = {}
    transport.prepare(endpoints)
    report = transport.send(_as_engines_hold(stream, plan, sent if plan.verify and rank == 0 else None), version)
    return {"bytes": report["bytes"], "failed": report["failed"], "seconds": time.perf_counter() - start,
            "fingerprints": sent}


def _as_engines_hold(buckets: Iterable[Bucket], plan: SyncPlan, fingerprints: dict[str, str] | None
                     ) -> Iterator[Bucket]:
    """Each bucket's tensors as the engines load them (the plan's quantized form), their
    fingerprints recorded into ``fingerprints`` unless None."""
    form = None if plan.quantization is None else plan.quantization.tensors
    for bucket in buckets:
        if form is not None:
            bucket = [pair for name, tensor in bucket for pair in form(name, tensor)]
        if fingerprints is not None:
            fingerprints.update((name, fingerprint(tensor)) for name, tensor in bucket)
        yield bucket
