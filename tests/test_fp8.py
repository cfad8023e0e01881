"""FP8 rollouts on a CPU: block-wise e4m3 quantization against its definition computed block by
block, the embedded engine holding its linear weights as an FP8 engine does (at load and at every
weight update) with log μ equal to a teacher-forced recompute through those weights, and the loop
syncing, verifying and training with an FP8 engine."""

from __future__ import annotations

import math

import pytest
import torch

from bpo_megatron.testing.recompute import teacher_forced
from bpo_megatron.weights import fp8


def _by_blocks(weight: torch.Tensor, block=(128, 128)):
    """The definition, one block at a time: scale = amax / 448, e4m3 of weight / scale."""
    rows, cols = weight.shape
    scales = torch.zeros(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    q = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            amax = float(part.abs().max())
            scales[i, j] = amax / 448.0 if amax > 0 else 1.0
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (part / scales[i, j]).to(
                torch.float8_e4m3fn)
    return q, scales


@pytest.mark.parametrize("shape", [(300, 200), (64, 32), (128, 256)])
def test_block_quantization_is_its_definition_within_e4m3_rounding(shape):
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0])) * 0.05
    zeroed = shape[0] > 128 and shape[1] > 128
    if zeroed:
        weight[:128, :128] = 0.0  # an all-zero block stays exactly zero (its scale is 1, not 0)
    q, scale_inv = fp8.quantize(weight)
    want_q, want_scale = _by_blocks(weight)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    assert scale_inv.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert torch.allclose(scale_inv, want_scale, rtol=1e-7, atol=0)
    assert torch.equal(q.float(), want_q.float())
    back = fp8.dequantize(q, scale_inv)
    per_element = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    # e4m3: 3 mantissa bits (half a step is 2^-4 relative), subnormals spaced 2^-9 of the scale
    assert bool(((back - weight).abs() <= weight.abs() * 2**-4 + per_element * 2**-10 + 1e-12).all())
    # each block's largest entry is e4m3's largest value, exactly
    assert float(q.float().abs().max()) == 448.0
    if zeroed:
        assert torch.count_nonzero(back[:128, :128]) == 0 and scale_inv[0, 0] == 1.0


def test_rounding_through_fp8_twice_is_rounding_once():
    weight = torch.randn(200, 300, generator=torch.Generator().manual_seed(3))
    once = fp8.round_through_fp8(weight)
    assert torch.equal(fp8.round_through_fp8(once), once) and not torch.equal(once, weight)
    assert fp8.round_through_fp8(weight.bfloat16()).dtype == torch.bfloat16


def test_the_linear_layers_are_quantized_and_the_router_embeddings_and_norms_are_not():
    assert all(fp8.quantized(f"model.layers.3.self_attn.{p}_proj.weight") for p in "qkvo")
    assert all(fp8.quantized(f"model.layers.0.mlp.{p}_proj.weight") for p in ("gate", "up", "down"))
    assert fp8.quantized("model.layers.1.mlp.experts.7.down_proj.weight")
    assert all(fp8.quantized(f"model.layers.1.mlp.shared_experts.{p}_proj.weight") for p in ("gate", "up", "down"))
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias", "model.embed_tokens.weight", "lm_head.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight", "model.norm.weight"):
        assert not fp8.quantized(name), name


@pytest.fixture(scope="module")
def moe_dir(tiny_checkpoint):
    return tiny_checkpoint("tiny_qwen3_moe")


@pytest.fixture(scope="module")
def glm_dir(tiny_checkpoint):
    return tiny_checkpoint("tiny_glm4_moe")


