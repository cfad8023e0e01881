"""Block FP8 that SGLang can build (``rollout/sglang/fp8_layout.py``): every quantized layer's
partitions per rank against SGLang's rule (a multiple of 128, ``moe_tp_size = tp // ep`` for the
experts) at the recipes' engine layouts; linear layers it cannot build served in bf16 (the FP8
copy's ``ignored_layers``, sent unquantized), experts refused naming the ``ep_size`` that works;
the copy made once per node under a unique name. SGLang's own ``create_weights`` agrees:
``tests/sglang_contract/test_fp8_layers.py``."""

from __future__ import annotations

import fcntl
import json
import socket
from pathlib import Path

import pytest
import torch

from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.rollout.sglang.fp8_layout import BLOCK, quantized_layout, sglang_layers, working_expert_parallelism
from bpo_megatron.rollout.sglang.options import SGLangConfig, SGLangOptions
from bpo_megatron.weights import fp8

ROOT = Path(__file__).resolve().parents[1]
QWEN3_30B = HFModelConfig.load(ROOT / "configs" / "models" / "qwen3_30b_a3b")
GLM_AIR = HFModelConfig.load(ROOT / "configs" / "models" / "glm4_5_air")


def _fp8(tp: int, ep: int = 1, *extra: str) -> SGLangOptions:
    return SGLangOptions(quantization="fp8", tp_size=tp, ep_size=ep, extra_args=extra)


