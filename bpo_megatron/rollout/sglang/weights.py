"""Weight transfer to an SGLang server: NCCL broadcast (separate GPUs) or CUDA IPC (shared GPUs)."""

from __future__ import annotations

import base64
import datetime
import pickle

import torch
import torch.distributed as dist


class DistributedWeightSender:
    """Rank 0 of a process group shared with the server's TP workers (not this process's world)."""

    def __init__(self, master_address: str, master_port: int, world_size: int, backend: str,
                 group_name: str, timeout_s: float = 600.0) -> None:
        self.group_name = group_name
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout)
        if backend == "gloo":
            self._group = dist.ProcessGroupGloo(self._store, 0, world_size, timeout)
        elif backend == "nccl":
            self._group = dist.ProcessGroupNCCL(self._store, 0, world_size)
        else:
            raise ValueError(f"weight update backend must be 'nccl' or 'gloo', got {backend!r}")

    def metadata(self, bucket: list[tuple[str, torch.Tensor]]) -> dict:
        return {
            "names": [name for name, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.group_name,
            "flush_cache": False,
        }

    def broadcast(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        for _, tensor in bucket:
            self._group.broadcast(tensor.contiguous(), 0).wait()

    def close(self) -> None:
        self._group = None
        self._store = None


def tensor_update_body(bucket: list[tuple[str, torch.Tensor]], tp_size: int, serializer=None) -> dict:
    """``/update_weights_from_tensor`` body: one serialized copy of the bucket per server TP rank.

    SGLang's ``MultiprocessingSerializer`` turns CUDA tensors into IPC handles, so the server
    maps the trainer's memory instead of copying it over HTTP; it only works on shared GPUs.
    """
    if serializer is None:
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


def pickle_serializer(named: list[tuple[str, torch.Tensor]]) -> bytes:
    """A CPU stand-in for SGLang's serializer (tests and debugging only)."""
    return pickle.dumps([(name, tensor.cpu()) for name, tensor in named])
