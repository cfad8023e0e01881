"""``shared_memory``: trainer rank 0 writes each tensor straight into the weights of an engine on
its node, which keep them in a shared-memory segment (the embedded engine on a CPU,
:mod:`bpo_megatron.rollout.hf.shared_weights`): one copy per engine, no serialisation. The engine
is inside its weight-update session meanwhile, so it does not read them. Engines on other nodes, or
whose weights are not in host memory, receive the same buckets through Ray's object store.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

from bpo_megatron.rollout.hf.shared_weights import SegmentLayout, attach
from bpo_megatron.weight_sync.delta import Sparse, scatter, updates
from bpo_megatron.weight_sync.object_store import deliver, pack
from bpo_megatron.weight_sync.transport import Bucket, EngineEndpoint, SendReport
from bpo_megatron.weights.buckets import tensor_bytes

log = logging.getLogger(__name__)


class SharedMemory:
    host_tensors = True
    views = True  # the buckets may view the trainer's parameters: they are copied before it trains
    every_rank = False  # rank 0 sends
    whole_group = False  # any subset of the engines
    needs = frozenset({"actor", "node", "details"})  # the segment on this node; the actor elsewhere

    def __init__(self) -> None:
        # segment name -> (its owner's pid, the mapping, the weights' views)
        self._attached: dict[str, tuple[int, Any, dict[str, torch.Tensor]]] = {}
        self._local: dict[int, dict[str, torch.Tensor]] = {}  # position -> the engine's weights, mapped here
        self._remote: dict[int, Any] = {}  # position -> the actor of an engine sent to through the object store

    def prepare(self, endpoints: list[EngineEndpoint]) -> None:
        """Map the weights of the engines on this node (once per engine process; those of dead
        processes are unmapped); the others are reached through their actors."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        self._local, self._remote = {}, {}  # no view of a dead engine's weights may keep its mapping alive
        self._forget_the_dead()
        self._local = {i: mapped for i, endpoint in enumerate(endpoints)
                       if endpoint.details is not None and endpoint.node == here
                       and (mapped := self._views(endpoint.details)) is not None}
        self._remote = {i: endpoint.actor for i, endpoint in enumerate(endpoints) if i not in self._local}

    def send(self, buckets: Iterable[Bucket], version: int) -> SendReport:
        """Every bucket into the prepared engines (once each); those that died are reported among
        the remote ones (a dead local engine shows when its session ends)."""
        local, remote, failed, sent = self._local, dict(self._remote), [], 0
        self._local, self._remote = {}, {}  # one sync's: the views are not kept past it
        for bucket in buckets:
            for weights in local.values():
                with torch.no_grad():
                    for name, tensor in updates(bucket):  # a delta's sparse pieces written in place
                        if isinstance(tensor, Sparse):
                            scatter(_place(weights, name, None), tensor)
                        else:
                            _place(weights, name, tensor).copy_(tensor)
            if remote:
                lost = deliver(pack([(name, tensor.clone()) for name, tensor in bucket]), remote)  # see pack()
                remote = {i: actor for i, actor in remote.items() if i not in lost}
                failed += lost
            sent += sum(tensor_bytes(t) for _, t in bucket)
        return {"bytes": sent, "failed": failed}

    def _views(self, layout: SegmentLayout) -> dict[str, torch.Tensor] | None:
        """The engine's weights mapped here; None when this process may not open them (e.g. a
        container whose /proc does not allow it): that engine is then sent to like a remote one."""
        if layout.name not in self._attached:
            try:
                self._attached[layout.name] = (layout.pid, *attach(layout))
            except OSError as exc:
                log.warning("cannot map the weights of engine process %d (%s); sending through Ray's object store",
                            layout.pid, exc)
                return None
        return self._attached[layout.name][2]

    def _forget_the_dead(self) -> None:
        """Unmap the weights of engines whose process is gone (the memory is freed with it)."""
        self._forget([name for name, (pid, _, _) in self._attached.items() if not os.path.exists(f"/proc/{pid}")])

    def _forget(self, names: list[str]) -> None:
        for name in names:
            _, mapping, _ = self._attached.pop(name)
            _unmap(mapping)

    def close(self) -> None:
        self._local, self._remote = {}, {}
        self._forget(list(self._attached))


def _place(weights: dict[str, torch.Tensor], name: str, tensor: torch.Tensor | None) -> torch.Tensor:
    """The engine's weight ``name``, checked to take ``tensor`` whole (None: a delta's piece, which
    :func:`~bpo_megatron.weight_sync.delta.scatter` checks)."""
    target = weights.get(name)
    if target is None:
        raise ValueError(f"weight sync: {name!r} is not a weight of the engine (expected Hugging Face on-disk "
                         f"names such as {next(iter(weights))!r})")
    if tensor is not None and target.shape != tensor.shape:
        raise ValueError(f"weight sync: {name!r} has shape {tuple(tensor.shape)}, the engine expects "
                         f"{tuple(target.shape)}")
    return target


def _unmap(mapping) -> None:
    import gc

    gc.collect()  # views of the mapping must be gone before it can be closed
    try:
        mapping.close()
    except BufferError:  # a view is still alive somewhere: the mapping goes with it
        pass