@pytest.mark.parametrize("checkpoint", ["moe_dir", "glm_dir"])
def test_an_fp8_engine_holds_rounded_linear_weights_and_reports_log_mu_of_them(checkpoint, request):
    from bpo_megatron.rollout import GenerationRequest, SamplingParams
    from bpo_megatron.rollout.hf.engine import HFEngine

    path = request.getfixturevalue(checkpoint)
    exact = HFEngine(path, capture_routing=True)
    engine = HFEngine(path, capture_routing=True, quantization="fp8")
    original = dict(exact.named_hf_weights())
    held = dict(engine.named_hf_weights())
    rounded = [name for name in held if fp8.quantized(name)]
    assert rounded and any(".experts." in name for name in rounded)
    if checkpoint == "glm_dir":  # GLM-4.5's shared expert is served in FP8 like the routed ones
        assert any(".shared_experts." in name for name in rounded)
    for name, tensor in held.items():
        want = fp8.round_through_fp8(original[name]) if fp8.quantized(name) else original[name]
        assert torch.equal(tensor, want), name
    # log μ is what the engine's own (rounded) weights give: a teacher-forced recompute through them
    requests = [GenerationRequest(f"q{i}", tuple(range(3 + i, 9 + i)), SamplingParams(temperature=0.8, max_new_tokens=12,
                                                                                    n=2, seed=5 + i))
                for i in range(3)]
    worst, moved = 0.0, 0.0
    for sample in engine.generate(requests):
        prompt = sample.prompt_tokens.numel()
        logprobs, routing = teacher_forced(engine.model, sample.tokens, temperature=0.8)
        got = logprobs[prompt - 1:].gather(1, sample.response_tokens[:, None])[:, 0]
        worst = max(worst, float((got - sample.rollout_logprobs).abs().max()))
        assert torch.equal(sample.routed_experts, routing.to(sample.routed_experts.dtype))
        unrounded, _ = teacher_forced(exact.model, sample.tokens, temperature=0.8)
        moved = max(moved, float((unrounded[prompt - 1:].gather(1, sample.response_tokens[:, None])[:, 0]
                                  - sample.rollout_logprobs).abs().max()))
    assert worst < 1e-5 and moved > 1e-4  # exact for its own weights; a real gap from the unrounded ones
    # the layers compute in block FP8: their inputs are rounded too (w8a8), not only their weights
    from bpo_megatron.rollout.hf.fp8_compute import Fp8Experts, Fp8Linear
    layer = engine.model.model.layers[-1]  # an MoE layer (GLM-4.5 begins with a dense one)
    assert isinstance(layer.self_attn.q_proj, Fp8Linear) and isinstance(layer.mlp.experts, Fp8Experts)
    # the output layer and the router stay in the engine's precision
    assert not isinstance(engine.model.lm_head, Fp8Linear)
    assert type(layer.mlp.gate) is type(exact.model.model.layers[-1].mlp.gate)
    weights_only = exact.model
    with torch.no_grad():
        for name, view in exact.named_hf_weights():
            view.copy_(held[name])  # the FP8 engine's weights, computed without rounding the inputs
    sample = engine.generate(requests[:1])[0]
    prompt = sample.prompt_tokens.numel()
    logprobs, _ = teacher_forced(weights_only, sample.tokens, temperature=0.8)
    inputs_rounded = (logprobs[prompt - 1:].gather(1, sample.response_tokens[:, None])[:, 0] - sample.rollout_logprobs)
    assert float(inputs_rounded.abs().max()) > 1e-4
    # a weight update arrives as sent, is held rounded, and the layer's e4m3 copy follows it in place
    name = f"model.layers.{len(engine.model.model.layers) - 1}.self_attn.q_proj.weight"  # `layer`'s
    sent = original[name] * 1.5
    before = layer.self_attn.q_proj.fp8_weight.data_ptr()
    engine.begin_weight_update(1)
    engine.update_weights([(name, sent)])
    engine.end_weight_update()
    assert torch.equal(dict(engine.named_hf_weights())[name], fp8.round_through_fp8(sent))
    q, scale_inv = fp8.quantize(sent)
    assert torch.equal(layer.self_attn.q_proj.fp8_weight.float(), q.float())
    assert torch.equal(layer.self_attn.q_proj.fp8_scale_inv, scale_inv)
    assert layer.self_attn.q_proj.fp8_weight.data_ptr() == before  # what a captured decode graph reads
    # a weight written in place (the shared-memory transport) is taken up at the end of the update
    engine.begin_weight_update(2)
    with torch.no_grad():
        dict(engine.named_hf_weights())[name].copy_(fp8.round_through_fp8(original[name]))
    engine.end_weight_update()
    assert torch.equal(layer.self_attn.q_proj.fp8_weight.float(), fp8.quantize(original[name])[0].float())
    engine.shutdown()
    exact.shutdown()


