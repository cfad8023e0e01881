"""One tensor-parallel rank of the SGLang stand-in (runs in SGLang's own environment).

What runs here is SGLang 0.5.23's own scheduler-side code: ``SchedulerWeightUpdaterManager``
(weight-update sessions, cache flush and version bookkeeping, memory release/resume tags),
``WeightUpdater`` (joining the trainer's update group with ``init_custom_process_group`` as rank
``rank_offset + tp_rank``, receiving broadcasts, loading tensors), ``TpModelWorker`` (each rank
deserialises its own entry of ``serialized_named_tensors`` with ``MultiprocessingSerializer``).

What is ours, because it needs a GPU or a real model: the model is a dict of the checkpoint's
tensors by Hugging Face name whose ``load_weights`` checks names, shapes and dtypes (a real
model would shard them); the loader's quantisation hooks (restore/postprocess) are no-ops, and so
is the device synchronisation; the rank's process group has this rank alone (real ranks share
one). The memory saver (``--enable-memory-saver``) does to host storages what torch_memory_saver
does to device pages: a released tag's memory is gone (the weights' storages are freed, a load
into them kills the rank, as a write to unmapped device memory kills a real one) and a resumed
tag gets fresh memory whose content is undefined (NaN weights here: a resume without a sync
shows in the fingerprints). SGLang's own updater decides the rest: which tags are released
(``offload_tags``, a ``KeyError`` for resuming one that was not) and that a release needs an idle
server (its assertion, fed with whether requests are running).
"""

from __future__ import annotations

import hashlib
import socket
import traceback
import types

import torch
import torch.distributed as dist


