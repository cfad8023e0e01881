"""Multi-token-prediction (MTP) layers: carried beside the model, byte for byte, never trained.

A GLM-4.5 or DeepSeek-V3 checkpoint holds ``num_nextn_predict_layers`` layers after the main model,
under ``model.layers.{num_hidden_layers + i}.``: a Mixture-of-Experts decoder layer (the main
model's tensor names) and ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm`` (DeepSeek-V3's
repeat ``embed_tokens`` and ``shared_head.head`` as well). SGLang builds its NEXTN/EAGLE draft model
from them (``sglang/srt/models/deepseek_nextn.py``, ``glm4_moe_nextn.py``: the draft's loader keeps
the tensors under that prefix and takes the embedding and output head from the target model).

They are not part of the Megatron model. megatron-core 0.16's MTP block (``mtp_num_layers``) runs in
every forward of the GPTModel, needs the labels and adds its own loss to the main model's gradient
(through the hidden states), and its MoE router would be one more router for routing replay, whose
engines capture the main layers only; the RL losses score the main model's tokens. So the layers are
carried as they came: the trainer neither computes with nor changes them, every loss is the one it
was without them, and an export writes them back unchanged.

Where they travel:

- ``hf-to-mcore`` writes them into the trainer checkpoint as ``mtp/`` (HF-named sharded safetensors
  with its index) beside the model, and the stored config counts the layers carried;
- a trainer's save links them (hard links; a copy across file systems) from the checkpoint it loaded
  or last saved, or reads them from the Hugging Face directory it loaded; they are checksummed with
  the rest of the checkpoint;
- ``mcore-to-hf`` appends them after the main model's tensors and writes the count it carries as
  the config's ``num_nextn_predict_layers``;
- a weight sync never sends them (:func:`~bpo_megatron.weights.names.hf_tensor_count`): they do not
  change, and every engine (re)starts from the model's directory, where SGLang's draft model reads them.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bpo_megatron.models.families import config_error
from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.weights.names import decoder_layer_keys, keys_shapes
from bpo_megatron.weights.safetensors_io import HFWeightsReader, ShardedSafetensorsWriter

CARRIED_DIR = "mtp"  # in a trainer checkpoint's step directory

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# an MTP layer's own tensors (beyond its decoder layer's), by the dimensions of their shapes
_OWN = {"enorm.weight": ("hidden",), "hnorm.weight": ("hidden",), "eh_proj.weight": ("hidden", "hidden2"),
        "shared_head.norm.weight": ("hidden",)}
# copies of the main model's embedding and output head some checkpoints repeat (DeepSeek-V3's); engines
# take the main model's
_REPEATED = {"embed_tokens.weight": ("vocab", "hidden"), "shared_head.head.weight": ("vocab", "hidden")}


@dataclass(frozen=True)
class MtpLayers:
    """The multi-token-prediction tensors a model carries: ``names`` (in order) in the Hugging Face
    safetensors ``directory``, ``layers`` layers of them."""

    directory: Path
    names: tuple[str, ...]
    layers: int

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor as stored (its own dtype), one at a time."""
        with HFWeightsReader(self.directory) as reader:
            for name in self.names:
                yield name, reader.slice(name)[:]

    def write(self, step_dir: str | Path) -> None:
        """Into ``step_dir/mtp``: the files linked when ``directory`` holds these tensors alone (a
        checkpoint's carried copy), else the tensors read and written in shards."""
        out = Path(step_dir) / CARRIED_DIR
        with HFWeightsReader(self.directory) as reader:
            files = sorted(set(reader.weight_map.values()))
            alone = set(reader.weight_map) == set(self.names)
            if not alone:
                writer = ShardedSafetensorsWriter(out)
                for name in self.names:
                    writer.add(name, reader.slice(name)[:])
                writer.close()
                return
        out.mkdir(parents=True)
        index = self.directory / "model.safetensors.index.json"
        for file in files + ([index.name] if index.is_file() else []):
            _link_or_copy(self.directory / file, out / file)


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link (the carried files are never modified in place), or a copy where the file systems differ."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def declared_layers(hf: HFModelConfig) -> int:
    """How many MTP layers ``hf``'s config.json counts (0 for a family without them, or a config
    built without a config.json)."""
    field = hf.family.mtp_layers_field
    count = (hf.source or {}).get(field, 0) if field else 0
    if count is None:
        return 0
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise config_error(f"{field}={count!r} must be a non-negative integer")
    return count


