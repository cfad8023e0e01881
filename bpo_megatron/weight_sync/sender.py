"""A trainer rank's side of a weight sync (:func:`send_weights`): export → dtype → the engines'
quantized form → fingerprints → (a delta sync: the diff against what the engines hold) → the
transport."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, TypedDict

from bpo_megatron.weight_sync.delta import INDICES, VALUES, HeldWeights, encode
from bpo_megatron.weight_sync.plan import SyncPlan
from bpo_megatron.weight_sync.transport import Bucket, EngineEndpoint, Transport
from bpo_megatron.weights.buckets import tensor_bytes
from bpo_megatron.weights.checksums import fingerprint


class SentReport(TypedDict):
    bytes: int  # what this rank sent (each bucket once, however many engines received it)
    failed: list[int]  # positions (in the endpoints) of the engines found lost meanwhile
    seconds: float  # the export and the send
    fingerprints: dict[str, str]  # what the engines now hold, by tensor (rank 0 with the plan's verify; else empty)
    delta: bool  # whether this sync sent a delta (only what changed since the version the engines held)


def send_weights(actor: Any, transport: Transport, plan: SyncPlan, endpoints: list[EngineEndpoint], version: int, *,
                 rank: int, record: HeldWeights | None = None, held: int | None = None) -> SentReport:
    """The model of ``actor`` (a train actor: its ``export_weights``) as Hugging Face tensors in
    buckets of the plan's size, in the plan's ``dtype``, each linear weight in the form the
    engines hold it (the plan's ``quantization``; a flattened bucket too), fingerprinted with the
    plan's ``verify`` (rank 0), sent over ``transport`` (this rank's, prepared for ``endpoints``)
    as the ``version``-th update.

    Every rank takes part in gathering the shards; rank 0 alone sends, or every rank for a
    transport that sends from every GPU (``every_rank``): the others return an empty report.

    With the plan's ``delta``, ``record`` is this rank's :class:`HeldWeights` for these engines,
    kept across syncs: the sync is a delta when the engines all hold its version (``held``, as
    the driver found them) and the last full sync is fewer than ``full_every`` versions back
    (:meth:`HeldWeights.delta_from`), a full sync otherwise; either way the record then holds
    what was sent. The fingerprints are of the whole tensors the engines end up with, delta or not.
    """
    start = time.perf_counter()
    stream = actor.export_weights(plan.bucket_bytes, dtype=plan.dtype, host=transport.host_tensors,
                                  all_ranks=transport.every_rank, views=transport.views)
    if rank != 0 and not transport.every_rank:
        for _ in stream:  # this rank's shards go to rank 0 while the stream runs
            pass
        return {"bytes": 0, "failed": [], "seconds": 0.0, "fingerprints": {}, "delta": False}
    if plan.delta is not None and record is None:
        raise ValueError("a delta sync needs the rank's record of what the engines hold (record=HeldWeights())")
    sent: dict[str, str] = {}
    transport.prepare(endpoints)
    buckets = _as_engines_hold(stream, plan, sent if plan.verify and rank == 0 else None)
    delta = plan.delta is not None and record.delta_from(held, version, plan.full_every)
    before = record.version if plan.delta is not None else None
    if plan.delta is not None:
        record.version = None  # unknown until the transport has sent every bucket
        buckets = (_delta(buckets, record, plan.delta, plan.bucket_bytes, transport.host_tensors) if delta
                   else _kept(buckets, record))
    report = transport.send(buckets, version)
    if plan.delta is not None:
        record.version = version
        # a full sync of the version the record already held went to engines of their own (replaced
        # or behind), the others having had it as a delta: their last full sync stays the record's
        if not delta and before != version:
            record.full_version = version
    return {"bytes": report["bytes"], "failed": report["failed"], "seconds": time.perf_counter() - start,
            "fingerprints": sent, "delta": delta}


def _delta(buckets: Iterable[Bucket], record: HeldWeights, mode: str, bucket_bytes: int, host: bool
           ) -> Iterator[Bucket]:
    """Each bucket as a delta against ``record`` (:func:`~bpo_megatron.weight_sync.delta.encode`),
    consecutive ones sent together while they fit in ``bucket_bytes``: a delta's pieces are small,
    and every bucket is an update call on every engine (an export bucket's pieces stay in one, so a
    load group is never split). A bucket with nothing changed sends nothing.

    The export may write its next bucket where the last one lies, so what is kept past it is not
    the export's: a sparse piece's indices and values are new tensors; a whole tensor is the
    record's host copy of the same bytes (``host``: the transport sends host tensors), else a copy
    on its device (at most one bucket's worth)."""
    merged: Bucket = []
    size = 0
    for bucket in buckets:
        encoded = encode(bucket, record, mode).tensors
        nbytes = sum(tensor_bytes(tensor) for _, tensor in encoded)
        if merged and size + nbytes > bucket_bytes:
            yield merged
            merged, size = [], 0
        merged += [(name, tensor if name.endswith((INDICES, VALUES)) else
                    record.tensors[name] if host else tensor.clone()) for name, tensor in encoded]
        size += nbytes
    if merged:
        yield merged


def _kept(buckets: Iterable[Bucket], record: HeldWeights) -> Iterator[Bucket]:
    """Each bucket of a full sync, copied into ``record`` as it goes."""
    for bucket in buckets:
        record.keep(bucket)
        yield bucket


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
