"""Hugging Face checkpoint → trainer checkpoint (Megatron distributed checkpoint of the model).

Everything that can be checked from file headers is checked first, in this process: the config
parses, the layout fits the model, and every tensor exists with its expected shape. Then a local
gloo world of the layout's size builds the model, each rank reads only its own slices, and the
ranks save a trainer checkpoint (``root/latest`` → ``step-00000000``, model only, with the HF
config in ``trainer_state.json``, and the multi-token-prediction layers carried beside it in
``mtp/``: :mod:`bpo_megatron.weights.mtp`). It loads into ``TrainActor.load`` under any layout.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from bpo_megatron.convert.output_dir import staged_output
from bpo_megatron.convert.world import (
    DEFAULT_TIMEOUT_S,
    build_model,
    tear_down,
    world_size_for,
)
from bpo_megatron.models import HFModelConfig, ModelOptions
from bpo_megatron.parallel import ParallelConfig, layout_record
from bpo_megatron.weights.load import load_hf_weights
from bpo_megatron.weights.mtp import MtpLayers, config_with_layers, find_in_checkpoint
from bpo_megatron.weights.names import check_hf_checkpoint, hf_tensor_shapes
from bpo_megatron.weights.safetensors_io import HFWeightsReader

# safetensors dtype tag -> the name transformers writes in config.json
_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def read_hf_config(hf_dir: str | Path) -> HFModelConfig:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"Hugging Face checkpoint directory {hf_dir} does not exist")
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir} has no config.json")
    return HFModelConfig.load(hf_dir)


def _checked_config_dict(hf: HFModelConfig, reader: HFWeightsReader) -> dict:
    """Refuse missing or misshaped tensors and experts the config does not count; the config to
    store, with the weights' dtype."""
    shapes = hf_tensor_shapes(hf)
    check_hf_checkpoint(reader, hf)
    raw = hf.to_hf_dict()
    if not (raw.get("dtype") or raw.get("torch_dtype")):
        # without a declared dtype, exports keep the dtype the weights came in
        raw["dtype"] = _DTYPE_NAMES.get(reader.dtype_of(next(iter(shapes))), "float32")
    return raw


def convert_hf_to_mcore(hf_dir: str | Path, out: str | Path, *,
                        parallel: ParallelConfig = ParallelConfig(),
                        options: ModelOptions | None = None, overwrite: bool = False,
                        timeout: float = DEFAULT_TIMEOUT_S, progress: bool = True) -> Path:
    """Write the trainer checkpoint of ``hf_dir`` to ``out``, converted in ``parallel``'s layout.

    Raises FileNotFoundError / ValueError (naming the file, field or tensor) before any work when
    the input is incomplete or does not fit; nothing is written on any error.
    """
    from bpo_megatron.parallel.local_world import run_gloo_world

    hf = read_hf_config(hf_dir)
    parallel.validate_model(num_layers=hf.num_hidden_layers,
                            num_experts=hf.num_experts if hf.is_moe else 0,
                            num_attention_heads=hf.num_attention_heads,
                            num_query_groups=hf.num_key_value_heads)
    world = world_size_for(parallel)
    parallel.validate_world(world)
    with HFWeightsReader(hf_dir) as reader:
        raw = _checked_config_dict(hf, reader)
        mtp = find_in_checkpoint(reader, hf)
    raw = config_with_layers(raw, hf, mtp, where=f"the checkpoint in {hf_dir}")
    with staged_output(out, overwrite=overwrite) as staging:
        run_gloo_world(_convert_rank, world, str(Path(hf_dir).resolve()), str(staging), parallel,
                       options or ModelOptions(), raw, mtp, progress, timeout=timeout)
    return Path(out)


def _convert_rank(hf_dir: str, root: str, parallel: ParallelConfig, options: ModelOptions,
                  raw: dict, mtp: MtpLayers | None, progress: bool) -> int:
    from bpo_megatron.trainer import checkpoint

    hf = HFModelConfig.load(raw)
    model = build_model(hf, parallel, options)
    count = load_hf_weights(model, hf, hf_dir, progress=progress and dist.get_rank() == 0)
    state = {"actor_step": 0, "hf_config": raw, "converted_from": hf_dir}
    checkpoint.save(root, 0, model, None, state,
                    layout=layout_record(parallel, dist.get_world_size()),
                    beside=mtp.write if mtp is not None else None)
    tear_down()
    return count
