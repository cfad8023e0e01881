"""The colocated route's payload (``ipc_payload``, ``ipc_pickle``) built in the trainer's environment
without SGLang. No GPU here: torch's CUDA reduction (the IPC handle of the tensor's allocation) and
the device's properties (its UUID) are stood in for; everything around them runs. What SGLang's
receiver makes of the payload is checked against SGLang's own code in
``tests/sglang_contract/test_ipc_payload.py``."""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from bpo_megatron.rollout.sglang.ipc_pickle import DEVICE_ARG, SGLANG_CUDA_REBUILD, device_reduction

# What torch's CUDA reduction returns for a tensor (its arguments to rebuild_cuda_tensor) and the
# UUIDs of the devices, as a GPU would give them: the code below stands them in, in a fresh process.
STAND_IN = r'''
import torch
from types import SimpleNamespace
from torch.multiprocessing import reductions

UUIDS = ["GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000"]
ARGS = (torch.Tensor, torch.Size([64]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 1, b"\x07ipc-handle",
        4096, 512, False, b"ref-counter", 3, b"\x01event", True)

# torch's CUDA branch (storage._share_cuda_) needs a GPU; its result is what it would return
reductions.reduce_tensor = lambda tensor: (reductions.rebuild_cuda_tensor, ARGS)
torch.cuda.get_device_properties = lambda index: SimpleNamespace(uuid=UUIDS[index])


class LooksCuda(torch.Tensor):
    """A host tensor that says it is on a GPU, so the route's device checks let it through."""

    @property
    def is_cuda(self):
        return True
'''

BUILD_WITHOUT_SGLANG = STAND_IN + r'''
import importlib.abc, json, sys


class NoSglang(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "sglang" or name.startswith("sglang."):
            raise ImportError(f"{name}: not in the trainer's environment")
        return None


sys.meta_path.insert(0, NoSglang())
try:
    import sglang  # noqa: F401
    raise SystemExit("the blocker let sglang through")
except ImportError:
    pass

from bpo_megatron.rollout.sglang.weights import flattened_bucket, ipc_payload

flat = flattened_bucket([("a", torch.arange(6, dtype=torch.bfloat16)), ("b", torch.ones(2, 3))])
flat["flattened_tensor"] = torch.Tensor._make_subclass(LooksCuda, flat["flattened_tensor"])
payload = ipc_payload(flat)
print("result " + json.dumps({"payload": payload, "sglang_modules": sorted(m for m in sys.modules if "sglang" in m
                                                                           and not m.startswith("bpo_megatron"))}))
'''


class Named:
    """A global as the payload names it (nothing is imported)."""

    def __init__(self, module: str, name: str) -> None:
        self.key = (module, name)

    def __call__(self, *args):
        return Called(self.key, args)


class Called:
    def __init__(self, key, args) -> None:
        self.key, self.args, self.state = key, args, None

    def __setstate__(self, state) -> None:
        self.state = state


class Recording(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        return Named(module, name)


def test_the_payload_of_a_device_tensor_is_built_without_sglang_and_names_sglangs_rebuild():
    """A trainer-only environment (sglang unimportable) builds the real route's payload: the
    buffer reduced as torch reduces CUDA tensors, rebuilt by SGLang's patched function with the
    device's UUID in place of its index, the metadata as plain namespaces."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", BUILD_WITHOUT_SGLANG], capture_output=True, text=True, env=env,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("result "))[len("result "):])
    assert result["sglang_modules"] == []
    data = Recording(io.BytesIO(base64.b64decode(result["payload"]))).load()
    tensor = data["flattened_tensor"]
    assert tensor.key == SGLANG_CUDA_REBUILD
    args = tensor.args
    assert len(args) == 15 and args[DEVICE_ARG] == "GPU-66666666-7777-8888-9999-000000000000"  # device 1's UUID
    assert args[0].key == ("torch", "Tensor") and args[4].key == ("torch.storage", "TypedStorage")
    assert args[1].key == ("torch", "Size") and args[1].args == ((64,),)
    assert args[5].key == ("torch", "uint8")
    assert args[2:4] == ((1,), 0)
    assert args[7:] == (b"\x07ipc-handle", 4096, 512, False, b"ref-counter", 3, b"\x01event", True)
    entries = data["metadata"]
    assert [e.key for e in entries] == [("types", "SimpleNamespace")] * 2
    fields = [(e.state["name"], e.state["dtype"].key, e.state["shape"].args[0], e.state["start_idx"],
               e.state["end_idx"]) for e in entries]
    assert fields == [("a", ("torch", "bfloat16"), (6,), 0, 12), ("b", ("torch", "float32"), (2, 3), 16, 40)]


def test_only_a_dense_device_tensor_is_reduced_to_a_handle():
    """A host tensor reduces (in torch) to shared host memory, not to an IPC handle: refused."""
    with pytest.raises(ValueError, match="not to a CUDA IPC handle"):
        device_reduction(torch.zeros(4))
