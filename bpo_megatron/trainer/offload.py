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

What is offloaded is ``cluster.offload``'s choice (:data:`OFFLOAD_PARTS`: everything, the
optimizer state alone, or nothing), which the planner makes from what fits the devices. The host
buffers are allocated once, before the first step (:meth:`MemoryOffload.reserve`: pinned with
CUDA, including the Adam moments the optimizer's first step creates), and reused by every offload;
:class:`~bpo_megatron.trainer.host_buffers.HostBuffers` counts every host allocation, so a test can show that no offload pins fresh
memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from bpo_megatron import platform
from bpo_megatron.trainer.host_buffers import HostBuffers
from bpo_megatron.trainer.optimizer_state import MOMENTS


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
    copied: values someone keeps win over values someone discards. ``expected()`` gives the
    bytes of storages ``tensors()`` will name that do not exist yet (the optimizer state its
    first step creates), so that :meth:`reserve` can allocate their host buffers too."""

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]],
                 discard: Callable[[], Iterable[torch.Tensor]] = lambda: (),
                 expected: Callable[[], Iterable[int]] = lambda: (), *, keep_across_saves: bool = False) -> None:
        self._tensors = tensors
        self._discard = discard
        self._expected = expected
        self._held: list[_Held] = []
        # Host buffers are kept for the next offload (pinning fresh host memory is slow, copying
        # into pinned memory runs at link speed): a reservation holds them from before the first
        # offload; a checkpoint save drops them (:meth:`before_save`) unless the node's host
        # memory holds them beside the save's own staging (``keep_across_saves``, the planner's
        # host budget: bpo_megatron/planner/host.py).
        self.buffers = HostBuffers()
        self.keep_across_saves = keep_across_saves

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
        """Host buffers held for the next offload."""
        return self.buffers.free_bytes

    def reserve(self) -> int:
        """Allocate now (pinned, with CUDA) a host buffer for every storage the offloads copy:
        those ``tensors()`` names and those ``expected()`` announces; returns the bytes allocated
        (none for buffers already held). Refused while offloaded."""
        if self._held:
            raise RuntimeError("the trainer's memory is offloaded; onload() it before reserving host buffers")
        sizes = [storage.nbytes() for storage in _storages(self._tensors())] + list(self._expected())
        return self.buffers.reserve(sizes, pin=platform.has_cuda())

    def offload(self) -> int:
        """Copy every kept storage to host memory, free it and every discarded one; returns the
        bytes copied."""
        if self._held:
            raise RuntimeError("the trainer's memory is already offloaded; onload() it first")
        pin = platform.has_cuda()
        held = []
        kept = list(_storages(self._tensors()))
        for storage in kept:
            nbytes = storage.nbytes()
            host = self.buffers.take(nbytes, pin=pin and storage.device.type == "cuda")
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
        for item in self._held:
            if item.host is not None:
                self.buffers.give(item.host)
        self._held = []
        return moved

    def before_save(self) -> int:
        """What a checkpoint save does first: drop the spare host buffers unless they are kept
        across saves; returns the bytes dropped."""
        return 0 if self.keep_across_saves else self.drop_spares()

    def drop_spares(self) -> int:
        """Free the host buffers kept for the next offload (which then allocates fresh ones) and
        hand cached pinned memory back to the system; returns the bytes dropped. Refused while
        offloaded: those buffers hold the trainer's state."""
        if self._held:
            raise RuntimeError("the trainer's memory is offloaded; onload() it before dropping host buffers")
        dropped = self.buffers.drop()
        release_host_cache()
        return dropped


def model_tensors(model_chunks: Iterable[torch.nn.Module]) -> Iterator[torch.Tensor]:
    """The model's weights: the parameters of the DDP chunks and their DDP parameter buffers."""
    for chunk in model_chunks:
        for buffer in _ddp_buffers(chunk):
            yield buffer.param_data
        yield from chunk.parameters()


def optimizer_tensors(model_chunks: Iterable[torch.nn.Module], optimizer) -> Iterator[torch.Tensor]:
    """The optimizer's own tensors: its parameters where they are not the model's (the fp32
    master copies of mixed precision; the fp32 optimizer updates the model's own) and its state
    (Adam moments)."""
    model = {storage.data_ptr() for storage in _storages(model_tensors(model_chunks))}
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            yield from (param for param in group["params"] if param.untyped_storage().data_ptr() not in model)
        for state in inner.state.values():
            yield from (value for value in state.values() if torch.is_tensor(value) and value.dim() > 0)


def trainer_tensors(model_chunks: Iterable[torch.nn.Module], optimizer) -> Iterator[torch.Tensor]:
    """Every large tensor whose values a trainer keeps between steps: the model's weights
    (:func:`model_tensors`) and the optimizer's parameters (fp32 masters) and state (Adam
    moments)."""
    yield from model_tensors(model_chunks)
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            yield from (value for value in state.values() if torch.is_tensor(value) and value.dim() > 0)


def first_step_state_bytes(optimizer) -> list[int]:
    """The bytes of each state tensor the optimizer's first step will create: AdamW's moments
    (:data:`~bpo_megatron.trainer.optimizer_state.MOMENTS`), each shaped and typed like the
    parameter it belongs to, for every parameter that has no state yet."""
    sizes = []
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state.get(param):
                    sizes += [param.numel() * param.element_size()] * len(MOMENTS)
    return sizes


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


def _nothing(*_args) -> Iterator[torch.Tensor]:
    return iter(())


@dataclass(frozen=True)
class OffloadParts:
    """What an offload copies to host memory (``kept``) and frees without a copy (``discarded``),
    and whether that includes the optimizer state its first step creates."""

    kept: Callable[..., Iterable[torch.Tensor]]
    discarded: Callable[..., Iterable[torch.Tensor]]
    optimizer_state: bool


# cluster.offload's choices, what each hands back while colocated engines generate: the weights
# and optimizer state to host memory (gradients freed); the optimizer state alone (the weights
# stay on the device); nothing (trainer and engines hold the device together). The planner
# (bpo_megatron/planner/offload.py) says which fits a recipe's devices.
OFFLOAD_PARTS = {
    "everything": OffloadParts(trainer_tensors, gradient_tensors, optimizer_state=True),
    "optimizer": OffloadParts(optimizer_tensors, gradient_tensors, optimizer_state=True),
    "nothing": OffloadParts(_nothing, _nothing, optimizer_state=False),
}


def trainer_offload(parts: str, model_chunks: list[torch.nn.Module], optimizer, *,
                    keep_across_saves: bool = False) -> MemoryOffload:
    """The offload of ``parts`` (a key of :data:`OFFLOAD_PARTS`) of a trainer's DDP chunks and
    optimizer; :meth:`MemoryOffload.reserve` allocates its host buffers."""
    if parts not in OFFLOAD_PARTS:
        raise ValueError(f"cluster.offload={parts!r}: choose one of {sorted(OFFLOAD_PARTS)} (or auto)")
    chosen = OFFLOAD_PARTS[parts]
    return MemoryOffload(lambda: chosen.kept(model_chunks, optimizer),
                         discard=lambda: chosen.discarded(model_chunks, optimizer),
                         expected=(lambda: first_step_state_bytes(optimizer)) if chosen.optimizer_state else (lambda: ()),
                         keep_across_saves=keep_across_saves)