# a loop run (CI time): what an FP8 engine holds and reports is the test above, what the trainer
# sends an FP8 server the tests below; a sync verified in the loop, every default loop run's
@pytest.mark.ci
@pytest.mark.timeout(420)
def test_the_loop_syncs_verifies_and_trains_with_an_fp8_engine(tmp_path, ray_session, small_run):
    """The trainer rounds what it sends as the engine holds it (the one module that decides), so
    the engine's weights fingerprint exactly as sent (weight_sync.verify) and the loop trains; the
    engine/trainer gap is the FP8 rounding's."""
    from bpo_megatron.observability.metrics import read_metrics
    from loop_helpers import run_loop

    run_loop(small_run(tmp_path / "fp8", "train.steps=2", "rollout.hf.quantization=fp8"))
    steps = [r for r in read_metrics(tmp_path / "fp8") if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["abs_logp_diff_mean"] > 1e-4 and math.isfinite(r["loss"]) for r in steps)


def test_fp8_gemm_is_its_definition_group_by_group_and_block_by_block():
    """fp8.linear (here its emulation: no block-scaled FP8 GEMM on a CPU) against the w8a8 block
    definition in fp64: each activation row's 128-feature group and each 128 × 128 weight block
    rounded through e4m3 with its own amax / 448 scale, the products summed exactly."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 256, generator=gen) * torch.linspace(0.01, 3.0, 256)  # groups of different ranges
    x[2, 128:] = 0.0  # an all-zero group stays zero (scale 1)
    weight = torch.randn(300, 256, generator=gen) * 0.05
    q, scale_inv = fp8.quantize(weight)
    rows = torch.zeros(5, 256, dtype=torch.float64)
    for r in range(5):
        for g in range(2):
            part = x[r, g * 128:(g + 1) * 128]
            amax = float(part.abs().max())
            scale = amax / 448.0 if amax > 0 else 1.0
            rows[r, g * 128:(g + 1) * 128] = (part / scale).to(torch.float8_e4m3fn).double() * scale
    want = rows @ fp8.dequantize(q, scale_inv).double().t()
    assert fp8.gemm_path(x, q) == "emulated"
    got = fp8.linear(x, q, scale_inv)
    assert got.dtype == torch.float32 and got.shape == (5, 300)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
    xq, x_scale = fp8.quantize_activations(x)
    assert x_scale.shape == (5, 2) and x_scale[2, 1] == 1.0 and float(xq.float().abs().max()) == 448.0
    # the rounding is FP8's: the GEMM differs from the full-precision one by more than fp32 rounding
    assert not torch.allclose(got, x @ weight.t(), rtol=1e-4, atol=1e-5)
    # a partial last group is scaled by its own entries
    part = x[:, :200]
    q_part, scale_part = fp8.quantize(weight[:, :200])
    want_part = rows[:, :128] @ fp8.dequantize(q_part, scale_part).double()[:, :128].t()
    tail = torch.zeros(5, 72, dtype=torch.float64)
    for r in range(5):
        amax = float(part[r, 128:].abs().max())
        scale = amax / 448.0 if amax > 0 else 1.0
        tail[r] = (part[r, 128:] / scale).to(torch.float8_e4m3fn).double() * scale
    want_part += tail @ fp8.dequantize(q_part, scale_part).double()[:, 128:].t()
    assert torch.allclose(fp8.linear(part, q_part, scale_part).double(), want_part, rtol=1e-5, atol=1e-6)
    assert torch.equal(fp8.round_activations(part.view(5, 1, 200)).view(5, 200),
                       fp8.dequantize_activations(*fp8.quantize_activations(part)))


def test_fp8_gemm_takes_the_block_scaled_kernel_only_where_it_exists(monkeypatch):
    """The kernel's path is chosen by the platform (Hopper) and the shapes it takes; a CPU is never on it."""
    from bpo_megatron import platform

    x = torch.zeros(16, 512, dtype=torch.bfloat16)
    q = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    assert not platform.has_fp8_block_gemm(torch.device("cpu")) and fp8.gemm_path(x, q) == "emulated"
    monkeypatch.setattr(platform, "has_fp8_block_gemm", lambda device: True)
    assert fp8.gemm_path(x, q) == "scaled_mm"
    assert fp8.gemm_path(x.float(), q) == "emulated"  # the kernel returns bf16 from bf16 inputs here
    assert fp8.gemm_path(x[:, :384], q[:, :384]) == "emulated"  # 3 scale blocks along the input
    assert fp8.gemm_path(x[:15], q) == "emulated" and fp8.gemm_path(x, q[:200]) == "emulated"


