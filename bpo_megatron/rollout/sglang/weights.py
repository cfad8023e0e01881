"""Weight transfer to an SGLang server: NCCL broadcast (own GPUs) or serialized tensors (shared GPUs).

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
import pickle

import torch
import torch.distributed as dist

_DEVICE_PREFIX = {"gloo": "cpu", "nccl": "cuda"}


class DistributedWeightSender:
    """Rank 0 of the update group shared with the server's TP ranks (not this process's world)."""

    def __init__(self, master_address: str, master_port: int, world_size: int, backend: str,
                 group_name: str, timeout_s: float = 600.0) -> None:
        if backend not in _DEVICE_PREFIX:
            raise ValueError(f"weight update backend must be 'nccl' or 'gloo', got {backend!r}")
        self.group_name = group_name
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout)
        store = dist.PrefixStore(f"{_DEVICE_PREFIX[backend]}/", dist.PrefixStore(
            f"{group_name}/", dist.PrefixStore(group_name, self._store)))
        if backend == "gloo":
            self._group = dist.ProcessGroupGloo(store, 0, world_size, timeout)
        else:
            self._group = dist.ProcessGroupNCCL(store, 0, world_size)

    def metadata(self, bucket: list[tuple[str, torch.Tensor]]) -> dict:
        return {
            "names": [name for name, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.group_name,
            "flush_cache": False,  # once, when the update ends
        }

    def broadcast(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        for _, tensor in bucket:
            self._group.broadcast(tensor.contiguous(), 0).wait()

    def close(self) -> None:
        self._group = None
        self._store = None


def tensor_update_body(bucket: list[tuple[str, torch.Tensor]], tp_size: int, serializer=None) -> dict:
    """``/update_weights_from_tensor`` body: one serialized copy of the bucket per server TP rank
    (rank ``i`` reads entry ``i``).

    SGLang's ``MultiprocessingSerializer`` turns CUDA tensors into IPC handles, so the server
    maps the trainer's memory instead of copying it over HTTP; it only works on shared GPUs, and
    only for device tensors: a host tensor would travel as a file descriptor of this process tree,
    which the server (another tree, another authkey) cannot open, so host tensors are refused.
    """
    if serializer is None:
        if any(not tensor.is_cuda for _, tensor in bucket):
            raise ValueError("rollout.sglang.weight_sync=tensor hands the server device memory (CUDA IPC); these "
                             "tensors are in host memory, which another process cannot map: use "
                             "weight_sync=distributed, or export the weights on the trainer's GPU")
        try:
            from sglang.srt.utils import MultiprocessingSerializer  # GPU-only extra
        except ImportError as exc:
            raise RuntimeError("rollout.sglang.weight_sync=tensor needs the sglang package (pip install "
                               "'bpo-megatron[sglang]') on a GPU machine") from exc
        serializer = lambda named: MultiprocessingSerializer.serialize(named, output_str=True)  # noqa: E731
    payload = serializer(list(bucket))
    if isinstance(payload, bytes):
        payload = base64.b64encode(payload).decode()
    return {"serialized_named_tensors": [payload] * tp_size, "load_format": None, "flush_cache": False}


def inline_serializer(named: list[tuple[str, torch.Tensor]]) -> bytes:
    """Tensors pickled by value (their bytes inside the payload), which SGLang's deserializer
    accepts: for CPU tests of the tensor route only, never for real transfers."""
    return pickle.dumps([(name, tensor.detach().cpu()) for name, tensor in named])
