"""Hand a trainer's device memory back and take it again: parameters, gradients, optimizer state.

Colocated rollout engines need the GPU memory the trainer holds while it waits for samples. What
the trainer holds lives in a few large storages: Megatron's DDP parameter and gradient buffers
(every parameter and ``main_grad`` is a view into one of them), the optimizer's fp32 master copies
(the distributed optimizer's shards) and its Adam moments. Offloading copies each storage's bytes
to host memory (pinned with CUDA, so the copies run at full link speed) and resizes the storage to
zero bytes; onloading resizes it back and copies the bytes in. Resizing the *storage* rather than
replacing tensors keeps every view, every ``main_grad`` alias and every optimizer reference valid,
so nothing has to be rebuilt and the model is restored bit for bit. The same code frees real
memory on CPU storages, which is how it is tested without a GPU.

Gradients are not copied: the fp32 main-gradient buffers are dead between optimizer steps (a step
zeroes them before its first backward pass), so offloading frees them and onloading re-allocates
them zeroed. Moving them would cost 4 bytes per parameter of pinned host memory and two copies
over the host link per step for values nobody reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from bpo_megatron import platform


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # uint8 copy of the storage's bytes; None: re-allocated zeroed


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (a view, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _storages(tensors: Iterable[torch.Tensor | None]) -> Iterator[torch.UntypedStorage]:
    seen: set[int] = set()
    for tensor in tensors:
        if tensor is None:  # e.g. a DDP buffer without a parameter copy (no distributed optimizer)
            continue
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        yield storage


def release_host_cache() -> None:
    """Hand cached pinned host memory back to the operating system. Pinned buffers freed by torch
    stay in its host caching allocator (and count against the process's memory) until this."""
    if platform.has_cuda():
        # CUDA's pinned host caching allocator. Torch 2.11 lacks the public name
        # (torch.accelerator.empty_host_cache); torch._C._host_emptyCache empties the same
        # allocator in every torch the package admits, 2.11 to 2.14.1 (2.11's own CUDA graph
        # capture calls it). CUDA builds only: CPU builds do not define it.
        torch._C._host_emptyCache()


class MemoryOffload:
    """Offloads the storages behind ``tensors()`` (called at each :meth:`offload`, so tensors the
    optimizer creates lazily at its first step are included) and restores them on :meth:`onload`.

    ``discard()`` names tensors whose values need not survive (gradient buffers): their storages
    are freed without a copy and come back zeroed. A storage that ``tensors()`` also names is
    copied: values someone keeps win over values someone discards."""

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]],
                 discard: Callable[[], Iterable[torch.Tensor]] = lambda: ()) -> None:
        self._tensors = tensors
        self._discard = discard
        self._held: list[_Held] = []
        # Host buffers are kept for the next offload: pinning fresh host memory runs at ~1 GB/s
        # (measured on an H100 machine: 21.6 GB took 21.5 s the first time), copying into
        # pinned memory at link speed. A checkpoint save drops them (drop_spares): it needs the
        # host memory for its own staging.
        self._spare: list[torch.Tensor] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._held)

    @property
    def host_bytes(self) -> int:
        """Bytes held in host memory while offloaded (discarded storages hold none)."""
        return sum(held.nbytes for held in self._held if held.host is not None)

    @property
    def discarded_bytes(self) -> int:
        """Bytes of device memory freed without a copy while offloaded."""
        return sum(held.nbytes for held in self._held if held.host is None)

    @property
    def spare_bytes(self) -> int:
        """Host buffers kept from the last offload for the next one."""
        return sum(buffer.numel() for buffer in self._spare)

    def offload(self) -> int:
        """Copy every kept storage to host memory, free it and every discarded one; returns the
        bytes copied."""
        if self._held:
            raise RuntimeError("the trainer's memory is already offloaded; onload() it first")
        pin = platform.has_cuda()
        held = []
        kept = list(_storages(self._tensors()))
        for index, storage in enumerate(kept):
            nbytes = storage.nbytes()
            if index < len(self._spare) and self._spare[index].numel() == nbytes:
                host = self._spare[index]
            else:
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin and storage.device.type == "cuda")
            host.copy_(_storage_bytes(storage), non_blocking=pin)
            held.append(_Held(storage, nbytes, host))
        kept_keys = {storage.data_ptr() for storage in kept}
        held += [_Held(storage, storage.nbytes(), None) for storage in _storages(self._discard())
                 if storage.data_ptr() not in kept_keys]
        if pin:
            torch.cuda.synchronize()  # the host copies must be complete before the storages go
        for item in held:
            item.storage.resize_(0)
        self._held = held
        self._spare = []  # now in use; they come back as spares at onload
        if pin:
            torch.cuda.empty_cache()  # hand the freed blocks back to the device, not only the cache
        return self.host_bytes

    def onload(self) -> int:
        """Re-allocate every offloaded storage, copy kept bytes back and zero discarded ones;
        returns the bytes copied."""
        if not self._held:
            raise RuntimeError("the trainer's memory is not offloaded")
        moved = 0
        for item in self._held:
            item.storage.resize_(item.nbytes)
            if item.host is None:
                _storage_bytes(item.storage).zero_()
                continue
            _storage_bytes(item.storage).copy_(item.host, non_blocking=item.host.is_pinned())
            moved += item.nbytes
        if platform.has_cuda():
            torch.cuda.synchronize()  # the host buffers are written again by the next offload
        self._spare = [item.host for item in self._held if item.host is not None]
        self._held = []
        return moved

    def drop_spares(self) -> int:
        """Free the host buffers kept for the next offload (which then pins fresh ones) and hand
        cached pinned memory back to the system; returns the bytes dropped. Refused while
        offloaded: those buffers hold the trainer's state."""
        if self._held:
            raise RuntimeError("the trainer's memory is offloaded; onload() it before dropping host buffers")
        dropped = self.spare_bytes
        self._spare = []
        release_host_cache()
        return dropped


def trainer_tensors(model_chunks: Iterable[torch.nn.Module], optimizer) -> Iterator[torch.Tensor]:
    """Every large tensor whose values a trainer keeps between steps: the parameters of the DDP
    chunks (and their DDP parameter buffers), and the optimizer's own parameters (fp32 masters)
    and state (Adam moments)."""
    for chunk in model_chunks:
        for buffer in _ddp_buffers(chunk):
            yield buffer.param_data
        yield from chunk.parameters()
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            yield from (value for value in state.values() if torch.is_tensor(value) and value.dim() > 0)


def gradient_tensors(model_chunks: Iterable[torch.nn.Module], optimizer) -> Iterator[torch.Tensor]:
    """The gradients a trainer holds, dead between steps: DDP's fp32 gradient buffers, the
    ``main_grad`` views into them and the optimizer parameters' ``.grad``."""
    for chunk in model_chunks:
        for buffer in _ddp_buffers(chunk):
            yield buffer.grad_data
        for param in chunk.parameters():
            yield getattr(param, "main_grad", None)
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                yield param.grad


def _ddp_buffers(chunk: torch.nn.Module) -> list:
    return list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))


def torch_optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron (chained) optimizer."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            yield inner
