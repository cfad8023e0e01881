"""How one Megatron-Core weight and its Hugging Face tensors relate, and how tensor parallelism
splits it.

Each layout does two things:

* ``merge``: this weight's tensor-parallel shards (in TP-rank order) → its Hugging Face tensors;
* ``read``: the Hugging Face tensors (read through slices, so only the needed rows or columns are
  loaded) → the shard of one TP rank.

The layouts:

* ``replicated`` — norms, the router and MLA's down projections to its latents: every TP rank holds
  the whole tensor, unchanged.
* ``row_parallel`` — attention output and MLP down projections: TP splits the input dimension
  (dim 1); the layout is the same as Hugging Face's.
* ``qkv`` — Megatron fuses Q, K and V *per query group*: the rows are, for each of the
  ``num_key_value_heads`` groups, that group's ``heads/groups`` query heads, then its key head,
  then its value head (``head_dim`` rows each). TP gives each rank whole groups, so concatenating
  the shards gives the TP=1 tensor.
* ``glu`` — ``linear_fc1`` holds gate and up projections stacked, ``[gate; up]``. TP splits
  *each* of them: rank t holds ``[gate_t; up_t]``, so the shards concatenated are not the TP=1
  tensor; each shard is split in half and the halves are concatenated separately.
* ``column_parallel`` — one tensor whose output rows TP splits contiguously (MLA's up projections and
  plain query projection: whole heads per rank).
* ``vocab_rows`` — embedding and output layer: vocabulary rows split over TP, padded to a multiple
  of 128·TP; rows from ``vocab_size`` on are padding (dropped on export, zero on load).

``qkv``, ``glu`` and ``column_parallel`` are one rule, :class:`GroupInterleaved`: the Megatron
tensor is a sequence of groups, each holding a block of rows of every HF tensor in turn, and TP
gives each rank a contiguous run of groups. For ``qkv`` the groups are the query groups; for
``glu`` and ``column_parallel`` (one HF tensor) there is one group per TP rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

Shape = tuple[int, ...]


class TensorSource(Protocol):
    """Read access to Hugging Face tensors (see ``safetensors_io.HFWeightsReader``)."""

    def slice(self, name: str, expected_shape: Shape) -> Any:
        """A lazily read tensor: indexing it (``[a:b]``, ``[:, a:b]``) loads only that part."""
        ...


@dataclass(frozen=True)
class LayoutContext:
    num_query_groups: int
    vocab_size: int  # the real vocabulary; padding rows lie beyond it


class Layout(Protocol):
    splits: bool  # whether tensor parallelism splits this weight (False: every TP rank has it all)

    def merge(self, shards: Sequence[torch.Tensor], hf_shapes: Sequence[Shape],
              ctx: LayoutContext, *, copy: bool = True) -> list[torch.Tensor]:
        """This weight's TP shards, in TP-rank order → its HF tensors, in the rule's order: new
        tensors, or with ``copy=False`` views of the shards wherever one shard suffices (valid
        until the shards change: for a consumer that copies them at once)."""
        ...

    def read(self, source: TensorSource, names: Sequence[str], hf_shapes: Sequence[Shape],
             shard: int, num_shards: int, local_shape: Shape, ctx: LayoutContext) -> torch.Tensor:
        """The HF tensors ``names`` → TP shard ``shard`` of ``num_shards`` (``local_shape``)."""
        ...


def _even_part(total: int, num_shards: int, what: str) -> int:
    if total % num_shards:
        raise ValueError(f"{what}: {total} does not split evenly over {num_shards} shards")
    return total // num_shards


_Shards = Sequence[torch.Tensor]
_Names = Sequence[str]
_Shapes = Sequence[Shape]


def _joined(parts: list[torch.Tensor], dim: int, copy: bool) -> torch.Tensor:
    return parts[0] if len(parts) == 1 and not copy else torch.cat(parts, dim=dim)


class Replicated:
    splits = False

    def merge(self, shards: _Shards, hf_shapes: _Shapes, ctx: LayoutContext, *, copy: bool = True
              ) -> list[torch.Tensor]:
        return [shards[0].clone() if copy else shards[0]]

    def read(self, source: TensorSource, names: _Names, hf_shapes: _Shapes, shard: int,
             num_shards: int, local_shape: Shape, ctx: LayoutContext) -> torch.Tensor:
        return source.slice(names[0], hf_shapes[0])[:]


class RowParallel:
    splits = True

    def merge(self, shards: _Shards, hf_shapes: _Shapes, ctx: LayoutContext, *, copy: bool = True
              ) -> list[torch.Tensor]:
        return [_joined(list(shards), 1, copy)]

    def read(self, source: TensorSource, names: _Names, hf_shapes: _Shapes, shard: int,
             num_shards: int, local_shape: Shape, ctx: LayoutContext) -> torch.Tensor:
        cols = _even_part(hf_shapes[0][1], num_shards, f"{names[0]} columns")
        return source.slice(names[0], hf_shapes[0])[:, shard * cols:(shard + 1) * cols]


class GroupInterleaved:
    """Groups of rows, each holding a block of every HF tensor in turn; TP splits by groups."""

    splits = True

    def __init__(self, groups: Callable[[LayoutContext, int], int]) -> None:
        self._groups = groups  # (context, number of TP shards) -> number of groups

    def _rows_per_group(self, hf_shapes: _Shapes, groups: int) -> list[int]:
        return [_even_part(shape[0], groups, "rows per group") for shape in hf_shapes]

    def merge(self, shards: _Shards, hf_shapes: _Shapes, ctx: LayoutContext, *, copy: bool = True
              ) -> list[torch.Tensor]:
        groups = self._groups(ctx, len(shards))
        per_group = self._rows_per_group(hf_shapes, groups)
        per_shard = _even_part(groups, len(shards), "groups per shard")
        pieces: list[list[torch.Tensor]] = [[] for _ in hf_shapes]
        for shard in shards:
            blocks = shard.reshape(per_shard, sum(per_group), -1).split(per_group, dim=1)
            for out, block, shape in zip(pieces, blocks, hf_shapes):
                out.append(block.reshape(-1, *shape[1:]))  # 1-D for a bias
        return [_joined(parts, 0, copy) for parts in pieces]

    def read(self, source: TensorSource, names: _Names, hf_shapes: _Shapes, shard: int,
             num_shards: int, local_shape: Shape, ctx: LayoutContext) -> torch.Tensor:
        groups = self._groups(ctx, num_shards)
        per_group = self._rows_per_group(hf_shapes, groups)
        per_shard = _even_part(groups, num_shards, "groups per shard")
        blocks = []
        for name, shape, rows in zip(names, hf_shapes, per_group):
            start = shard * per_shard * rows
            part = source.slice(name, shape)[start:start + per_shard * rows]
            blocks.append(part.reshape(per_shard, rows, -1))
        return torch.cat(blocks, dim=1).reshape(-1, *hf_shapes[0][1:])  # 1-D for a bias


class VocabRows:
    splits = True

    def merge(self, shards: _Shards, hf_shapes: _Shapes, ctx: LayoutContext, *, copy: bool = True
              ) -> list[torch.Tensor]:
        if not copy and len(shards) == 1:
            return [shards[0][:ctx.vocab_size]]
        # copied straight into the unpadded tensor: no padded full-size intermediate
        out = shards[0].new_empty((ctx.vocab_size, *shards[0].shape[1:]))
        start = 0
        for shard in shards:
            rows = min(shard.shape[0], ctx.vocab_size - start)
            if rows <= 0:
                break
            out[start:start + rows] = shard[:rows]
            start += rows
        return [out]

    def read(self, source: TensorSource, names: _Names, hf_shapes: _Shapes, shard: int,
             num_shards: int, local_shape: Shape, ctx: LayoutContext) -> torch.Tensor:
        rows = local_shape[0]
        start, stop = shard * rows, min((shard + 1) * rows, ctx.vocab_size)
        tensor_slice = source.slice(names[0], hf_shapes[0])
        if start >= stop:  # a shard of padding only
            return torch.zeros((rows, *hf_shapes[0][1:]))
        part = tensor_slice[start:stop]
        out = part.new_zeros((rows, *part.shape[1:]))
        out[: stop - start] = part
        return out


LAYOUTS: dict[str, Layout] = {
    "replicated": Replicated(),
    "row_parallel": RowParallel(),
    "qkv": GroupInterleaved(lambda ctx, num_shards: ctx.num_query_groups),
    "glu": GroupInterleaved(lambda ctx, num_shards: num_shards),
    "column_parallel": GroupInterleaved(lambda ctx, num_shards: num_shards),
    "vocab_rows": VocabRows(),
}