def _layer_of(name: str) -> int | None:
    found = _LAYER.match(name)
    return int(found[1]) if found else None


def _shapes(hf: HFModelConfig, layer: int) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The tensors MTP layer ``layer`` must hold and those it may hold, with their shapes."""
    dims = {"hidden": hf.hidden_size, "hidden2": 2 * hf.hidden_size, "vocab": hf.vocab_size}
    prefix = f"model.layers.{layer}."
    required = keys_shapes(hf, decoder_layer_keys(hf, layer, moe=hf.is_moe))
    required.update({prefix + name: tuple(dims[d] for d in shape) for name, shape in _OWN.items()})
    optional = {prefix + name: tuple(dims[d] for d in shape) for name, shape in _REPEATED.items()}
    return required, optional


def find_in_checkpoint(reader: HFWeightsReader, hf: HFModelConfig) -> MtpLayers | None:
    """The MTP layers of a Hugging Face checkpoint (an open reader): every tensor under
    ``model.layers.{i}.`` for ``i`` at or past ``num_hidden_layers``, checked to be whole layers of
    their shapes and exactly the ones config.json counts. None when it holds none (also when its
    config counts some: :func:`config_with_layers` then says so)."""
    first = hf.num_hidden_layers
    by_layer: dict[int, list[str]] = {}
    for name in reader.weight_map:
        layer = _layer_of(name)
        if layer is not None and layer >= first:
            by_layer.setdefault(layer, []).append(name)
    if not by_layer:
        return None
    field = hf.family.mtp_layers_field
    if field is None:
        raise ValueError(f"the Hugging Face checkpoint in {reader.directory} holds layers {sorted(by_layer)} past "
                         f"num_hidden_layers={first}, which {hf.model_type} models do not have: use the config.json "
                         "saved with these weights")
    declared = declared_layers(hf)
    expected = set(range(first, first + declared))
    if set(by_layer) != expected:
        raise ValueError(
            f"the Hugging Face checkpoint in {reader.directory} holds multi-token-prediction layers "
            f"{sorted(by_layer)} (past num_hidden_layers={first}) but its config.json counts {field}={declared} "
            f"(layers {sorted(expected)}): set {field} to the number of layers the weights hold, or use the "
            "config.json saved with these weights")
    for layer in sorted(by_layer):
        required, optional = _shapes(hf, layer)
        present = set(by_layer[layer])
        try:
            reader.check({**required, **{n: s for n, s in optional.items() if n in present}})
        except ValueError as error:
            raise ValueError(f"multi-token-prediction layer {layer} ({field}={declared}) is incomplete, so no "
                             f"engine could serve it as a draft model: {error}") from None
    names = tuple(name for layer in sorted(by_layer) for name in sorted(by_layer[layer]))
    return MtpLayers(reader.directory.resolve(), names, declared)


def find_in_hf_dir(hf_dir: str | Path, hf: HFModelConfig) -> MtpLayers | None:
    with HFWeightsReader(hf_dir) as reader:
        return find_in_checkpoint(reader, hf)


def carried_in(step_dir: str | Path) -> MtpLayers | None:
    """The MTP layers a trainer checkpoint's step directory carries (None: none)."""
    directory = Path(step_dir) / CARRIED_DIR
    if not directory.is_dir():
        return None
    with HFWeightsReader(directory) as reader:
        names = tuple(reader.weight_map)
    layers = {_layer_of(name) for name in names}
    return MtpLayers(directory.resolve(), names, len(layers))


def config_with_layers(raw: dict[str, Any], hf: HFModelConfig, carried: MtpLayers | None,
                       where: str) -> dict[str, Any]:
    """``raw`` (``hf``'s config.json dict) counting the MTP layers carried, so that the config
    always describes the weights beside it. Lowering a count config.json gave is said (``where``:
    the checkpoint or directory that lacks them)."""
    field = hf.family.mtp_layers_field
    if field is None:
        return raw
    count = carried.layers if carried is not None else 0
    declared = declared_layers(hf)
    if declared != count:
        warnings.warn(f"config.json counts {field}={declared} multi-token-prediction layer(s) but {where} holds "
                      f"{count}: the config written with these weights says {field}={count} (speculative decoding "
                      "with SGLang's NEXTN draft needs the layers: convert from a checkpoint that has them)",
                      stacklevel=2)
    return {**raw, field: count}
