"""Tiny model configs and random Hugging Face checkpoints for tests and benchmarks (no hub access
needed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

# Tiny configs: ``tiny_qwen3_moe`` (2 MoE layers, top-2 of 4 experts), ``tiny_qwen3`` (dense) and
# ``tiny_glm4_moe`` (GLM-4.5: a dense first layer, then 2 MoE layers of top-2 of 8 experts + a shared
# expert, sigmoid routing with an expert bias, Q/K/V biases, QK-norm, RoPE on half of each head) and
# ``tiny_deepseek_v3`` (DeepSeek-V3: latent attention, a dense first layer, then 2 MoE layers of
# group-limited top-4 of 8 experts + a shared expert, sigmoid routing with an expert bias)
MODEL_CONFIGS = Path(__file__).resolve().parent / "configs"
TINY_MOE = MODEL_CONFIGS / "tiny_qwen3_moe" / "config.json"


def tiny_moe():
    """The tiny Qwen3-MoE's :class:`~bpo_megatron.models.HFModelConfig`."""
    from bpo_megatron.models import HFModelConfig

    return HFModelConfig.load(TINY_MOE)


def qwen3_moe_config(**sizes: Any) -> dict[str, Any]:
    """A Qwen3-MoE ``config.json`` (as a dict) of the given sizes: what transformers and the
    trainer read, everything but the sizes fixed as the kit's models have them."""
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
        "decoder_sparse_step": 1, "hidden_act": "silu", "mlp_only_layers": [], "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1_000_000.0, "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False, "torch_dtype": "float32", "use_sliding_window": False,
    }
    config.update(sizes)
    return config


def glm4_moe_config(**sizes: Any) -> dict[str, Any]:
    """A GLM-4.5 MoE ``config.json`` (as a dict) of the given sizes (``num_experts`` as
    ``n_routed_experts``), the rest as the tests' tiny GLM has it: Q/K/V biases, RoPE over half of
    each head, one shared expert, sigmoid routing with a scale, the first layer dense."""
    config = json.loads((MODEL_CONFIGS / "tiny_glm4_moe" / "config.json").read_text())
    if "num_experts" in sizes:
        sizes = {**sizes, "n_routed_experts": sizes.pop("num_experts")}
    config.update(sizes)
    return config


def deepseek_v3_config(**sizes: Any) -> dict[str, Any]:
    """A DeepSeek-V3 ``config.json`` (as a dict) of the given sizes (``num_experts`` as
    ``n_routed_experts``), the rest as the tests' tiny DeepSeek-V3 has it: latent attention, group-limited
    sigmoid routing with a bias and a scale, one shared expert, the first layer dense."""
    config = json.loads((MODEL_CONFIGS / "tiny_deepseek_v3" / "config.json").read_text())
    if "num_experts" in sizes:
        sizes = {**sizes, "n_routed_experts": sizes.pop("num_experts")}
    config.update(sizes)
    return config


# the families whose dense layers come first (first_k_dense_replace), by their config maker
_FIRST_DENSE = {"glm4_moe": glm4_moe_config, "deepseek_v3": deepseek_v3_config}


def moe_config(model_type: str, sizes: dict[str, Any], *, layers: int, dense_layers: int) -> dict[str, Any]:
    """A ``config.json`` of ``model_type`` (``qwen3_moe``, ``glm4_moe`` or ``deepseek_v3``) with
    ``layers`` layers of which ``dense_layers`` (0 or 1) are dense, where the family puts them:
    Qwen3-MoE the last (``mlp_only_layers``), GLM and DeepSeek-V3 the first (``first_k_dense_replace``)."""
    if model_type in _FIRST_DENSE:
        return _FIRST_DENSE[model_type](**sizes, num_hidden_layers=layers, first_k_dense_replace=dense_layers)
    return qwen3_moe_config(**sizes, num_hidden_layers=layers, mlp_only_layers=list(range(layers))[layers - dense_layers:])


def write_config(config: dict[str, Any], directory: Path) -> Path:
    """``config`` as ``directory/config.json``; the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def random_model_dir(config: dict[str, Any], directory: Path, *, seed: int) -> Path:
    """A random Hugging Face checkpoint of ``config`` in ``directory`` (made once: an existing
    checkpoint there is kept)."""
    if not (directory / "model.safetensors").exists() and not (directory / "model.safetensors.index.json").exists():
        random_checkpoint(write_config(config, directory) / "config.json", directory, seed=seed)
    return directory


def random_checkpoint(config, out: str | Path, *, seed: int) -> Path:
    """Save a random transformers model of ``config`` (a config object, or a directory or
    ``config.json`` holding one) to ``out``, initialised by :func:`spread_weights_`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(config, (str, Path)):
        path = Path(config)
        config = AutoConfig.from_pretrained(str(path.parent if path.suffix == ".json" else path))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    spread_weights_(model)
    model.save_pretrained(str(out))
    return Path(out)


