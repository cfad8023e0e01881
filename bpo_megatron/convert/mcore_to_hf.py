"""Trainer checkpoint → Hugging Face checkpoint (sharded safetensors, index, config, tokenizer).

A local gloo world (world size 1 by default; pass a layout to spread the model over processes)
loads the checkpoint, and :func:`~bpo_megatron.weights.gather.iter_hf_weights` streams the
Hugging Face tensors to rank 0, which writes them into size-bounded shards as they arrive, then
the multi-token-prediction layers the checkpoint carries (:mod:`bpo_megatron.weights.mtp`). The
config written is the one stored in the checkpoint, or ``hf_config`` after checking it describes
the same network, counting the multi-token-prediction layers written.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from bpo_megatron.convert.output_dir import copy_tokenizer_files, staged_output
from bpo_megatron.convert.validate import check_same_architecture
from bpo_megatron.convert.world import (
    DEFAULT_TIMEOUT_S,
    build_model,
    tear_down,
    world_size_for,
)
from bpo_megatron.models import HFModelConfig, ModelOptions
from bpo_megatron.parallel import ParallelConfig, layout_record
from bpo_megatron.weights import mtp
from bpo_megatron.weights.gather import iter_hf_weights
from bpo_megatron.weights.names import hf_tensor_shapes
from bpo_megatron.weights.safetensors_io import DEFAULT_MAX_SHARD_BYTES, ShardedSafetensorsWriter

_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_hf_config(ckpt: str | Path,
                         hf_config: str | Path | None = None) -> tuple[Path, HFModelConfig]:
    """The checkpoint's step directory and the config to export it with: ``hf_config`` (a
    ``config.json`` or a directory holding one) checked against the stored config, or the stored
    config itself. Raises ConfigMismatchError listing every field that differs."""
    from bpo_megatron.trainer import checkpoint

    directory = checkpoint.select(ckpt).path  # verified against its checksums: damage is named here
    if directory is None:
        raise FileNotFoundError(f"no checkpoint at {ckpt}: expected step directories holding {checkpoint.STATE_FILE}, "
                                "or such a step directory itself")
    stored = json.loads((directory / checkpoint.STATE_FILE).read_text()).get("hf_config")
    given = None
    if hf_config is not None:
        path = Path(hf_config)
        if not (path / "config.json" if path.is_dir() else path).is_file():
            raise FileNotFoundError(f"--hf-config {path}: no such config.json")
        given = HFModelConfig.load(path)
    if stored is None:
        if given is None:
            raise ValueError(f"checkpoint {directory} does not record its Hugging Face config; "
                             "pass --hf-config")
        return directory, given
    if given is not None:
        check_same_architecture(HFModelConfig.load(stored), given)
        return directory, given
    return directory, HFModelConfig.load(stored)


def convert_mcore_to_hf(ckpt: str | Path, out: str | Path, *, hf_config: str | Path | None = None,
                        tokenizer_dir: str | Path | None = None,
                        parallel: ParallelConfig = ParallelConfig(),
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
                        timeout: float = DEFAULT_TIMEOUT_S, progress: bool = True) -> Path:
    """Write the Hugging Face checkpoint of the trainer checkpoint ``ckpt`` to ``out``.

    Tokenizer files come from ``tokenizer_dir``, or from ``hf_config`` when that is a directory.
    Weights are written in the config's dtype (``dtype``/``torch_dtype``; float32 if unset).
    """
    from bpo_megatron.parallel.local_world import run_gloo_world

    directory, hf = checkpoint_hf_config(ckpt, hf_config)
    if hf.weights_dtype not in _EXPORT_DTYPES:
        raise ValueError(f"config dtype {hf.weights_dtype!r} is not one of {sorted(_EXPORT_DTYPES)}")
    if tokenizer_dir is None and hf_config is not None and Path(hf_config).is_dir():
        tokenizer_dir = hf_config
    world = world_size_for(parallel)
    carried = mtp.carried_in(directory)
    raw = mtp.config_with_layers(hf.to_hf_dict(), hf, carried, where=f"checkpoint {directory}")
    with staged_output(out, overwrite=overwrite) as staging:
        run_gloo_world(_export_rank, world, str(directory), str(staging), parallel, raw, carried,
                       max_shard_bytes, progress, timeout=timeout)
        (staging / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, staging)
    return Path(out)


def _export_rank(directory: str, staging: str, parallel: ParallelConfig, raw: dict,
                 carried: mtp.MtpLayers | None, max_shard_bytes: int, progress: bool) -> int | None:
    from tqdm import tqdm

    from bpo_megatron.trainer import checkpoint

    hf = HFModelConfig.load(raw)
    # Any padding works: Megatron loads embedding rows padded for another TP size as well.
    model = build_model(hf, parallel, ModelOptions())
    checkpoint.load(directory, model, None, layout=layout_record(parallel, dist.get_world_size()),
                    verify=False)  # verified before the world started
    model.eval()
    writing = dist.get_rank() == 0
    writer = ShardedSafetensorsWriter(staging, max_shard_bytes) if writing else None
    extra = carried.names if carried is not None else ()
    with tqdm(total=len(hf_tensor_shapes(hf)) + len(extra), desc="writing HF tensors", unit="tensor",
              disable=None if progress and writing else True) as bar:
        for name, tensor in iter_hf_weights(model, hf, dtype=_EXPORT_DTYPES[hf.weights_dtype]):
            writer.add(name, tensor)
            bar.update()
        if writing and carried is not None:  # after the main model, as they came (their own dtype)
            for name, tensor in carried.tensors():
                writer.add(name, tensor)
                bar.update()
    tear_down()
    return len(writer.close()["weight_map"]) if writer else None
