"""SGLang 0.5.23 builds exactly the block-FP8 layers our check says it builds
(``bpo_megatron/rollout/sglang/fp8_layout.py``), at the recipes' model sizes and over engine
layouts it accepts and refuses.

In a process of SGLang's environment, on the CPU and the meta device, each layer shape our check
derives is given to SGLang's own FP8 methods: ``Fp8LinearMethod(config).create_weights`` and
``Fp8MoEMethod(config).create_weights``, on a bare module carrying what those read of the layer
they are given (the linear layer's TP group size, the MoE layer's ``moe_tp_size`` and gated runner):
no process group or model is built — SGLang's methods read nothing else, and building its model
classes needs a GPU's parallel state. Also run: the start-up check of the expert width
(``check_quantized_moe_compatibility``) at each layout, and ``Fp8Config.from_config`` with the
quantization config our FP8 copy carries, through SGLang's ``is_layer_skipped`` for every layer of
every decoder layer (what it serves in bf16 is exactly what we leave unquantized).

Which layers exist and which TP group splits them is our reading of SGLang's model code
(``models/qwen3_moe.py``, ``models/glm4_moe.py``), not executed here. Needs SGLang's environment
(``bash tools/setup.sh --sglang``); skips without it."""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest

from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.rollout.sglang.fp8_layout import ExpertLayer, LinearLayer, quantized_layout, sglang_layers
from bpo_megatron.rollout.sglang.options import SGLangOptions
from bpo_megatron.weights import fp8

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"

pytestmark = pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                                reason="SGLang's environment is missing: bash tools/setup.sh --sglang")

# the recipes' models (the 30B recipes, GLM-4.5-Air, the dense ablation) and engine layouts (tp, ep):
# the recipes' own (4, 4), (8, 8), (1, 1) among them, and ones SGLang refuses
MODELS = {"qwen3_30b_a3b": [(1, 1), (2, 1), (4, 1), (4, 2), (4, 4), (8, 1), (8, 8)],
          "glm4_5_air": [(1, 1), (2, 1), (2, 2), (4, 4), (8, 1), (8, 4), (8, 8)],
          "qwen3_4b": [(1, 1), (2, 1), (4, 1), (8, 1)]}

BUILD = r"""
import json, sys, types, torch
from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod, Fp8MoEMethod
from sglang.srt.layers.quantization.utils import is_layer_skipped
from sglang.srt.model_executor.model_runner_components.moe_ep_setup import check_quantized_moe_compatibility

def outcome(build):
    try:
        return {"ok": True, "shapes": build()}
    except (ValueError, AssertionError) as exc:
        return {"ok": False, "error": str(exc)}

def shapes(module):
    return {name: list(p.shape) for name, p in module.named_parameters()}

def linear(case, config):
    layer = torch.nn.Module()
    layer.tp_group = types.SimpleNamespace(world_size=case["tp_size"])  # what validate_block_quant_shapes reads
    with torch.device("meta"):
        Fp8LinearMethod(config).create_weights(layer, case["input_size_per_partition"], case["output_partition_sizes"],
                                               case["input_size"], case["output_size"], torch.bfloat16,
                                               weight_loader=None)
    return shapes(layer)

def experts(case, config):
    layer = torch.nn.Module()
    layer.moe_tp_size = case["moe_tp_size"]  # what FusedMoE sets: tp_size // ep_size
    layer.moe_runner_config = types.SimpleNamespace(is_gated=True)  # SwiGLU: gate and up in w13
    with torch.device("meta"):
        Fp8MoEMethod(config).create_weights(layer, case["num_experts"], case["hidden_size"],
                                            case["intermediate_size_per_partition"], torch.bfloat16,
                                            weight_loader=None)
    return shapes(layer)

def start_check(case):
    model = types.SimpleNamespace(hf_config=types.SimpleNamespace(quantization_config=case["quantization_config"]),
                                  hf_text_config=types.SimpleNamespace(moe_intermediate_size=case["moe_intermediate_size"]))
    check_quantized_moe_compatibility(model_config=model, tp_size=case["tp"], moe_ep_size=case["ep"], moe_dp_size=1)

request = json.load(open(sys.argv[1]))
built = []
for case in request["layers"]:
    config = Fp8Config.from_config(case["quantization_config"])
    built.append(outcome(lambda: (linear if case["kind"] == "linear" else experts)(case, config)))
starts = [outcome(lambda: start_check(case)) for case in request["starts"]]
skipped = []
for case in request["skips"]:
    config = Fp8Config.from_config(case["quantization_config"])
    skipped.append(sorted(prefix for prefix in case["prefixes"]
                          if is_layer_skipped(prefix, config.ignored_layers, fused_mapping=config.packed_modules_mapping)))
json.dump({"built": built, "starts": starts, "skipped": skipped}, open(sys.argv[2], "w"))
"""