def test_every_partition_is_the_model_width_over_the_ranks_and_broken_exactly_when_not_a_multiple_of_128():
    """Qwen3-30B-A3B at TP 4: q 32 heads × 128 / 4, k and v 4 KV heads × 128 / 4, o_proj's input
    4096 / 4, the experts' 768 / moe_tp (4 // ep)."""
    placed = {p.layer.name: p for p in sglang_layers(QWEN3_30B, tp=4, ep=1, fuse_shared_experts=True)}
    assert set(placed) == {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.experts"}  # no dense MLP, no shared expert
    assert [size for _, _, size in placed["self_attn.qkv_proj"].layer.partitions()] == [1024, 128, 128]
    assert placed["self_attn.o_proj"].layer.partitions() == [("input", 4096, 1024)]
    assert placed["mlp.experts"].layer.partitions()[0][1:] == (768, 192)
    assert placed["mlp.experts"].layers == tuple(range(48)) and placed["mlp.experts"].layer.num_experts == 128
    for tp, ep in [(1, 1), (2, 1), (4, 1), (4, 2), (4, 4), (8, 8)]:
        for p in sglang_layers(QWEN3_30B, tp=tp, ep=ep, fuse_shared_experts=True):
            assert bool(p.broken) == any(size % BLOCK for _, _, size in p.layer.partitions())
    # 768 / (tp // ep) is a multiple of 128 for moe_tp 1, 2 (768, 384), not 4 (192) or 8 (96)
    assert working_expert_parallelism(QWEN3_30B, 4) == [2, 4]
    assert working_expert_parallelism(QWEN3_30B, 8) == [4, 8]
    assert working_expert_parallelism(GLM_AIR, 8) == [8]  # 1,408 = 11 × 128 whole only


def test_qwen3_30b_at_the_recipes_tp_4_needs_expert_parallelism_and_is_refused_without_it():
    refused = quantized_layout(_fp8(4), QWEN3_30B)
    assert not refused.ok and refused.unquantized == ()
    [line] = refused.refused
    assert "mlp.experts of layers 0–47" in line and "768 / moe_tp 4 (tp 4 // ep 1) = 192" in line
    assert "set rollout.sglang.ep_size to 2 or 4" in line
    for tp, ep in [(4, 4), (4, 2), (2, 1), (1, 1)]:
        layout = quantized_layout(_fp8(tp, ep), QWEN3_30B)
        assert layout.ok and layout.unquantized == (), (tp, ep)
    assert quantized_layout(SGLangOptions(tp_size=4), QWEN3_30B) is None  # bf16: nothing to build in FP8
    uneven = quantized_layout(_fp8(4, 4), HFModelConfig.load({**QWEN3_30B.source, "num_experts": 126}))
    assert not uneven.ok and "ep_size=4 does not divide the 126 experts" in uneven.refused[0]
    assert "choose one of [2]" in uneven.refused[0]  # 126 = 2 × 63, and 768 / (4 // 2) = 384


def test_glm_air_serves_its_dense_mlp_and_shared_experts_in_bf16_and_its_experts_in_fp8_at_ep_8():
    """GLM-4.5-Air at TP 8: layer 0's MLP 10,944 / 8 = 1,368 and the shared experts' 1,408 / 8 = 176
    are not multiples of 128 (bf16); the routed experts whole per rank at EP 8 (1,408, FP8). At EP 1
    SGLang fuses the shared expert into the experts, split 8 ways (176): refused."""
    layout = quantized_layout(_fp8(8, 8), GLM_AIR)
    assert layout.ok
    dense = {f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")}
    shared = {f"model.layers.{i}.mlp.shared_experts.{p}_proj" for i in range(1, 46) for p in ("gate", "up", "down")}
    assert set(layout.unquantized) == dense | shared and len(layout.unquantized) == 3 + 45 * 3
    text = layout.describe()
    assert "10944 / tp 8 = 1368" in text and "1408 / tp 8 = 176" in text and "1408 / moe_tp 1 (tp 8 // ep 8) = 1408" in text
    at_ep_1 = quantized_layout(_fp8(8, 1), GLM_AIR)
    assert not at_ep_1.ok and "ep_size to 8" in at_ep_1.refused[0] and "1408 / moe_tp 8 (tp 8 // ep 1) = 176" in at_ep_1.refused[0]
    fused = {p.layer.name: p.layer for p in sglang_layers(GLM_AIR, tp=8, ep=1, fuse_shared_experts=True)}
    assert fused["mlp.experts"].num_experts == 129 and "mlp.shared_experts.gate_up_proj" not in fused
    # at TP 1 the merged gate/up of layer 0 (10,944 = 85.5 blocks) is still refused; its down_proj,
    # not split, is built (SGLang checks a row-parallel input only at TP > 1)
    assert set(quantized_layout(_fp8(1), GLM_AIR).unquantized) == {"model.layers.0.mlp.gate_proj",
                                                                   "model.layers.0.mlp.up_proj"}
    # SGLang told not to fuse: the shared experts stay linear layers of their own even at EP 1
    unfused = quantized_layout(_fp8(1, 1, "--disable-shared-experts-fusion"), GLM_AIR)
    assert unfused.ok and "mlp.shared_experts.gate_up_proj of layers 1–45" in unfused.describe()


def _run_cli(module: str, argv: list[str], capsys) -> tuple[int, str]:
    import importlib

    code = importlib.import_module(module).main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_plan_and_train_check_name_the_modules_the_rule_and_what_is_done(capsys):
    """The shipped recipes pass in FP8 (EP = TP in the engines); with the experts split over TP the
    planner reports the failed check and `train --check` refuses (exit 2), naming the fix."""
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.planner.layout import Allocation, layout_checks

    for recipe, bf16 in [("qwen3_30b_a3b_bpo.yaml", 0), ("glm4_5_air_bpo.yaml", 138)]:
        cfg = load_experiment(ROOT / "configs" / recipe, ["rollout.sglang.quantization=fp8"])  # the config check passes
        [check] = [c for c in layout_checks(cfg, cfg.hf_config(), Allocation.of(cfg)) if "quantized layers" in c.message]
        assert check.ok and "refused" not in check.message, check.message
        assert (f"({bf16} modules served in bf16)" in check.message) == bool(bf16)
    code, out = _run_cli("bpo_megatron.planner.cli", [str(ROOT / "configs" / "qwen3_30b_a3b_bpo.yaml"),
                                                       "rollout.sglang.quantization=fp8", "rollout.sglang.ep_size=1"],
                         capsys)
    assert code == 1 and "FAIL  quantized layers" in out and "refuses this (exit 2)" in out
    code, out = _run_cli("bpo_megatron.commands.train", [str(ROOT / "configs" / "qwen3_30b_a3b_bpo.yaml"),
                                                          "rollout.sglang.quantization=fp8", "rollout.sglang.ep_size=1",
                                                          "--check"], capsys)
    assert code == 2 and "mlp.experts of layers 0–47" in out and "not a multiple of 128" in out
    assert "set rollout.sglang.ep_size to 2 or 4" in out


def test_the_engines_expert_parallelism_is_a_typed_setting_and_fp8_widens_the_start_bound():
    command = SGLangConfig(model_path="m", tp_size=4, ep_size=4).launch_command(30000)
    assert command[command.index("--ep-size") + 1] == "4"
    assert "--ep-size" not in SGLangConfig(model_path="m", tp_size=4).launch_command(30000)
    with pytest.raises(ValueError, match="ep_size=3 must divide rollout.sglang.tp_size=4"):
        SGLangOptions(tp_size=4, ep_size=3)
    with pytest.raises(ValueError, match="set by rollout.sglang.ep_size"):
        SGLangOptions(tp_size=4, extra_args=("--ep", "4"))
    plain, served = SGLangOptions(), SGLangOptions(quantization="fp8", deep_gemm_compile_s=1200, fp8_copy_timeout_s=600)
    assert (plain.server_start_s, plain.start_bound_s) == (900.0, 900.0)
    assert (served.server_start_s, served.start_bound_s) == (900.0 + 1200, 900.0 + 1200 + 600)


def test_the_trainer_sends_the_bf16_served_modules_unquantized():
    from bpo_megatron.experiment import load_experiment

    cfg = load_experiment(ROOT / "configs" / "glm4_5_air_bpo.yaml", ["rollout.sglang.quantization=fp8"])
    sync = cfg.rollout.sync_quantization(cfg.hf_config())
    assert sync.form == "fp8-blocks" and len(sync.unquantized) == 138
    weight = torch.randn(256, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    [(name, sent)] = sync.tensors("model.layers.7.mlp.shared_experts.down_proj.weight", weight)
    assert sent is weight
    [(_, q), (scale_name, scale)] = sync.tensors("model.layers.7.mlp.experts.3.down_proj.weight", weight)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 2) and scale_name.endswith("_scale_inv")
    assert cfg.rollout.sync_quantization(cfg.hf_config()) == sync  # one decision, the same at every push
    bf16 = load_experiment(ROOT / "configs" / "glm4_5_air_bpo.yaml", [])
    assert bf16.rollout.sync_quantization(bf16.hf_config()) is None


@pytest.fixture(scope="module")
def glm_dir(tiny_checkpoint):
    return tiny_checkpoint("tiny_glm4_moe")


def test_the_fp8_copy_keeps_the_ignored_layers_in_bf16_and_lists_them_as_sglang_reads_them(glm_dir, tmp_path):
    from bpo_megatron.weights.safetensors_io import HFWeightsReader

    kept = {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"}
    served = fp8.served_checkpoint(glm_dir, tmp_path / "copies", unquantized=kept)
    config = json.loads((served / "config.json").read_text())["quantization_config"]
    assert config == {**fp8.QUANTIZATION_CONFIG, "ignored_layers": sorted(kept)}
    with HFWeightsReader(glm_dir) as source, HFWeightsReader(served) as target:
        for module in kept:
            assert torch.equal(target.slice(module + ".weight")[:], source.slice(module + ".weight")[:])
            assert module + ".weight_scale_inv" not in target.weight_map
        assert target.slice("model.layers.1.mlp.shared_experts.down_proj.weight")[:].dtype == torch.float8_e4m3fn
    assert not [p for p in served.parent.iterdir() if ".partial-" in p.name]  # nothing left under way
    # another layout needs another copy: said, not silently served with the wrong ignored layers
    with pytest.raises(ValueError, match="remove .* or set rollout.sglang.fp8_checkpoint_dir"):
        fp8.served_checkpoint(glm_dir, tmp_path / "copies")
    assert fp8.served_checkpoint(glm_dir, tmp_path / "copies", unquantized=kept) == served  # reused


def test_the_fp8_copy_is_made_by_one_engine_of_a_node_the_others_wait_a_bounded_time(glm_dir, tmp_path, monkeypatch):
    parent = tmp_path / "copies"
    parent.mkdir()
    with open(parent / f".{glm_dir.name}.fp8.lock", "a") as held:  # another engine of this node is making it
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match=r"within 1 s \(rollout.sglang.fp8_copy_timeout_s"):
            fp8.served_checkpoint(glm_dir, parent, timeout_s=1.0)
    partials = []
    real_copytree = fp8.shutil.copytree
    monkeypatch.setattr(fp8.shutil, "copytree", lambda src, dst, **kw: partials.append(Path(dst)) or
                        real_copytree(src, dst, **kw))
    first = fp8.served_checkpoint(glm_dir, parent)
    assert fp8.served_checkpoint(glm_dir, parent) == first and len(partials) == 1  # made once, then reused
    [partial] = partials
    assert partial.name.startswith(f"{glm_dir.name}.fp8.partial-{socket.gethostname()}-")  # node, process, random
    assert partial.name != fp8._partial_name(first) and not partial.exists()