def random_checkpoint_with_mtp(config: dict[str, Any], out: Path, *, seed: int, repeat_head: bool) -> Path:
    """A random checkpoint of ``config`` (a GLM-4.5 or DeepSeek-V3 ``config.json`` dict counting
    ``num_nextn_predict_layers``) with its multi-token-prediction layers, laid out as released
    checkpoints are: the main model in one shard, the MTP layers (``model.layers.{num_hidden_layers + i}``)
    in another, and the index. transformers builds no MTP layer, so each one's decoder layer is the
    last layer of a transformers model with one more layer (its names as transformers saves them);
    ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm`` are drawn like the model's norms and
    projections. ``repeat_head``: the layer repeats the embedding and output head (DeepSeek-V3's do)."""
    import tempfile

    from safetensors.torch import load_file, save_file

    first, count = config["num_hidden_layers"], config["num_nextn_predict_layers"]
    random_checkpoint(write_config(config, out) / "config.json", out, seed=seed)
    main = load_file(str(out / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed + 1)
    hidden = config["hidden_size"]
    extra: dict[str, torch.Tensor] = {}
    for i in range(count):
        layer = first + i
        with tempfile.TemporaryDirectory() as scratch:
            longer = write_config({**config, "num_hidden_layers": layer + 1, "num_nextn_predict_layers": 0},
                                  Path(scratch))
            random_checkpoint(longer / "config.json", longer, seed=seed + 2 + i)
            prefix = f"model.layers.{layer}."
            extra.update((name, t) for name, t in load_file(str(longer / "model.safetensors")).items()
                         if name.startswith(prefix))
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            extra[prefix + name] = 1.0 + 0.1 * torch.randn(hidden, generator=generator)
        extra[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) / math.sqrt(2 * hidden)
        if repeat_head:
            extra[prefix + "embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
            extra[prefix + "shared_head.head.weight"] = main["lm_head.weight"].clone()
    (out / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": main, "model-00002-of-00002.safetensors": extra}
    for file, tensors in shards.items():
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.nbytes for part in shards.values() for t in part.values())},
             "weight_map": {name: file for file, tensors in shards.items() for name in sorted(tensors)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


def spread_weights_(model) -> None:
    """Re-initialise a transformers model in place (torch's global generator) so that logits
    (~N(0, 2²)) and router scores (~N(0, 4²)) stay far from uniform: a wrong position, mask or
    expert shows up in log μ, and routing is not decided by near-ties. A router's expert bias
    (``e_score_correction_bias``, a buffer that checkpoints carry) gets ~N(0, 0.3²), the size of a
    sigmoid score's spread, so it changes which experts win."""
    config = model.config
    hidden = config.hidden_size
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
        for name, param in model.named_parameters():
            if param.ndim == 1:  # norms: distinct values, so a mix-up between them is visible
                param.normal_(1.0, 0.1)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 2.0 / math.sqrt(hidden) if config.tie_word_embeddings else 1.0)
            elif name.startswith("lm_head"):
                param.normal_(0.0, 2.0 / math.sqrt(hidden))
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 4.0 / math.sqrt(hidden))
            else:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]))


def placeholder_checkpoint(config_path: str | Path, out: Path, *, shard_bytes: int = 5 * 10**9) -> Path:
    """A checkpoint directory for checks that read a model's files but none of its numbers: the
    ``config.json`` at ``config_path`` and safetensors shards (with their index, as large checkpoints
    ship) whose headers list every tensor the config implies (names, shapes, the config's dtype) over
    sparse files of zeros, so a 100B-parameter model costs a few megabytes of disk."""
    from bpo_megatron.models import HFModelConfig
    from bpo_megatron.weights import hf_tensor_shapes

    hf = HFModelConfig.load(config_path)
    dtype, size = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}[hf.weights_dtype]
    shards: list[dict[str, Any]] = [{}]
    offset = total = 0
    for name, shape in hf_tensor_shapes(hf).items():
        nbytes = math.prod(shape) * size
        if offset and offset + nbytes > shard_bytes:
            shards.append({})
            offset = 0
        shards[-1][name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        total += nbytes
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(Path(config_path).read_text())
    weight_map = {}
    for index, tensors in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        encoded = json.dumps({"__metadata__": {"format": "pt"}, **tensors}).encode()
        encoded += b" " * (-len(encoded) % 8)
        with (out / file).open("wb") as handle:
            handle.write(len(encoded).to_bytes(8, "little") + encoded)
            handle.truncate(8 + len(encoded) + max(t["data_offsets"][1] for t in tensors.values()))
        weight_map.update(dict.fromkeys(tensors, file))
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=1))
    return out
