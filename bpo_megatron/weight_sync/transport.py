"""What a weight transport is: the seam between the trainer's export and an engine's weights.

A transport lives on the trainer's ranks, one per (transport, engine group), for the run. At every
sync the driver (:mod:`bpo_megatron.weight_sync.session`) asks the engine group for an
:class:`EngineEndpoint` of each engine the sync reaches, holding the parts the transport
:attr:`~Transport.needs` (they are asked of the engines before the transport runs: a transport
never calls back into the group), and the trainer ranks that send run

* ``prepare(endpoints)``: the engines this sync reaches, in this order;
* ``send(buckets, version)``: stream the buckets of the ``version``-th update to them; returns a
  :class:`SendReport` whose ``failed`` are positions in ``endpoints``;
* ``close()``: release what the transport holds (a process group, mapped memory).

A transport that forms one group with every engine (``whole_group``) also has ``open(address,
port, world_size, backend)``, which the driver runs on trainer rank 0 while the engines join, and
its class says where each engine's ranks join (``group_ranks(details)``, the engines' endpoint
details) and which members it
refuses (``check_members(trainer_version, engine_versions)``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypedDict

import torch

if TYPE_CHECKING:
    from bpo_megatron.weights.flat_bucket import FlatBucket

Bucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class EngineEndpoint:
    """Where one engine receives weights: plain values (and its actor's handle), no engine group.

    ``index``: the engine's place in its group (a colocated engine's GPUs follow from it). The
    other parts are filled only where the transport :attr:`~Transport.needs` them: ``actor``, the
    engine's Ray actor (object-store buckets are loaded through it); ``node``, the Ray node it runs
    on; ``details``, what the engine's own transports read to reach it (a server's address, TP size
    and key; where its weights lie in shared memory), opaque here: the engine fills it and only its
    transports read it."""

    index: int
    actor: Any = None
    node: str | None = None
    details: Any = None


# the parts of an endpoint a transport may need (everything but the index, which is always there)
ENDPOINT_PARTS = frozenset(f.name for f in fields(EngineEndpoint)) - {"index"}


class SendReport(TypedDict):
    bytes: int  # what the trainer sent (each bucket once, however many engines received it)
    failed: list[int]  # positions (in the prepared endpoints) of the engines found lost meanwhile


class Transport(Protocol):
    """The class attributes say how the trainer exports for it: where its buckets live
    (``host_tensors``), whether they may view the trainer's parameters (``views``: the transport
    copies them before training resumes), whether every trainer rank sends (``every_rank``) or
    rank 0 alone, whether it must reach all engines at once (``whole_group``), and which parts of
    an :class:`EngineEndpoint` it reads (``needs``)."""

    host_tensors: ClassVar[bool]
    views: ClassVar[bool]
    every_rank: ClassVar[bool]
    whole_group: ClassVar[bool]
    needs: ClassVar[frozenset[str]]

    def prepare(self, endpoints: list[EngineEndpoint]) -> None: ...

    def send(self, buckets: Iterable[Bucket | FlatBucket], version: int) -> SendReport: ...

    def close(self) -> None: ...
