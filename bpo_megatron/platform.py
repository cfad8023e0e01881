"""The one place where the CUDA path and the CPU path are chosen.

Everything else in bpo-megatron asks these functions instead of calling ``torch.cuda`` directly, so
a machine without a GPU runs the same code on CPU tensors over gloo rather than a mocked GPU path.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import socket
from typing import Literal

import torch

DistributedBackend = Literal["nccl", "gloo"]


def has_cuda() -> bool:
    """True when torch was built with CUDA and can see at least one GPU."""
    return torch.cuda.is_available()


def local_rank() -> int:
    """This process's index among the ranks of its node (set by torchrun, Slurm or Ray)."""
    # LOCAL_RANK is how every launcher we support tells a process which GPU is its own.
    return int(os.environ.get("LOCAL_RANK", "0"))


def device() -> torch.device:
    """The device this process computes on: its own GPU, or the CPU."""
    if has_cuda():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def bind_device() -> torch.device:
    """Make :func:`device` this process's current CUDA device (NCCL and every kernel then use its
    own GPU, not GPU 0); nothing to do on a CPU."""
    own = device()
    if own.type == "cuda":
        torch.cuda.set_device(own)
    return own


DEVICE_MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def set_device_max_connections(value: str | None, environ=None) -> str | None:
    """Set ``CUDA_DEVICE_MAX_CONNECTIONS`` to ``value`` in this process's environment, which the
    CUDA driver reads once, when the process makes its context: call it before :func:`bind_device`.
    None leaves the environment as it is. A different value already set is kept (the user's choice)
    and said; so is a context made already (the setting then has no effect). Returns the line to
    log, or None when there is nothing to say."""
    environ = os.environ if environ is None else environ
    if value is None:
        return None
    current = environ.get(DEVICE_MAX_CONNECTIONS)
    if current is not None and current != value:
        return (f"{DEVICE_MAX_CONNECTIONS}={current} kept from the environment; Megatron-Core's tensor-parallel "
                f"layers overlap their communication with the gradient GEMMs only at {value}")
    environ[DEVICE_MAX_CONNECTIONS] = value
    if torch.cuda.is_initialized():
        return (f"{DEVICE_MAX_CONNECTIONS}={value} set after this process made its CUDA context: it takes effect "
                "only in processes started from here on")
    return None


def distributed_backend() -> DistributedBackend:
    """The ``torch.distributed`` backend matching :func:`device` (NCCL needs CUDA tensors)."""
    return "nccl" if has_cuda() else "gloo"


def release_cached_memory() -> None:
    """Hand the caching allocator's free blocks back to the device and reclaim blocks other
    processes mapped by CUDA IPC and have let go of: a colocated engine is about to take the
    device memory this process no longer uses. Nothing to do without CUDA."""
    if has_cuda():
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()


@functools.cache
def has_transformer_engine() -> bool:
    """True when transformer-engine is installed.

    Only the package metadata is looked up: importing TE initialises CUDA, so it must not happen
    as a side effect of importing bpo-megatron (TE is a GPU-only extra).
    """
    return importlib.util.find_spec("transformer_engine") is not None


@functools.cache
def has_triton() -> bool:
    """True when triton is installed (looked up, not imported: importing it is slow)."""
    return importlib.util.find_spec("triton") is not None


def runs_triton(device: torch.device) -> bool:
    """True when triton kernels can run on tensors of ``device``: a CUDA device, triton installed.
    Callers with a CPU fallback ask this; the fallback is the path on every other machine."""
    return device.type == "cuda" and has_triton()


def has_fp8_block_gemm(device: torch.device) -> bool:
    """True when ``torch._scaled_mm`` multiplies e4m3 matrices with 1 × 128 / 128 × 128 block scales
    on ``device``: a CUDA device of compute capability 9.x (Hopper; cuBLAS has these kernels for
    sm90 only). FP8 GEMMs emulate the same rounding elsewhere (:mod:`bpo_megatron.weights.fp8`)."""
    return device.type == "cuda" and _compute_capability(device.index)[0] == 9


@functools.cache
def _compute_capability(index: int | None) -> tuple[int, int]:
    # asked once per device: it is read on every FP8 GEMM, inside captured decode steps too
    return torch.cuda.get_device_capability(index)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now (the operating system's choice; free
    until someone binds it, so bind it soon)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
