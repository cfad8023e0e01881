"""What the checks share beyond the kit (``bpo_megatron.testing``): a one-rank world, the train
actor in a profile's precision, a timer."""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bpo_megatron import platform
from bpo_megatron.gpu_smoke.profiles import Profile


@contextlib.contextmanager
def single_rank_world(timeout_s: float = 300.0) -> Iterator[None]:
    """A torch.distributed world of this process alone (NCCL on a GPU, gloo on a CPU), as a
    trainer with world size 1 runs; torn down on exit."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)  # a port bound as assigned
    if platform.has_cuda():
        torch.cuda.set_device(platform.device())
    dist.init_process_group(backend=platform.distributed_backend(), store=store, rank=0, world_size=1,
                            timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def synchronize() -> None:
    if platform.has_cuda():
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed(into: dict[str, float], key: str) -> Iterator[None]:
    """Wall time of the block in seconds (device work included), stored as ``into[key]``."""
    synchronize()
    start = time.perf_counter()
    yield
    synchronize()
    into[key] = time.perf_counter() - start


def build_actor(profile: Profile, config: dict[str, Any], *, replay: bool, micro_batch_size: int,
                lr: float = 1e-5, weights: Path | None = None, temperature: float = 1.0,
                max_tokens_per_micro_batch: int = 0, model_options: dict[str, Any] | None = None):
    """A one-rank Megatron train actor in the profile's precision (bf16 + Megatron's distributed
    optimizer on a GPU; fp32 on a CPU), loaded from ``weights`` if given (the kit's
    :func:`~bpo_megatron.testing.build_actor`, with BPO's loss)."""
    from bpo_megatron import testing

    return testing.build_actor(config, replay=replay, micro_batch_size=micro_batch_size, lr=lr, loss="bpo",
                               temperature=temperature, weights=weights, params_dtype=profile.dtype,
                               max_tokens_per_micro_batch=max_tokens_per_micro_batch, model_options=model_options)


def device_name() -> str:
    return torch.cuda.get_device_name() if platform.has_cuda() else "cpu"
