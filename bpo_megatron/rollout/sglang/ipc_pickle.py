"""A weight bucket pickled as SGLang 0.5.23's receiver reads it, without importing SGLang.

Each TP rank reads its entry of ``serialized_named_tensors`` with SGLang's
``MultiprocessingSerializer.deserialize``: base64, then SGLang's ``SafeUnpickler``, which admits
only globals on its allow-list (plain containers, ``types.SimpleNamespace``, torch's types, dtypes
and tensor rebuilds, and a few of SGLang's own functions), after ``monkey_patch_torch_reductions``
made CUDA tensors travel with their device's UUID instead of its index (device indices differ
between processes that see different ``CUDA_VISIBLE_DEVICES``).

So a CUDA tensor is reduced as torch reduces it for IPC (its allocation's handle, offsets,
reference counter and event) with two changes, both what SGLang's patched reduction makes: the
device argument is the device's UUID, and the rebuild is SGLang's
``sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified``, which maps the UUID back to a local
index. That function is named in the pickle, never imported here: the stdlib's C pickler insists
on importing a global to check it, so :class:`IpcPickler` is built on the pure-Python pickler,
where a :class:`GlobalName` is written as a name. Every other object, host tensors included
(their bytes inside the payload), pickles as ``pickle`` pickles it.
"""

from __future__ import annotations

import io
import pickle

import torch
from torch.multiprocessing import reductions

# SGLang's rebuild of a CUDA tensor whose device is given by UUID (on its unpickler's allow-list)
SGLANG_CUDA_REBUILD = ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")
# where torch's CUDA reduction puts the storage's device (rebuild_cuda_tensor's 7th parameter,
# storage_device); SGLang's patch replaces the argument at the same position
DEVICE_ARG = 6
PROTOCOL = 4  # ForkingPickler's default on Python 3.11–3.13; SGLang's unpickler reads any


class GlobalName:
    """A global written by its module and name, without importing the module."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"

    def __call__(self, *args):
        # callable only because the pickler accepts nothing else as a reduction's function
        raise TypeError(f"{self!r} is a name for the receiving process, not a function of this one")


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` of this process, as SGLang's receiver looks it up."""
    return str(torch.cuda.get_device_properties(index).uuid)


def device_reduction(tensor: torch.Tensor) -> tuple:
    """``tensor`` (on a CUDA device) as SGLang's patched reduction reduces it."""
    # torch's own CUDA reduction, also when SGLang's patch replaced it in this process
    reduce = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)
    rebuild, args = reduce(tensor)
    if getattr(rebuild, "__name__", "") not in ("rebuild_cuda_tensor", SGLANG_CUDA_REBUILD[1]):
        raise ValueError(f"a {tensor.layout} tensor on {tensor.device} reduces to {rebuild!r}, not to a CUDA "
                         "IPC handle: only dense CUDA tensors travel to SGLang this way")
    device = args[DEVICE_ARG]
    if isinstance(device, int):  # torch's own reduction; SGLang's patch would already have put the UUID
        device = device_uuid(device)
    return GlobalName(*SGLANG_CUDA_REBUILD), (*args[:DEVICE_ARG], device, *args[DEVICE_ARG + 1:])


class IpcPickler(pickle._Pickler):
    """Pickles CUDA tensors as IPC handles SGLang's receiver maps by device UUID; everything else,
    host tensors included, as ``pickle`` does."""

    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, file) -> None:
        super().__init__(file, protocol=PROTOCOL)

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            return device_reduction(obj)
        return NotImplemented

    def _save_global_name(self, obj: GlobalName) -> None:
        self.save(obj.module)
        self.save(obj.name)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    def _save_dtype(self, obj: torch.dtype) -> None:
        # by its name in torch, as SGLang's allow-list names dtypes (the pure-Python pickler would
        # otherwise search every loaded module for one holding the object)
        self.save(GlobalName("torch", str(obj).removeprefix("torch.")))

    dispatch[GlobalName] = _save_global_name
    dispatch[torch.dtype] = _save_dtype


def dumps(obj) -> bytes:
    buffer = io.BytesIO()
    IpcPickler(buffer).dump(obj)
    return buffer.getvalue()
