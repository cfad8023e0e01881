"""The colocated route's payload (ours, built without SGLang) against SGLang 0.5.23's own receiving
code, in a separate process of SGLang's environment (its own authkey: nothing of this process tree
can be opened there). They need that environment (``bash tools/setup.sh --sglang``) and skip
without it.

* By value (what runs on a CPU): each TP rank's entry goes through SGLang's
  ``TpModelWorker.deserialize_own_rank`` (its ``SafeUnpickler`` allow-list) and its
  ``WeightUpdater._update_weights_from_flattened_bucket``; the tensors SGLang would load equal the
  trainer's bit for bit.
* At the device boundary: a CUDA tensor cannot exist here, so torch's CUDA reduction and the
  devices' UUIDs are stood in for, the same way in both processes, and SGLang's own serializer
  (``MultiprocessingSerializer`` after ``monkey_patch_torch_reductions``) pickles the same bucket.
  Both payloads, read by SGLang's ``SafeUnpickler`` (its allow-list applies) with every global
  recorded instead of called, are the same: the same rebuild function, the same arguments, the
  device as the same UUID.

What needs a GPU and is not checked: torch's IPC handle itself (``storage._share_cuda_``), SGLang
mapping it (``_rebuild_cuda_tensor_modified`` looking the UUID up among its devices) and reading
the trainer's memory.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from bpo_megatron.rollout.sglang.ipc_pickle import DEVICE_ARG, SGLANG_CUDA_REBUILD
from bpo_megatron.rollout.sglang.weights import flattened_bucket, inline_serializer, ipc_payload

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
TIMEOUT_S = 300  # SGLang's imports take a while on a loaded 2-core machine

pytestmark = [
    pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                       reason="SGLang's environment is missing: bash tools/setup.sh --sglang"),
    pytest.mark.timeout(2 * TIMEOUT_S),
]

# torch's CUDA reduction of a tensor and the devices' UUIDs as a GPU would give them; run in both
# processes before anything is pickled
STAND_IN = r'''
import torch
from types import SimpleNamespace
from torch.multiprocessing import reductions

UUIDS = ["GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000"]
ARGS = (torch.Tensor, torch.Size([64]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 1, b"\x07ipc-handle",
        4096, 512, False, b"ref-counter", 3, b"\x01event", True)
torch.cuda.get_device_properties = lambda index: SimpleNamespace(uuid=UUIDS[index])


def stand_in_torch_cuda_reduction(name):
    """torch's reduce_tensor on a CUDA tensor: its CUDA branch (storage._share_cuda_) needs a GPU.
    Its function is the module's rebuild_cuda_tensor as torch looks it up when reducing."""
    setattr(reductions, name, lambda tensor: (reductions.rebuild_cuda_tensor, ARGS))


class LooksCuda(torch.Tensor):
    @property
    def is_cuda(self):
        return True
'''

OURS = STAND_IN + r'''
import base64, json, sys
from bpo_megatron.rollout.sglang.weights import flattened_bucket, ipc_payload

stand_in_torch_cuda_reduction("reduce_tensor")
flat = flattened_bucket([("a", torch.arange(6, dtype=torch.bfloat16)), ("b", torch.ones(2, 3))])
flat["flattened_tensor"] = torch.Tensor._make_subclass(LooksCuda, flat["flattened_tensor"])
entries = [vars(entry) | {"shape": list(entry.shape), "dtype": str(entry.dtype).removeprefix("torch.")}
           for entry in flat["metadata"]]
print("result " + json.dumps({"payload": ipc_payload(flat), "entries": entries}))
'''

# SGLang's side: its serializer on the same bucket, and both payloads read by its SafeUnpickler
THEIRS = STAND_IN + r'''
import base64, inspect, io, json, sys
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.common import SafeUnpickler
from sglang.srt.utils import patch_torch

ours = json.loads(sys.stdin.read())
patch_torch.monkey_patch_torch_reductions()  # as SGLang's sender and receiver both do
stand_in_torch_cuda_reduction("_reduce_tensor_original")  # what SGLang's patched reduction calls
metadata = [SimpleNamespace(**{**e, "shape": torch.Size(e["shape"]), "dtype": getattr(torch, e["dtype"])})
            for e in ours["entries"]]
theirs = MultiprocessingSerializer.serialize({"flattened_tensor": torch.zeros(64, dtype=torch.uint8),
                                              "metadata": metadata}, output_str=True)


class Named:
    def __init__(self, module, name):
        self.key = [module, name]

    def __call__(self, *args):
        return Called(self.key, args)


class Called:
    def __init__(self, key, args):
        self.key, self.args, self.state = key, args, None

    def __setstate__(self, state):
        self.state = state


class Recording(SafeUnpickler):
    """SGLang's unpickler, its allow-list enforced, recording each global instead of calling it."""

    def find_class(self, module, name):
        SafeUnpickler.find_class(self, module, name)  # raises for a global SGLang does not admit
        return Named(module, name)


