"""The colocated weight path: a trainer process hands its weights to an engine process on the same
GPU by CUDA IPC, as one flattened bucket (a single device buffer plus a name/dtype/shape/offset
table, the layout SGLang's ``flattened_bucket`` load format uses), never through host memory.

The engine (the embedded engine in its own process) starts from other random weights; after the
handoff its weights' fingerprints equal what was sent. Bandwidth: the receiver's copy out of the
shared buffer against a device-to-device copy of the same bytes inside one process. On a CPU the
same code shares host memory between the processes instead (a stand-in, said so in the report).
"""

from __future__ import annotations

import queue
import statistics
import time
from pathlib import Path

import torch

from bpo_megatron import platform
from bpo_megatron.gpu_smoke.common import synchronize
from bpo_megatron.testing import random_model_dir
from bpo_megatron.gpu_smoke.profiles import Profile
from bpo_megatron.gpu_smoke.report import Outcome
from bpo_megatron.rollout.sglang.weights import flattened_bucket

WAIT_S = 300.0
REPEATS = 3


def unflatten(flat: torch.Tensor, entries: list) -> list[tuple[str, torch.Tensor]]:
    """Views into ``flat`` (no copies) under their names, dtypes and shapes, as SGLang's loader
    reads a flattened bucket."""
    return [(e.name, flat[e.start_idx:e.end_idx].view(e.dtype).view(e.shape)) for e in entries]


def median_copy_seconds(destination: torch.Tensor, source: torch.Tensor) -> float:
    """Median time of copying ``source`` into ``destination`` (device work included)."""
    times = []
    for _ in range(REPEATS):
        synchronize()
        start = time.perf_counter()
        destination.copy_(source)
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _checksum(buffer: torch.Tensor) -> int:
    return int(buffer.view(torch.int32).sum(dtype=torch.int64))


def engine_process(model_dir: str, dtype: str, device: str, inbox, outbox) -> None:
    """The engine side: its own process (and, on a GPU, its own CUDA context on the same device)."""
    try:
        from bpo_megatron.models.options import TORCH_DTYPES
        from bpo_megatron.weights.checksums import fingerprints
        from bpo_megatron.rollout.hf.engine import HFEngine

        if device == "cpu":
            torch.set_num_threads(1)
        engine = HFEngine(model_dir, capture_routing=False, dtype=TORCH_DTYPES[dtype], device=device)
        outbox.put(("ready", fingerprints(engine.named_hf_weights())))
        while True:
            message = inbox.get(timeout=WAIT_S)
            if message[0] == "stop":
                break
            if message[0] == "weights":
                _, flat, entries = message
                synchronize()
                start = time.perf_counter()
                engine.begin_weight_update(1)
                received = engine.update_weights(unflatten(flat, entries))
                engine.end_weight_update()
                synchronize()
                seconds = time.perf_counter() - start
                del flat
                outbox.put(("weights", received, seconds, fingerprints(engine.named_hf_weights())))
            elif message[0] == "raw":
                _, shared = message
                local = torch.empty_like(shared)
                seconds = median_copy_seconds(local, shared)
                del shared
                outbox.put(("raw", seconds, _checksum(local)))
        engine.shutdown()
    except BaseException as error:  # noqa: BLE001 - the sender must hear of any failure
        import traceback

        outbox.put(("error", f"{error!r}\n{traceback.format_exc()}"))


def _expect(outbox, kind: str):
    try:
        message = outbox.get(timeout=WAIT_S)
    except queue.Empty:
        raise TimeoutError(f"the engine process sent no {kind!r} reply within {WAIT_S:.0f} s") from None
    if message[0] == "error":
        raise RuntimeError(f"engine process failed:\n{message[1]}")
    if message[0] != kind:
        raise RuntimeError(f"engine process replied {message[0]!r}, expected {kind!r}")
    return message[1:]


def run(profile: Profile, workdir: Path) -> Outcome:
    from safetensors.torch import load_file

    from bpo_megatron.models.options import TORCH_DTYPES
    from bpo_megatron.weights.checksums import fingerprints

    out = Outcome("ipc_weights")
    device = str(platform.device())
    engine_dir = random_model_dir(profile.small_model, workdir / "small_moe", seed=0)
    trainer_dir = random_model_dir(profile.small_model, workdir / "small_moe_seed1", seed=1)
    dtype = TORCH_DTYPES[profile.dtype]
    # the "trainer's" new weights, on its device, in the engine's precision and on-disk names
    named = [(n, t.to(device=device, dtype=dtype)) for n, t in sorted(load_file(str(trainer_dir / "model.safetensors")).items())]
    sent = fingerprints(named)

    ctx = torch.multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    engine = ctx.Process(target=engine_process, args=(str(engine_dir), profile.dtype, device, inbox, outbox), daemon=True)
    engine.start()
    try:
        (before,) = _expect(outbox, "ready")
        bucket = flattened_bucket(named)  # what the colocated transport hands SGLang
        flat, entries = bucket["flattened_tensor"], bucket["metadata"]
        del bucket
        synchronize()
        start = time.perf_counter()
        inbox.put(("weights", flat, entries))
        received, engine_seconds, after = _expect(outbox, "weights")
        round_trip = time.perf_counter() - start
        nbytes = flat.numel()
        del flat

        raw = torch.randint(-2**31, 2**31 - 1, (profile.ipc_bytes // 4,), dtype=torch.int32, device=device).view(torch.uint8)
        local_s = median_copy_seconds(torch.empty_like(raw), raw)
        inbox.put(("raw", raw))
        remote_s, remote_checksum = _expect(outbox, "raw")
        checksum = _checksum(raw)
        inbox.put(("stop",))
        engine.join(timeout=60)
    finally:
        if engine.is_alive():
            engine.kill()
            engine.join(timeout=10)

    changed = sum(before[n] != sent[n] for n in sent if n in before)
    wrong = sorted(n for n in sent if after.get(n) != sent[n])
    gbps = lambda b, s: b / s / 1e9  # noqa: E731
    out.numbers.update(
        transport="CUDA IPC (torch.multiprocessing)" if device.startswith("cuda") else "shared host memory (CPU stand-in)",
        tensors=len(entries), bucket_bytes=nbytes, bytes_loaded_by_engine=received,
        engine_update_s=engine_seconds, engine_update_gb_per_s=gbps(nbytes, engine_seconds),
        round_trip_s=round_trip, raw_bytes=profile.ipc_bytes,
        cross_process_copy_gb_per_s=gbps(profile.ipc_bytes, remote_s),
        same_process_d2d_copy_gb_per_s=gbps(profile.ipc_bytes, local_s),
        cross_vs_same_process=local_s / remote_s,
    )
    out.require(changed > 0, f"the engine started from other weights ({changed} of {len(sent)} tensors differ)")
    out.require(not wrong and set(after) == set(sent),
                f"after the handoff every engine tensor's fingerprint equals the trainer's ({len(wrong)} differ)")
    out.require(received == nbytes, f"the engine loaded every byte of the bucket ({received} of {nbytes})")
    out.require(remote_checksum == checksum, "the raw buffer arrived intact (checksums equal)")
    out.notes.append("Bandwidth counts bytes copied once (read + write would double it); the same-process "
                     "device-to-device copy of the same bytes is the reference.")
    if not device.startswith("cuda"):
        out.notes.append("CPU mode: host memory shared between processes stands in for CUDA IPC.")
    return out