def test_an_fp8_server_gets_e4m3_values_and_block_scales_and_starts_from_a_block_fp8_checkpoint(moe_dir):
    """What an FP8-serialized server (SGLang, rollout.sglang.quantization=fp8) loads: each linear
    weight as e4m3 and ``<name>_scale_inv``, the rest as it is, at sync (fp8.SYNC_FORMS) and in
    the checkpoint it starts from (made once beside the run's weights, config marked block FP8)."""
    from bpo_megatron.weights.safetensors_io import HFWeightsReader

    weight = torch.randn(200, 300, generator=torch.Generator().manual_seed(9))
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    blocks = fp8.SyncQuantization("fp8-blocks")
    [(q_name, q), (s_name, scale)] = blocks.tensors(name, weight)
    assert (q_name, s_name) == (name, name + "_scale_inv") and q.dtype == torch.float8_e4m3fn
    assert torch.equal(fp8.dequantize(q, scale), fp8.round_through_fp8(weight))
    router = "model.layers.0.mlp.gate.weight"
    assert blocks.tensors(router, weight)[0][1] is weight and len(blocks.tensors(router, weight)) == 1
    [(_, rounded)] = fp8.SyncQuantization("fp8").tensors(name, weight)
    assert torch.equal(rounded, fp8.round_through_fp8(weight))
    with pytest.raises(ValueError, match="choose one of"):
        fp8.SyncQuantization("int4")

    served = fp8.served_checkpoint(moe_dir)
    assert served == moe_dir.with_name(moe_dir.name + ".fp8") and fp8.served_checkpoint(moe_dir) == served  # once
    import json
    assert json.loads((served / "config.json").read_text())["quantization_config"] == fp8.QUANTIZATION_CONFIG
    with HFWeightsReader(moe_dir) as source, HFWeightsReader(served) as target:
        names = set(target.weight_map)
        for tensor_name in source.weight_map:
            original = source.slice(tensor_name)[:]
            if fp8.quantized(tensor_name):
                q, scale = target.slice(tensor_name)[:], target.slice(tensor_name + "_scale_inv")[:]
                assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
                assert torch.equal(fp8.dequantize(q, scale, dtype=original.dtype), fp8.round_through_fp8(original))
                names -= {tensor_name, tensor_name + "_scale_inv"}
            else:
                assert torch.equal(target.slice(tensor_name)[:], original)
                names.discard(tensor_name)
        assert not names  # nothing else in it
    elsewhere = fp8.served_checkpoint(moe_dir, moe_dir.parent / "fp8-copies")  # rollout.sglang.fp8_checkpoint_dir
    assert elsewhere == moe_dir.parent / "fp8-copies" / f"{moe_dir.name}.fp8" and (elsewhere / "config.json").is_file()


def test_the_sglang_engine_is_launched_in_fp8_and_the_trainer_told_to_send_blocks():
    from bpo_megatron.rollout import engine_spec
    from bpo_megatron.rollout.sglang.options import SGLangConfig, SGLangOptions

    spec = engine_spec("sglang")
    assert spec.weight_quantization(SGLangOptions(quantization="fp8")) == "fp8-blocks"
    assert spec.weight_quantization(SGLangOptions()) is None
    command = SGLangConfig(model_path="m", quantization="fp8").launch_command(30000)
    assert command[command.index("--quantization") + 1] == "fp8"
    assert "--quantization" not in SGLangConfig(model_path="m").launch_command(30000)
    with pytest.raises(ValueError, match="--quantization is set by rollout.sglang.quantization"):
        SGLangOptions(quantization="fp8", extra_args=("--quantization", "fp8"))
    with pytest.raises(ValueError, match="choose none or fp8"):
        SGLangOptions(quantization="int4")
