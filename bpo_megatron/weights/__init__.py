"""The trainer's weights under Hugging Face names: everything that moves them, in one place.

* the name map (:mod:`~bpo_megatron.weights.names`: every Megatron parameter ↔ its Hugging Face
  tensors) and the layouts (:mod:`~bpo_megatron.weights.layouts`: how each kind of tensor is
  split over TP and EP ranks, and joined back);
* the collective gather (:mod:`~bpo_megatron.weights.gather`: ``iter_hf_weights`` /
  ``weight_stream`` stream a live sharded model's tensors onto one rank, with an
  :class:`ExportPlan` built once per model) and this rank's own shards
  (:mod:`~bpo_megatron.weights.local_weights`);
* loading a Hugging Face checkpoint into any layout (:mod:`~bpo_megatron.weights.load`) and
  safetensors I/O (:mod:`~bpo_megatron.weights.safetensors_io`);
* the export a weight sync sends (:mod:`~bpo_megatron.weights.export`: buckets, on rank 0 or as
  one flat buffer on every rank), host staging (:mod:`~bpo_megatron.weights.host_staging`),
  buckets (:mod:`~bpo_megatron.weights.buckets`, :mod:`~bpo_megatron.weights.flat_bucket`) and
  checksums (:mod:`~bpo_megatron.weights.checksums`).

The trainer (:meth:`~bpo_megatron.trainer.actor.TrainActor.export_weights`) owns a run's export;
the offline checkpoint tool (:mod:`bpo_megatron.convert`) and the engines' transports build on
these modules. Nothing here imports the trainer, an engine or Ray; Megatron only when a model is
touched.
"""

import importlib
from typing import TYPE_CHECKING

# Each name from the module that defines it, imported on first use: an engine process imports
# this package for its buckets and names, and the gather's chain (grouped experts, Megatron's
# tensor-parallel layers) costs seconds of start-up it never needs.
_HOMES = {
    "ExportPlan": "gather",
    "StreamedTensor": "gather",
    "iter_hf_weights": "gather",
    "weight_stream": "gather",
    "load_hf_weights": "load",
    "RULES": "names",
    "WeightRule": "names",
    "expected_keys": "names",
    "hf_tensor_shapes": "names",
    "HFWeightsReader": "safetensors_io",
    "ShardedSafetensorsWriter": "safetensors_io",
}

if TYPE_CHECKING:
    from bpo_megatron.weights.gather import ExportPlan, StreamedTensor, iter_hf_weights, weight_stream
    from bpo_megatron.weights.load import load_hf_weights
    from bpo_megatron.weights.names import RULES, WeightRule, expected_keys, hf_tensor_shapes
    from bpo_megatron.weights.safetensors_io import HFWeightsReader, ShardedSafetensorsWriter


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_HOMES)
