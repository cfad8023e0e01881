"""Load Hugging Face tensors into a Megatron model split any way (TP, EP, PP, DP).

Each rank reads only what its own parameters need, as slices of the memory-mapped safetensors
files (one TP shard of a projection, its own experts, its own pipeline stage's layers), so no rank
ever holds more than its model chunk plus one slice. Vocabulary padding rows are set to zero.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.weights.layouts import LAYOUTS, LayoutContext
from bpo_megatron.weights.local_weights import local_weights, unwrap
from bpo_megatron.weights.names import model_dims
from bpo_megatron.weights.safetensors_io import HFWeightsReader


def load_hf_weights(model: torch.nn.Module, hf: HFModelConfig,
                    source: str | Path | HFWeightsReader, *, progress: bool = False) -> int:
    """Copy the Hugging Face checkpoint ``source`` (a directory or an open reader) into this
    rank's parameters; returns how many parameters were set. Not collective.

    Call it before building an optimizer that keeps its own fp32 copies of the parameters (the
    distributed optimizer), or have that optimizer reload them afterwards.
    """
    reader = source if isinstance(source, HFWeightsReader) else HFWeightsReader(source)
    try:
        return _load(model, hf, reader, progress)
    finally:
        if reader is not source:
            reader.close()


def _load(model: torch.nn.Module, hf: HFModelConfig, reader: HFWeightsReader,
          progress: bool) -> int:
    from tqdm import tqdm

    tied = unwrap(model).share_embeddings_and_output_weights
    dims = model_dims(hf)
    ctx = LayoutContext(num_query_groups=hf.num_key_value_heads, vocab_size=hf.vocab_size)
    weights = local_weights(model)
    for weight in tqdm(weights, desc="loading HF weights", unit="tensor",
                       disable=None if progress else True):
        rule = weight.rule
        names = rule.hf_names(weight.key[1], weight.key[2])
        if tied and rule.tied_to:  # the last stage's copy of a tied embedding
            names = [rule.tied_to]
        tensor = LAYOUTS[rule.layout].read(reader, names, rule.hf_shapes(dims), weight.shard,
                                           weight.num_shards, tuple(weight.param.shape), ctx)
        if tensor.shape != weight.param.shape:
            raise ValueError(f"{weight.name}: read shape {list(tensor.shape)} from {names}, but "
                             f"the parameter has shape {list(weight.param.shape)}")
        with torch.no_grad():
            weight.param.copy_(tensor)
    return len(weights)