def plain(obj):
    if isinstance(obj, Named):
        return {"global": obj.key}
    if isinstance(obj, Called):
        return {"call": obj.key, "args": plain(obj.args), "state": plain(obj.state)}
    if isinstance(obj, dict):
        return {"dict": sorted([key, plain(value)] for key, value in obj.items())}
    if isinstance(obj, (list, tuple)):
        return {type(obj).__name__: [plain(item) for item in obj]}
    if isinstance(obj, bytes):
        return {"bytes": obj.hex()}
    return obj


def read(payload):
    return plain(Recording(io.BytesIO(base64.b64decode(payload))).load())


original = reductions._rebuild_cuda_tensor_original
print("result " + json.dumps({
    "ours": read(ours["payload"]), "theirs": read(theirs),
    "device_arg": patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX,
    "rebuild_parameters": list(inspect.signature(original).parameters),
    "patched_rebuild": [reductions.rebuild_cuda_tensor.__module__, reductions.rebuild_cuda_tensor.__qualname__],
}))
'''

# SGLang's receiving path for one TP rank: its own deserialisation and flattened-bucket loader;
# the model is ours (it records what SGLang hands its load_weights)
RECEIVE = r'''
import json, sys
from types import SimpleNamespace
import torch
from sglang.srt.managers import tp_worker
from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

payloads = json.loads(sys.stdin.read())
received = []
for rank in range(len(payloads)):
    tp_worker.get_parallel = lambda: SimpleNamespace(tp_rank=rank)
    data = tp_worker.TpModelWorker.deserialize_own_rank(None, payloads)
    loaded = []
    model = SimpleNamespace(load_weights=lambda named: loaded.extend(named))
    ok, message = WeightUpdater._update_weights_from_flattened_bucket(
        SimpleNamespace(get_model=lambda: model), flattened_tensor_bucket_dict=data)
    assert ok, message
    received.append([[name, str(t.dtype), list(t.shape), t.contiguous().view(-1).view(torch.uint8)
                      .numpy().tobytes().hex()] for name, t in loaded])
print("result " + json.dumps(received))
'''


def run(python: Path | str, code: str, stdin: str = "") -> dict | list:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([str(python), "-c", code], input=stdin, capture_output=True, text=True, env=env,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("result "))[len("result "):])


def test_sglang_loads_every_ranks_inline_payload_bit_for_bit():
    """TP = 2, each rank its own bucket (mixed dtypes, a transposed view, sizes off the alignment):
    SGLang reads rank r's entry only and loads exactly the trainer's tensors."""
    buckets = [
        [("model.embed_tokens.weight", torch.randn(5, 3, dtype=torch.bfloat16)),
         ("model.layers.0.mlp.gate.weight", torch.randn(4, 3).t()),
         ("model.layers.0.self_attn.q_norm.weight", torch.randn(7, dtype=torch.float16))],
        [("lm_head.weight", torch.randn(3, 5)), ("model.norm.bias", torch.arange(9, dtype=torch.int64))],
    ]
    payloads = [ipc_payload(flattened_bucket(bucket), inline_serializer) for bucket in buckets]
    received = run(SGLANG_PYTHON, RECEIVE, json.dumps(payloads))
    for bucket, loaded in zip(buckets, received):
        assert [row[0] for row in loaded] == [name for name, _ in bucket]
        for (name, tensor), (_, dtype, shape, data) in zip(bucket, loaded):
            assert (dtype, shape) == (str(tensor.dtype), list(tensor.shape)), name
            assert bytes.fromhex(data) == tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), name


def test_a_device_tensor_is_pickled_as_sglangs_patched_reduction_pickles_it():
    """Our payload and SGLang's serializer's, for the same bucket and the same (stood-in) CUDA
    reduction, read the same through SGLang's unpickler: SGLang's rebuild function by name, the
    device by UUID, every other argument as torch gave it, the metadata as admitted namespaces."""
    ours = run(ROOT / ".venv" / "bin" / "python", OURS)
    answer = run(SGLANG_PYTHON, THEIRS, json.dumps(ours))
    assert answer["ours"] == answer["theirs"]
    tensor = dict(answer["ours"]["dict"])["flattened_tensor"]
    assert tensor["call"] == list(SGLANG_CUDA_REBUILD) == answer["patched_rebuild"]
    assert tensor["args"]["tuple"][DEVICE_ARG] == "GPU-66666666-7777-8888-9999-000000000000"  # device 1's
    # the argument layout: SGLang's torch rebuilds from the arguments the trainer's torch gives,
    # the device where both SGLang's patch and ours put the UUID
    assert answer["device_arg"] == DEVICE_ARG
    assert answer["rebuild_parameters"] == list(inspect.signature(
        torch.multiprocessing.reductions.rebuild_cuda_tensor).parameters)
    assert answer["rebuild_parameters"][DEVICE_ARG] == "storage_device"
