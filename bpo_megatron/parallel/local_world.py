"""Run a function on N local processes that form one gloo ``torch.distributed`` world.

Used by checkpoint conversion (a Megatron layout on one machine), the benchmarks and the test
suite. Each rank is a fresh process (forkserver with torch
preloaded, so a rank starts in well under a second), uses one torch thread, rendezvouses on
127.0.0.1, and is torn down even when another rank fails or the world times out.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable

# Imported once by the fork server, so each rank starts with them loaded (megatron-core alone takes
# several seconds to import). A module that fails to import is skipped by the server.
_PRELOAD = [
    "bpo_megatron.parallel._quiet_imports",
    "torch",
    "torch.distributed",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing",
]


class GlooWorldError(RuntimeError):
    """A rank raised, died, or the world did not finish within its timeout."""


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    # Preloading makes every rank a fork of a process that already imported torch; the
    # server itself never starts torch's thread pools, so forking it is safe.
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _rank_main(fn, rank, world_size, port, timeout_s, args, kwargs, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already fixed in this process; the intra-op setting is what matters
        pass
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend="gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        out = fn(*args, **kwargs)
        # Serialised to bytes here: a tensor put on the queue as is would be shared through a file
        # descriptor that dies with this process before the parent reads it.
        payload = io.BytesIO()
        torch.save(out, payload)
        results.put((rank, "ok", payload.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _load(payload: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)


def run_gloo_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the results by rank.

    ``fn`` must be importable (a module-level function) and return something picklable. Inside
    ``fn``, ``torch.distributed`` is initialised (``dist.get_rank()`` gives the rank). If any rank
    raises, the others are killed and :class:`GlooWorldError` carries that rank's traceback.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    import torch.distributed as dist

    ctx = _context()
    results = ctx.Queue()
    # The world's rendezvous lives here, on a port bound as the OS assigned it (a port probed free
    # and bound later by a rank can be taken in between); it outlives every rank.
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    port = store.port
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, timeout, args, kwargs, results),
            name=f"gloo-rank{rank}",
            # Not daemonic: a rank may start processes of its own (the distributed checkpoint
            # writer does); the finally block below reaps every rank instead.
            daemon=False,
        )
        for rank in range(world_size)
    ]
    env_backup = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the ranks before torch sizes its pool
    try:
        for proc in procs:
            proc.start()
    finally:
        if env_backup is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_backup

    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise GlooWorldError(
                    f"{fn.__name__}: ranks {missing} did not finish within {timeout:.0f}s"
                )
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    # a rank can die without reporting (segfault, OOM kill)
                    time.sleep(0.5)
                    if results.empty():
                        codes = {p.name: p.exitcode for p in dead}
                        raise GlooWorldError(f"{fn.__name__}: rank process died: {codes}")
                continue
            if status == "error":
                raise GlooWorldError(f"{fn.__name__} failed on rank {rank}:\n{payload}")
            outputs[rank] = _load(payload)
    finally:
        for proc in procs:
            proc.join(timeout=5.0 if len(outputs) == world_size else 0.1)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        results.close()
    return [outputs[rank] for rank in range(world_size)]
