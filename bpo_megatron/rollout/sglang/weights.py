"""Weight transfer to an SGLang server: NCCL broadcast (own GPUs) or CUDA IPC handles (shared GPUs).

Both sides of ``/init_weights_update_group`` must meet in one process group. SGLang 0.5.23's
receivers join with ``sglang.srt.utils.init_custom_process_group`` as rank ``rank_offset +
tp_rank``: a ``tcp://`` rendezvous (rank 0 hosts the TCP store), the store wrapped in
``PrefixStore(group_name)``, then torch's process-group helper adds ``"{group_name}/"`` and a
per-device ``"{device}/"`` prefix (``cpu`` for gloo, ``cuda`` for NCCL). :class:`DistributedWeightSender`
is rank 0 of that group with the same key chain, so its keys meet theirs (a bare store does not:
both sides wait on different keys until the 30-minute default timeout).
"""

from __future__ import annotations

import base64
import datetime

import torch
import torch.distributed as dist

from bpo_megatron.rollout.sglang import ipc_pickle
from bpo_megatron.rollout.sglang.nccl import NcclVersion, nccl_version
from bpo_megatron.weights.flat_bucket import ALIGN, FlatBucket

_DEVICE_PREFIX = {"gloo": "cpu", "nccl": "cuda"}
# the groups close() aborts: NCCL's (a torch built without NCCL, e.g. a CPU wheel, has no such class)
_ABORTABLE = tuple(c for c in (getattr(dist, "ProcessGroupNCCL", None),) if c is not None)


class DistributedWeightSender:
    """Rank 0 of the update group shared with the server's TP ranks (not this process's world)."""

    def __init__(self, store: dist.TCPStore, world_size: int, backend: str, group_name: str,
                 timeout_s: float = 600.0) -> None:
        """``store``: the group's rendezvous, hosted by this process (the engines' ranks join it at
        its host and port)."""
        if backend not in _DEVICE_PREFIX:
            raise ValueError(f"weight update backend must be 'nccl' or 'gloo', got {backend!r}")
        self.group_name = group_name
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = store
        store = dist.PrefixStore(f"{_DEVICE_PREFIX[backend]}/", dist.PrefixStore(
            f"{group_name}/", dist.PrefixStore(group_name, self._store)))
        if backend == "gloo":
            self._group = dist.ProcessGroupGloo(store, 0, world_size, timeout)
        else:
            self._group = dist.ProcessGroupNCCL(store, 0, world_size)

    @staticmethod
    def nccl_version() -> NcclVersion | None:
        """The NCCL this process (trainer rank 0) loads, None without one: what every engine's
        server must load too (:func:`~bpo_megatron.rollout.sglang.nccl.check_nccl_versions`)."""
        return nccl_version()

    @staticmethod
    def packed(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The bucket in the order it is packed: by element size, largest first, so every
        tensor starts at a multiple of its own element size with no padding between them (SGLang's
        receiving bucket is packed so, and refuses a misaligned tensor)."""
        return sorted(bucket, key=lambda item: -item[1].element_size())

    def metadata(self, bucket: list[tuple[str, torch.Tensor]]) -> dict:
        """``/update_weights_from_distributed``'s body for ``bucket``, in :meth:`packed` order:
        SGLang allocates one buffer of this layout (``flattened_bucket``) and receives the
        bucket in a single broadcast."""
        ordered = self.packed(bucket)
        return {
            "names": [name for name, _ in ordered],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in ordered],
            "shapes": [list(t.shape) for _, t in ordered],
            "group_name": self.group_name,
            "load_format": "flattened_bucket",
            "flush_cache": False,  # once, when the update ends
        }

    def broadcast(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """One broadcast of the whole bucket, packed (one copy) as :meth:`metadata` describes it:
        no padding (``align=1``), as SGLang's receiving bucket allocates it."""
        self._group.broadcast(FlatBucket.pack(self.packed(bucket), align=1).buffer, 0).wait()

    def close(self) -> None:
        """Leave the group. An NCCL communicator is aborted, not just dropped: its peers (the
        servers' ranks) may be gone or replaced, and a dropped one keeps its GPU buffers until the
        process ends and may hang it at exit; a gloo group has nothing to abort."""
        group, self._group, self._store = self._group, None, None
        if isinstance(group, _ABORTABLE):
            group.abort()


def flattened_bucket(bucket: list[tuple[str, torch.Tensor]] | FlatBucket) -> dict:
    """SGLang's ``flattened_bucket`` load format: one uint8 buffer on the tensors' device holding
    them back to back, each at a multiple of :data:`ALIGN` bytes, and per tensor its name, shape,
    dtype and byte range (:mod:`bpo_megatron.weights.flat_bucket` defines the layout). A
    :class:`FlatBucket` is in this layout already: its buffer is handed over as is, not copied;
    named tensors are copied into a new one."""
    flat = bucket if isinstance(bucket, FlatBucket) else FlatBucket.pack(bucket, align=ALIGN)
    return {"flattened_tensor": flat.buffer, "metadata": flat.entries}


def ipc_payload(bucket: dict, serializer=None) -> str:
    """A flattened bucket as one entry of ``serialized_named_tensors``: the device buffer becomes a
    CUDA IPC handle named by its device's UUID (:mod:`~bpo_megatron.rollout.sglang.ipc_pickle`,
    what SGLang's serializer with its patched reductions makes), so the server maps the sender's
    memory; SGLang itself is not needed beside the trainer.

    Only device memory may travel this way: host memory would travel inside the request, a copy of
    every weight per TP rank and per bucket, where the route exists to share memory. Host tensors
    are refused. ``serializer`` (tests only) replaces the pickler, e.g. :func:`inline_serializer`.
    """
    if serializer is None:
        if not bucket["flattened_tensor"].is_cuda:
            raise ValueError("CUDA IPC hands the server device memory; these weights are in host memory, which "
                             "another process cannot map: colocated SGLang engines receive weights from the "
                             "trainer's GPUs (cluster.colocate=false sends them by NCCL broadcast instead)")
        serializer = ipc_pickle.dumps
    payload = serializer(bucket)
    return base64.b64encode(payload).decode() if isinstance(payload, bytes) else payload


def ipc_update_body(payloads: list[str], version: int) -> dict:
    """``/update_weights_from_tensor``: entry ``i`` is read by the server's TP rank ``i`` only."""
    return {"serialized_named_tensors": payloads, "load_format": "flattened_bucket", "flush_cache": False,
            "weight_version": str(version)}


def inline_serializer(bucket: dict) -> bytes:
    """A flattened bucket pickled by value (its bytes inside the payload) by the IPC route's own
    pickler, which SGLang's safe unpickler accepts: for CPU tests of the route only, never for
    real transfers."""
    return ipc_pickle.dumps({**bucket, "flattened_tensor": bucket["flattened_tensor"].detach().cpu()})