def _case(layer: LinearLayer | ExpertLayer, config: dict) -> dict:
    if isinstance(layer, LinearLayer):
        return {"kind": "linear", "quantization_config": config, "tp_size": layer.tp_size,
                "input_size": layer.input_size, "input_size_per_partition": layer.input_size_per_partition,
                "output_size": layer.output_size, "output_partition_sizes": list(layer.output_partition_sizes)}
    return {"kind": "experts", "quantization_config": config, **asdict(layer),
            "intermediate_size_per_partition": layer.intermediate_size_per_partition}


def _splits(layer: LinearLayer | ExpertLayer) -> bool:
    """SGLang's layer constructors need even splits (they assert); our check refuses uneven ones."""
    return all(size is not None for _, _, size in layer.partitions()) and (
        not isinstance(layer, LinearLayer) or layer.input_size_per_partition is not None)


def _blocks(size: int) -> int:
    return -(-size // fp8.BLOCK[0])


def test_sglangs_own_fp8_create_weights_builds_exactly_the_layers_our_check_accepts(tmp_path):
    config = fp8.quantization_config()
    layers, expected, seen = [], [], set()
    starts, start_expected, skips, skip_expected = [], [], [], []
    for model, layouts in MODELS.items():
        hf = HFModelConfig.load(ROOT / "configs" / "models" / model)
        for tp, ep in layouts:
            options = SGLangOptions(quantization="fp8", tp_size=tp, ep_size=ep)
            placed = sglang_layers(hf, tp, ep, fuse_shared_experts=ep == 1)
            for p in placed:
                key = json.dumps(_case(p.layer, config), sort_keys=True)
                if _splits(p.layer) and key not in seen:
                    seen.add(key)
                    layers.append(_case(p.layer, config))
                    expected.append((model, tp, ep, p.layer, not p.broken))
            if hf.is_moe:
                starts.append({"quantization_config": config, "moe_intermediate_size": hf.moe_intermediate_size,
                               "tp": tp, "ep": ep})
                start_expected.append((model, tp, ep, not any(p.broken for p in placed
                                                               if isinstance(p.layer, ExpertLayer))))
            layout = quantized_layout(options, hf)
            prefixes = [f"model.layers.{i}.{p.layer.name}" for p in placed for i in p.layers]
            skips.append({"quantization_config": fp8.quantization_config(layout.unquantized), "prefixes": prefixes})
            skip_expected.append((model, tp, ep, sorted(f"model.layers.{i}.{p.layer.name}" for p in placed
                                                        for i in p.layers
                                                        if p.broken and isinstance(p.layer, LinearLayer))))
    # both verdicts are exercised: layers SGLang builds and layers it refuses, at the start and per layer
    assert {ok for *_, ok in expected} == {True, False} and {ok for *_, ok in start_expected} == {True, False}
    (tmp_path / "request.json").write_text(json.dumps({"layers": layers, "starts": starts, "skips": skips}))
    done = subprocess.run([str(SGLANG_PYTHON), "-c", BUILD, str(tmp_path / "request.json"), str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())

    for (model, tp, ep, layer, ours), theirs in zip(expected, out["built"], strict=True):
        assert theirs["ok"] == ours, (model, tp, ep, layer, theirs)
        if not ours:
            assert "is not divisible by weight quantization block" in theirs["error"], theirs
            continue
        shapes = theirs["shapes"]
        if isinstance(layer, LinearLayer):  # e4m3 [out, in] on each rank, one fp32 scale per 128 × 128 block
            rows, cols = sum(layer.output_partition_sizes), layer.input_size_per_partition
            assert shapes == {"weight": [rows, cols], "weight_scale_inv": [_blocks(rows), _blocks(cols)]}, layer
        else:
            n, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size_per_partition
            assert shapes == {"w13_weight": [n, 2 * i, h], "w2_weight": [n, h, i],
                              "w13_weight_scale_inv": [n, 2 * _blocks(i), _blocks(h)],
                              "w2_weight_scale_inv": [n, _blocks(h), _blocks(i)]}, layer
    for (model, tp, ep, ours), theirs in zip(start_expected, out["starts"], strict=True):
        assert theirs["ok"] == ours, (model, tp, ep, theirs)
    for (model, tp, ep, ours), theirs in zip(skip_expected, out["skipped"], strict=True):
        assert theirs == ours, (model, tp, ep)
    # the recipes' own engine layouts: every expert built in FP8, and GLM's bf16 modules skipped by SGLang
    recipe = {(m, tp, ep): s for (m, tp, ep, _), s in zip(skip_expected, out["skipped"])}
    assert recipe[("qwen3_30b_a3b", 4, 4)] == [] and recipe[("qwen3_4b", 1, 1)] == []
    assert len(recipe[("glm4_5_air", 8, 8)]) == 2 + 2 * 45  # layer 0's gate_up and down, each shared expert's
