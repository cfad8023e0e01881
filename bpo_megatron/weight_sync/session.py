"""Trainer → engines weight sync, the driver's side: :class:`WeightSync`, one per engine group.

It talks to the trainer group (each rank's :func:`~bpo_megatron.weight_sync.sender.send_weights`
and, for a transport that forms one group with every engine, the group's rendezvous) and to the
engine group (update sessions, endpoints, versions, replacements). The transport itself runs on
the trainer's ranks and receives plain endpoint records
(:mod:`bpo_megatron.weight_sync.transport`); it is known here by name only.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from bpo_megatron.weight_sync import transport_class
from bpo_megatron.weight_sync.plan import SyncPlan
from bpo_megatron.weights.checksums import compare

log = logging.getLogger(__name__)


class WeightSync:
    """The one owner of the syncs of ``engines`` (an engine group) from ``trainer`` (the trainer
    group), as ``plan`` says. It holds no state of its own between syncs: what a sync needs to
    know of earlier ones (the engines a weight group joined, the engines replaced since) the
    groups hold."""

    def __init__(self, trainer: Any, engines: Any, plan: SyncPlan) -> None:
        self.trainer, self.engines, self.plan = trainer, engines, plan
        self._sender = transport_class(plan.transport)

    def sync(self, version: int, only: list[int] | None = None) -> dict[str, float]:
        """Push the trainer's weights, the ``version``-th update, to the engines (``only``: those
        indices); returns the bytes the trainer sent (``sync_bytes``) and the push's wall-clock
        seconds (``push_s``: the engines' update sessions, the trainer's export and send, the
        versions asked; not the verification).

        A full sync first replaces the engines that died since the last one; an engine that dies
        during the sync is replaced and synced again (within the engines' restart budget), so
        every engine holds the new weights when this returns. A broadcast reaches every member of
        its group, so a ``whole_group`` transport always syncs all engines (re-forming the group
        when they changed). Each engine then reports the version it holds. With the plan's
        ``verify`` every engine's weights are fingerprinted afterwards and compared with what the
        trainer sent; any difference raises ``WeightMismatch`` naming the tensors.

        With the plan's ``delta``, the engines that hold the trainer's last version get a delta
        against it (the trainer's ranks decide, :meth:`HeldWeights.delta_from`); engines replaced
        since, or holding another version, get a full sync of their own afterwards (all engines at
        once for a broadcast). A delta is verified like a full sync: the whole tensors' fingerprints.
        """
        engines, broadcast = self.engines, self._sender.whole_group
        start, verifying, sent = time.perf_counter(), 0.0, 0.0
        if only is None or broadcast:
            engines.replace_unhealthy()
        targets = list(range(len(engines.workers))) if only is None or broadcast else list(only)
        fresh = engines.unsynced & set(targets)  # replaced: they hold the initial weights, whatever version they say
        engines.unsynced.difference_update(targets)  # an engine replaced from here on is synced below
        while targets:
            if broadcast:
                self._form_weight_group()
            held, targets, later = self._delta_base(targets, fresh)
            lost = engines.begin_weight_update(version, only=targets)
            if broadcast and lost:  # a group with a dead member cannot broadcast: replace, re-form, retry
                engines.replace(lost, load_weights=False)
                engines.unsynced.difference_update(lost)
                fresh.update(lost)
                continue
            opened = [i for i in targets if i not in lost]
            report = self.trainer.push_weights(self.plan, engines.weight_endpoints(opened, self._sender.needs),
                                               version, engines.role, held)
            for j in report["failed"]:
                log.warning("%s engine %d lost its server while receiving weights version %d; replacing it",
                            engines.role, opened[j], version)
            lost += [opened[j] for j in report["failed"]]
            lost += engines.end_weight_update(only=[i for i in opened if i not in lost])
            synced = [i for i in targets if i not in lost]
            held, died = engines.held_versions(only=synced)
            lost += died
            synced = [i for i in synced if i not in died]
            if any(held[i] != version for i in synced):
                raise RuntimeError(f"after the weight sync, engines {synced} report weight versions "
                                   f"{[held[i] for i in synced]}, not {version}")
            sent += report["bytes"]
            if self.plan.verify:
                began = time.perf_counter()
                for index, fingerprints in zip(synced, engines.fingerprints(only=synced)):
                    compare(report["fingerprints"], fingerprints, engine=f"{engines.role} engine {index}")
                verifying += time.perf_counter() - began
            if lost:
                engines.replace(lost, load_weights=False)
                engines.unsynced.difference_update(lost)  # synced by the next round of this loop
                fresh.update(lost)
            targets = lost + later
        return {"sync_bytes": float(sent), "push_s": time.perf_counter() - start - verifying}

    def _delta_base(self, targets: list[int], fresh: set[int]) -> tuple[int | None, list[int], list[int]]:
        """The version the engines of ``targets`` a delta may reach hold (None: a full sync), those
        engines, and the others (synced by the next round). Only engines that hold a version
        this group's trainer sent (one or more; not ``fresh``: replaced) may take a delta, those
        holding the newest such version; a broadcast reaches all or none of them."""
        if self.plan.delta is None:
            return None, targets, []
        held, _ = self.engines.held_versions(only=targets)  # one found dead is found again when its update opens
        candidates = [i for i in targets if i in held and i not in fresh and held[i] >= 1]
        if not candidates:
            return None, targets, []
        base = max(held[i] for i in candidates)
        now = [i for i in candidates if held[i] == base]
        if self._sender.whole_group:
            return (base, targets, []) if now == targets else (None, targets, [])
        return base, now, [i for i in targets if i not in now]

    def _form_weight_group(self) -> None:
        """Trainer rank 0 and every engine TP rank in one group of the transport (once, and again
        when engines were replaced: the survivors leave the old group first); one group per engine
        group (``role``). The transport class says where each engine's ranks join and which
        members it refuses; trainer rank 0 hosts the rendezvous while the engines join."""
        trainer, engines, transport = self.trainer, self.engines, self.plan.transport
        members = engines.actor_ids()
        if engines.weight_group == members:
            return
        if engines.weight_group is not None:
            survivors = [i for i, actor in enumerate(members) if actor in engines.weight_group]
            engines.leave_weight_group(only=survivors)
            trainer.close_transport(transport, engines.role)
        details = [endpoint.details for endpoint in engines.weight_endpoints(list(range(len(members))),
                                                                              frozenset({"details"}))]
        self._sender.check_members(trainer.nccl_version(), engines.nccl_versions)
        address, port = trainer.host_weight_group(engines.role)
        offsets, world = self._sender.group_ranks(details)
        opening = trainer.open_weight_group(transport, world, engines.role)  # rank 0 hosts, engines join
        engines.join_weight_group(address, port, offsets, world)
        trainer.wait(opening, "open_weight_group")
        engines.weight_group = members
