"""FP8 weights as SGLang 0.5.23 reads them: our block-wise e4m3 quantization
(``bpo_megatron.weights.fp8``) dequantized by SGLang's own ``block_quant_dequant``
(``sglang/srt/layers/quantization/fp8_utils.py``, what its block-FP8 loader falls back to), in a
process of SGLang's environment, gives the weight our FP8 engine computes with, bit for bit: the
same e4m3 values, ``weight_scale_inv`` of the shape and meaning SGLang expects. Needs that
environment (``bash tools/setup.sh --sglang``); skips without it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from bpo_megatron.weights import fp8

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"

pytestmark = pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                                reason="SGLang's environment is missing: bash tools/setup.sh --sglang")

DEQUANTIZE = """
import sys, torch
from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
saved = torch.load(sys.argv[1])
out = {name: block_quant_dequant(q, s, [128, 128], torch.float32) for name, (q, s) in saved.items()}
torch.save(out, sys.argv[2])
"""


def test_sglang_dequantizes_our_fp8_weights_to_what_our_engine_computes_with(tmp_path):
    gen = torch.Generator().manual_seed(0)
    weights = {"q_proj": torch.randn(384, 256, generator=gen) * 0.02,   # whole blocks
               "down_proj": torch.randn(200, 300, generator=gen) * 0.5,  # partial blocks at both edges
               "k_proj": torch.randn(64, 256, generator=gen)}           # fewer rows than one block
    quantized = {name: fp8.quantize(w) for name, w in weights.items()}
    torch.save(quantized, tmp_path / "ours.pt")
    done = subprocess.run([str(SGLANG_PYTHON), "-c", DEQUANTIZE, str(tmp_path / "ours.pt"), str(tmp_path / "theirs.pt")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "theirs.pt")
    for name, weight in weights.items():
        q, scale_inv = quantized[name]
        assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (-(-weight.shape[0] // 128), -(-weight.shape[1] // 128))
        assert torch.equal(theirs[name], fp8.dequantize(q, scale_inv)), name
        assert torch.equal(theirs[name], fp8.round_through_fp8(weight)), name


READ_CHECKPOINT = """
import glob, json, sys, torch
from sglang.srt.layers.quantization.fp8 import Fp8Config
from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
directory = sys.argv[1]
config = Fp8Config.from_config(json.load(open(directory + "/config.json"))["quantization_config"])
weights = dict(safetensors_weights_iterator(sorted(glob.glob(directory + "/*.safetensors"))))
dequantized = {name[: -len("_scale_inv")]: block_quant_dequant(weights[name[: -len("_scale_inv")]], scale,
                                                                 config.weight_block_size, torch.float32)
               for name, scale in weights.items() if name.endswith("_scale_inv")}
torch.save({"serialized": config.is_checkpoint_fp8_serialized, "block": list(config.weight_block_size),
            "names": sorted(weights), "dequantized": dequantized}, sys.argv[2])
"""


def test_sglang_reads_the_block_fp8_checkpoint_an_fp8_server_starts_from(tmp_path, tiny_checkpoint):
    """Our served checkpoint (``fp8.served_checkpoint``) through SGLang's own ``Fp8Config`` and
    safetensors reader: an FP8-serialized checkpoint with 128 × 128 blocks whose every quantized
    weight SGLang dequantizes to our rounding of the original, and nothing else quantized."""
    from bpo_megatron.weights.safetensors_io import HFWeightsReader

    model_dir = tiny_checkpoint("tiny_qwen3_moe", seed=1)
    served = fp8.served_checkpoint(model_dir)
    done = subprocess.run([str(SGLANG_PYTHON), "-c", READ_CHECKPOINT, str(served), str(tmp_path / "read.pt")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    read = torch.load(tmp_path / "read.pt")
    assert read["serialized"] and read["block"] == [128, 128]
    with HFWeightsReader(model_dir) as source:
        quantized = {name for name in source.weight_map if fp8.quantized(name)}
        assert quantized and set(read["dequantized"]) == quantized
        assert set(read["names"]) == set(source.weight_map) | {name + "_scale_inv" for name in quantized}
        for name in quantized:
            original = source.slice(name)[:]
            assert torch.equal(read["dequantized"][name], fp8.round_through_fp8(original).float()), name
