"""Set-up hooks for the processes of a loop run over the SGLang stand-in (Ray's
``worker_process_setup_hook``): what no CPU can do, replaced at the device boundary only."""

from __future__ import annotations


def inline_ipc() -> None:
    """CUDA IPC handles need a GPU: the colocated transport's buckets travel by value instead,
    through the same pickler, to SGLang's own deserialiser (tests only)."""
    from bpo_megatron.rollout.sglang.weights import inline_serializer
    from bpo_megatron.rollout.sglang.cuda_ipc import CudaIpc

    CudaIpc.__init__.__defaults__ = (inline_serializer,)