class CheckpointModel(torch.nn.Module):
    """The served model's weights by on-disk name; ``load_weights`` as SGLang models call it."""

    def __init__(self, model_dir: str) -> None:
        super().__init__()
        from pathlib import Path

        from safetensors.torch import load_file

        # every file of the checkpoint, as SGLang's loader reads it (one file, or the shards of an index)
        self.weights = {name: tensor for file in sorted(Path(model_dir).glob("*.safetensors"))
                        for name, tensor in load_file(str(file)).items()}
        self.released = False

    def load_weights(self, named) -> None:
        if self.released:
            raise RuntimeError("illegal memory access: weights loaded into released memory "
                               "(release_memory_occupation freed them; resume them first)")
        for name, tensor in named:
            if name not in self.weights:
                raise KeyError(f"{name} is not a weight of the served model")
            target = self.weights[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the model has {tuple(target.shape)}")
            target.copy_(tensor.to(target.dtype))

    def fingerprints(self) -> dict[str, str]:
        out = {}
        for name, tensor in self.weights.items():
            digest = hashlib.blake2b(digest_size=16)
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
            out[name] = digest.hexdigest()
        return out


class ReleasableMemory:
    """torch_memory_saver's effect, on host storages: ``pause(tag)`` frees the tag's memory,
    ``resume(tag)`` allocates it again with undefined content (the interface of SGLang's
    ``TorchMemorySaverAdapter`` that its weight updater calls)."""

    enabled = True

    def __init__(self, model: CheckpointModel) -> None:
        self.model = model
        self.kv_cache = torch.zeros(1 << 16, dtype=torch.uint8)  # stands for the KV pool
        self.shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def check_validity(self, caller_name) -> None:
        pass

    def pause(self, tag: str) -> None:
        if tag == "weights":
            self.shapes = {name: (tuple(t.shape), t.dtype) for name, t in self.model.weights.items()}
            self.model.weights = {name: torch.empty(0, dtype=dtype) for name, (_, dtype) in self.shapes.items()}
            self.model.released = True
        elif tag == "kv_cache":
            self.kv_cache = torch.empty(0, dtype=torch.uint8)

    def resume(self, tag: str) -> None:
        if tag == "weights":
            self.model.weights = {name: torch.full(shape, float("nan"), dtype=dtype) if dtype.is_floating_point
                                  else torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in self.shapes.items()}
            self.model.released = False
        elif tag == "kv_cache":
            self.kv_cache = torch.empty(1 << 16, dtype=torch.uint8)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def import_sglang_rank_modules() -> None:
    """The SGLang modules a rank runs (``build``'s imports), for a server that forks its ranks."""
    from sglang.srt.disaggregation import utils  # noqa: F401
    from sglang.srt.managers import tp_worker  # noqa: F401
    from sglang.srt.managers.scheduler_components import weight_updater  # noqa: F401
    from sglang.srt.model_executor.model_runner_components import weight_updater as _  # noqa: F401
    from sglang.srt.utils import kill_itself_when_parent_died, torch_memory_saver_adapter  # noqa: F401


def build(tp_rank: int, model_dir: str, memory_saver: bool, activity: dict):
    """The rank's SGLang weight-update manager around a :class:`CheckpointModel`; ``activity``
    says whether requests are running (what SGLang's idle check reads)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers import tp_worker as tpw
    from sglang.srt.managers.scheduler_components import weight_updater as swu
    from sglang.srt.model_executor.model_runner_components import weight_updater as mwu
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    if not torch.cuda.is_available():  # SGLang synchronises its device after a release; there is none here
        torch.cuda.synchronize = lambda *args, **kwargs: None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel = types.SimpleNamespace(tp_group=types.SimpleNamespace(cpu_group=dist.group.WORLD), tp_rank=tp_rank)
    swu.get_parallel = mwu.get_parallel = tpw.get_parallel = lambda: parallel
    swu.get_model = mwu.get_model = lambda: types.SimpleNamespace(weight_cache_mode="off")  # no IPC weight cache
    mwu.DefaultModelLoader.restore_weights_before_loading = staticmethod(lambda model, device: None)
    mwu.DefaultModelLoader.postprocess_weights = staticmethod(lambda model, device: None)
    mwu.post_load_weights = lambda model: None

    model = CheckpointModel(model_dir)
    updater = mwu.WeightUpdater(tp_rank=tp_rank, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
                                get_model=lambda: model, update_model_fields=lambda *a, **k: None,
                                recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
    runner = types.SimpleNamespace(weight_updater=updater, model=model)
    worker = types.SimpleNamespace(weight_update_runners=lambda: [("target", runner)], model_runner=runner)
    origins: list = []  # ours: where each flattened bucket this rank read came from (a test's tag)

    def deserialize_own_rank(payload):
        data = tpw.TpModelWorker.deserialize_own_rank(worker, payload)
        if isinstance(data, dict) and "metadata" in data:
            origins.append(getattr(data["metadata"][0], "origin", None))
        return data

    worker.deserialize_own_rank = deserialize_own_rank
    worker.init_weights_update_group = lambda req: tpw.TpModelWorker.init_weights_update_group(worker, req)
    worker.destroy_weights_update_group = lambda req: tpw.TpModelWorker.destroy_weights_update_group(worker, req)
    state = {"version": "default"}
    scheduler = types.SimpleNamespace(_engine_paused=False, disaggregation_mode=DisaggregationMode.NULL,
                                      record_weight_version_change=lambda new_version: state.update(
                                          version=new_version if new_version is not None else state["version"]))
    memory = ReleasableMemory(model) if memory_saver else TorchMemorySaverAdapter.create(enable=False)
    manager = swu.SchedulerWeightUpdaterManager(
        tp_worker=worker, draft_worker=None, memory_saver_adapter=memory,
        flush_cache=lambda empty_cache=True: True, scheduler=scheduler,
        # SGLang: waiting requests do not count while the engine is paused; running ones always do
        is_fully_idle=lambda ignore_waiting=False: not activity["running"])
    state["origins"] = origins
    return manager, model, state


def rank_main(tp_rank: int, model_dir: str, conn, memory_saver: bool = False) -> None:
    """Serve the HTTP process's calls until it closes the pipe. An exception in SGLang's code
    ends this process, as it ends a real scheduler (the server then dies)."""
    from sglang.srt.utils import kill_itself_when_parent_died

    kill_itself_when_parent_died()  # as SGLang's schedulers do: a rank never outlives its server
    torch.set_num_threads(1)
    activity = {"running": False}
    manager, model, state = build(tp_rank, model_dir, memory_saver, activity)
    conn.send(("ready", None))
    while True:
        try:
            method, request = conn.recv()
        except EOFError:
            return
        try:
            if method == "fingerprints":
                result = model.fingerprints()
            elif method == "version":
                result = state["version"]
            elif method == "origins":
                result = state["origins"]
            elif method == "offload_tags":  # SGLang's own record of the released tags
                result = sorted(manager.offload_tags)
            elif method == "set_running":
                activity["running"] = bool(request)
                result = None
            else:
                out = getattr(manager, method)(request)
                result = (getattr(out, "success", True), getattr(out, "message", ""))
        except BaseException:  # noqa: BLE001 - reported to the HTTP process, which dies with it
            conn.send(("crash", traceback.format_exc()))
            return
        conn.send(("ok", result))
