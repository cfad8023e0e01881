"""What a training micro-batch keeps for its backward, measured: the bytes of the tensors autograd
saves during one forward of the train actor's model, separated into a per-token cost of each MoE
and dense layer, a per-layer constant and the ends of the model (embedding, final norm, output
layer). The planner's activation terms (``bpo_megatron/planner/activations.py``) are checked
against it (``tests/test_activation_memory.py``).

A ``saved_tensors_hooks`` pack hook sees every tensor an op saves for backward; each is counted
by its storage (views of one buffer, such as the query, key and value split from the fused QKV
output, are one buffer), once, and parameters are left out (they are static memory). What a
custom autograd function keeps as a plain attribute of its context, not through
``save_for_backward``, is not seen; the local spec's functions on this path save their tensors.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from bpo_megatron.testing.models import moe_config


class _Saved:
    """A saved tensor as autograd holds it: alive while the graph node that saved it is."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def saved_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd holds for backward after one forward of ``model``
    (a Megatron GPT model) on ``tokens`` and ``positions`` ``[b, s]``, parameters excluded: what
    the micro-batch keeps until its backward, beyond the output itself. A tensor saved by a node
    the output does not reach (freed with its branch during the forward) is not counted."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[weakref.ref] = []

    def pack(tensor: torch.Tensor) -> _Saved:
        held = _Saved(tensor)
        saved.append(weakref.ref(held))
        return held

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor):
        output = model(tokens, positions, None)
    storages = {}
    for ref in saved:
        if (held := ref()) is not None:
            storage = held.tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    del output  # the graph (and what it saved) goes with it
    return sum(nbytes for ptr, nbytes in storages.items() if ptr not in parameters)


@dataclass(frozen=True)
class MeasuredActivations:
    """Bytes one rank keeps for backward: per token of the micro-batch (every rank of a TP group
    sees all of its tokens, each keeping its share) and per micro-batch whatever its length."""

    moe_layer_per_token: float
    moe_layer_constant: float  # the grouped experts' group offsets
    dense_layer_per_token: float
    dense_layer_constant: float
    ends_per_token: float  # embedding, final norm, output layer's input
    ends_constant: float


def measure_activations(sizes: dict, *, tp: int = 1, lengths: tuple[int, int] = (256, 512), recompute: str = "none",
                        model_options: dict | None = None, model_type: str = "qwen3_moe") -> MeasuredActivations:
    """Measure, on this rank of the current torch.distributed world (every rank calls it; ``tp``
    divides the world), fp32 MoE models of ``model_type`` and ``sizes`` (:func:`moe_config`; sizes
    but the layer count): one MoE layer, two MoE layers, one MoE and one dense layer, each at two
    ``lengths`` (multiples of ``tp``), with activation recomputation ``recompute``. Differences
    between them separate a layer's cost from the ends', and the two lengths a per-token cost from
    a constant. ``model_options``: further ``ModelOptions`` fields; the core attention is the fused
    one unless they say otherwise."""
    from bpo_megatron.testing.trainer import build_actor

    models = {"moe": (1, 0), "two_moe": (2, 0), "moe_dense": (2, 1)}  # name -> (layers, dense layers)
    options = {"attention": "fused", **(model_options or {})}
    gen = torch.Generator().manual_seed(0)
    measured: dict[tuple[str, int], int] = {}
    for name, (layers, dense) in models.items():
        config = moe_config(model_type, sizes, layers=layers, dense_layers=dense)
        actor = build_actor(config, tp=tp, params_dtype="fp32", recompute=recompute, model_options=options)
        try:
            for length in lengths:
                tokens = torch.randint(0, config["vocab_size"], (1, length), generator=gen)
                measured[name, length] = saved_activation_bytes(actor.model, tokens, torch.arange(length)[None])
        finally:
            actor.close()

    def split(bytes_at: dict[int, float]) -> tuple[float, float]:
        """(per token, constant) of bytes linear in the length."""
        (short, at_short), (long, at_long) = sorted(bytes_at.items())
        per_token = (at_long - at_short) / (long - short)
        return per_token, at_short - per_token * short

    moe = split({n: measured["two_moe", n] - measured["moe", n] for n in lengths})
    dense = split({n: measured["moe_dense", n] - measured["moe", n] for n in lengths})
    ends = split({n: 2 * measured["moe", n] - measured["two_moe", n] for n in lengths})
    return MeasuredActivations(moe_layer_per_token=moe[0], moe_layer_constant=moe[1],
                               dense_layer_per_token=dense[0], dense_layer_constant=dense[1],
                               ends_per_token=ends[0], ends_constant=ends[1])
