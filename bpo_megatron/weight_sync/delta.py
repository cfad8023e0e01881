"""A delta weight sync: the trainer's record of what the engines hold, the diff of each bucket
against it, and how an engine applies what arrives.

The sending trainer rank keeps :class:`HeldWeights`: per tensor name, a host copy of the bytes the
engines were last sent (in the sync's dtype and the engines' quantized form, FP8 values and scales
included), and the version they make. A delta sync (:func:`encode`) compares each tensor of the
new export with its copy bit for bit (as integers: -0.0 and 0.0, or two NaNs, differ where their
bytes do) and updates the copy. Per bucket and dtype the changed tensors go, by
:func:`~bpo_megatron.weight_sync.delta_estimate.bucket_delta`'s rule (the cheaper of the two):

* sparse: each changed tensor as two named tensors, ``<name>#delta.indices`` (its changed
  elements' flat indices, int32, or int64 for 2^31 elements or more) and ``<name>#delta.values``
  (their new values, in the tensor's dtype), adjacent in the bucket;
* whole: each changed tensor as itself.

Unchanged tensors are not sent; a bucket with nothing changed is not sent at all. Engines that
take whole tensors only (``mode="tensors"``: SGLang's paths) get every changed tensor whole, with
the rest of its load group (:func:`~bpo_megatron.weights.names.load_group`: tensors an engine
fuses into one parameter in one load call, such as DeepSeek's ``q_a_proj`` and
``kv_a_proj_with_mqa``; a bucket never splits one). Any
transport carries a delta bucket as it carries a full one (named tensors); the engine reads it
with :func:`updates` and writes a sparse piece in place with :func:`scatter`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch

from bpo_megatron.weight_sync.delta_estimate import bucket_delta, index_bytes
from bpo_megatron.weights.names import load_group

INDICES, VALUES = "#delta.indices", "#delta.values"
MODES = ("sparse", "tensors")  # how a delta reaches an engine: indices and values, or changed tensors whole
Mode = Literal["sparse", "tensors"]

Bucket = list[tuple[str, torch.Tensor]]


@dataclass
class HeldWeights:
    """What the engines hold, by the trainer rank that sends to them: ``tensors`` (host copies, by
    name), the ``version`` they make (None: unknown, e.g. a sync that failed half way) and the
    version of the last full sync to every engine holding ``version`` (``full_version``; a full
    sync of the same version to a replaced engine alone leaves it)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    version: int | None = None
    full_version: int | None = None

    def delta_from(self, held: int | None, version: int, full_every: int) -> bool:
        """Whether the ``version``-th sync may be a delta: the engines hold (``held``) this
        record's version and the last full sync is fewer than ``full_every`` versions back."""
        return (held is not None and self.version is not None and self.full_version is not None
                and held == self.version and version - self.full_version < full_every)

    def keep(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every tensor of a full sync's bucket (it is what the engines now hold)."""
        for name, tensor in bucket:
            self.tensors[name] = _host_copy(tensor, self.tensors.get(name))


def _host_copy(tensor: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    """``tensor``'s bytes in host memory, into the copy kept before where it has the same shape."""
    if into is not None and into.shape == tensor.shape and into.dtype == tensor.dtype:
        return into.copy_(tensor.detach())
    return tensor.detach().to("cpu", copy=True).contiguous()


_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> integer dtype


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of its element size (a bitwise comparison)."""
    return tensor.contiguous().view(-1).view(_INTEGERS[tensor.element_size()])


@dataclass(frozen=True)
class EncodedBucket:
    """What a delta sends for one bucket (``tensors``, empty when nothing changed) and the
    elements it covers: ``changed`` of ``elements``."""

    tensors: Bucket
    elements: int
    changed: int


def encode(bucket: Iterable[tuple[str, torch.Tensor]], record: HeldWeights, mode: Mode) -> EncodedBucket:
    """``bucket`` (the engines' form of the new weights) against ``record``: what a delta sends
    (see the module), ``record`` updated to the new bytes. A tensor the record lacks, or holds in
    another shape or dtype, changed wholly."""
    if mode not in MODES:
        raise ValueError(f"a delta reaches an engine as one of {MODES}, not {mode!r}")
    bucket = list(bucket)
    changes: dict[str, torch.Tensor | None] = {}  # name -> flat indices of its changed elements (None: all)
    elements = changed_total = 0
    for name, tensor in bucket:
        old = record.tensors.get(name)
        flat = tensor.detach().to("cpu").contiguous().view(-1)
        if old is None or old.shape != tensor.shape or old.dtype != tensor.dtype:
            where = None  # every element
            count = flat.numel()
        else:
            where = torch.nonzero(_bits(flat) != _bits(old)).view(-1)
            count = where.numel()
        elements += flat.numel()
        if count:
            changes[name] = where
            changed_total += count
            record.tensors[name] = _host_copy(flat.view(tensor.shape), old)  # from the host bytes: one copy off the device
    if mode == "tensors":  # a changed tensor's load group goes whole with it
        groups = {load_group(name) for name in changes} - {None}
        changes.update((name, None) for name, _ in bucket if name not in changes and load_group(name) in groups)
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor, torch.Tensor | None]]] = {}
    for name, tensor in bucket:
        if name in changes:
            by_dtype.setdefault(tensor.dtype, []).append((name, tensor, changes[name]))
    sent: Bucket = []
    for dtype, changed in by_dtype.items():
        size = sum(tensor.numel() for _, tensor, _ in changed)
        count = sum(tensor.numel() if where is None else where.numel() for _, tensor, where in changed)
        sparse = mode == "sparse" and bucket_delta(size, count, dtype.itemsize).encoding == "sparse"
        index_dtype = torch.int32 if index_bytes(size) == 4 else torch.int64
        for name, tensor, where in changed:
            if sparse and where is not None:
                where = where.to(device=tensor.device)  # beside the values: a device bucket stays on its device
                values = tensor.detach().contiguous().view(-1)[where]
                sent += [(name + INDICES, where.to(index_dtype)), (name + VALUES, values)]
            else:
                sent.append((name, tensor))
    return EncodedBucket(sent, elements, changed_total)


@dataclass(frozen=True)
class Sparse:
    """A sparse piece of a delta: the weight ``name``'s elements at flat ``indices`` become ``values``."""

    name: str
    indices: torch.Tensor
    values: torch.Tensor


def updates(bucket: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | Sparse]]:
    """A bucket as an engine applies it: (name, whole tensor) or (name, :class:`Sparse`), the two
    parts of a sparse piece read together."""
    pending: tuple[str, torch.Tensor] | None = None
    for name, tensor in bucket:
        if name.endswith(INDICES):
            if pending is not None:
                raise ValueError(f"weight delta: {pending[0]!r} has no values")
            pending = (name.removesuffix(INDICES), tensor)
        elif name.endswith(VALUES):
            base = name.removesuffix(VALUES)
            if pending is None or pending[0] != base:
                raise ValueError(f"weight delta: the values of {base!r} come without its indices")
            yield base, Sparse(base, pending[1], tensor)
            pending = None
        else:
            if pending is not None:
                raise ValueError(f"weight delta: {pending[0]!r} has no values")
            yield name, tensor
    if pending is not None:
        raise ValueError(f"weight delta: {pending[0]!r} has no values")


def scatter(target: torch.Tensor, piece: Sparse) -> int:
    """Write ``piece``'s values at its flat indices of ``target`` (in place, whatever its strides);
    returns the bytes received. Checked first: a refused piece leaves ``target`` untouched."""
    indices, values = piece.indices, piece.values
    if indices.dtype not in (torch.int32, torch.int64) or indices.ndim != 1 or values.shape != indices.shape:
        raise ValueError(f"weight delta: {piece.name!r} needs one-dimensional int32/int64 indices and as many values, "
                         f"got {indices.dtype} {tuple(indices.shape)} and {tuple(values.shape)}")
    if values.dtype != target.dtype:
        raise ValueError(f"weight delta: {piece.name!r} values are {values.dtype}, the weight is {target.dtype} "
                         "(a delta carries the engine's own bytes)")
    if indices.numel() and not 0 <= int(indices.min()) <= int(indices.max()) < target.numel():
        raise ValueError(f"weight delta: {piece.name!r} indices outside its {target.numel()} elements")
    where = indices.to(device=target.device, dtype=torch.int64)
    # as integers of the element size: the bytes are copied as they are (and e4m3 has no index kernels)
    kind = _INTEGERS[target.element_size()]
    into, bits = target.view(kind), values.to(target.device).view(kind)
    with torch.no_grad():
        if into.is_contiguous():
            into.view(-1).index_copy_(0, where, bits)
        else:
            into.index_put_(torch.unravel_index(where, into.shape), bits)
    return indices.numel() * indices.element_size() + values.numel() * values.element_size()
