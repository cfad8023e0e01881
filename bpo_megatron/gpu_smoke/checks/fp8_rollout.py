"""FP8 rollouts on the device, in two parts.

1. The FP8 GEMM (:func:`bpo_megatron.weights.fp8.linear`: block-scaled ``torch._scaled_mm`` on a
   Hopper GPU) on the throughput model's quantized layer shapes at decode and prefill row counts:
   equal to its exact emulation within bf16 output rounding, and its time against the bf16 GEMM of
   the same (dequantized) weight, each replayed from a CUDA graph as the decode step runs them.
2. The embedded engine with ``rollout.hf.quantization=fp8`` (block FP8: weights rounded through
   block-wise e4m3, inputs quantized in 1 × 128 groups; rollout/hf/fp8_compute.py) against the same
   engine in bf16: the mismatch each leaves against the bf16 trainer with R3 (mean |log π − log μ|,
   the k3 KL), i.e. the mismatch FP8 rollouts add, on the small model.
3. The throughput model decoding through the engine's default path with and without FP8: tokens/s.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bpo_megatron import platform
from bpo_megatron.gpu_smoke.common import build_actor, single_rank_world, synchronize, timed
from bpo_megatron.gpu_smoke.profiles import Profile
from bpo_megatron.gpu_smoke.report import Outcome
from bpo_megatron.testing import random_model_dir, random_tokens, same_expert_sets, train_samples
from bpo_megatron.weights import fp8

TEMPERATURE = 1.0
MICRO_BATCH = 4
PREFILL_ROWS = 4096
DECODE_TOKENS = 64  # new tokens a row in the decode-speed part
# the FP8 result against its emulation: both round the same inputs; they differ by fp32 summation
# order and the bf16 rounding of the output (2^-8 relative), measured against the largest entry
GEMM_REL_TOL = 1e-2


def _layer_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """The ``[out, in]`` of every linear weight FP8 serving quantizes, one per kind."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    heads, kv_heads, inter = config["num_attention_heads"], config["num_key_value_heads"], config["moe_intermediate_size"]
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
            "o_proj": (hidden, heads * head_dim), "expert gate_up": (2 * inter, hidden),
            "expert down": (hidden, inter)}


def _mean_ms(fn, repeats: int) -> float:
    """The device time of one call in ms: on a GPU ``repeats`` calls captured as one CUDA graph and
    replayed (as the engine's decode step runs them: no launch cost on the host, which would
    otherwise dominate these microsecond GEMMs), elsewhere back to back after a warm-up."""
    if platform.has_cuda():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture: kernels chosen, workspaces allocated
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeats):
                fn()
        graph.replay()
        synchronize()
        start = time.perf_counter()
        for _ in range(3):
            graph.replay()
        synchronize()
        return 1e3 * (time.perf_counter() - start) / (3 * repeats)
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e3 * (time.perf_counter() - start) / repeats


def _gemms(profile: Profile, out: Outcome) -> None:
    device = platform.device()
    dtype = torch.bfloat16 if profile.device == "cuda" else torch.float32
    generator = torch.Generator(device=device).manual_seed(0)
    rows_list = sorted({*profile.decode_sequences, PREFILL_ROWS if profile.device == "cuda" else 32})
    repeats = 50 if profile.device == "cuda" else 2
    table, worst, paths = [], 0.0, set()
    for layer, (n_out, n_in) in _layer_shapes(profile.large_model).items():
        weight = (torch.randn(n_out, n_in, device=device, generator=generator) * 0.02).to(dtype)
        q, scale_inv = fp8.quantize(weight)
        dense = fp8.dequantize(q, scale_inv, dtype=dtype)
        for rows in rows_list:
            x = torch.randn(rows, n_in, device=device, generator=generator).to(dtype)
            path = fp8.gemm_path(x, q)
            fast, exact = fp8.linear(x, q, scale_inv).float(), fp8.emulated_linear(x, q, scale_inv).float()
            error = float((fast - exact).abs().max() / exact.abs().max())
            worst, paths = max(worst, error), paths | {path}
            fp8_ms = _mean_ms(lambda: fp8.linear(x, q, scale_inv), repeats)
            bf16_ms = _mean_ms(lambda: x @ dense.t(), repeats)
            gemm_ms = float("nan")  # the block-scaled GEMM alone, its input quantized beforehand
            if path == "scaled_mm":
                xq, x_scale = fp8.quantize_activations(x)
                gemm_ms = _mean_ms(lambda: fp8.block_scaled_mm(xq, x_scale, q, scale_inv, x.dtype), repeats)
            table.append(dict(layer=layer, out=n_out, inp=n_in, rows=rows, path=path, fp8_ms=fp8_ms,
                              scaled_mm_only_ms=gemm_ms, dense_ms=bf16_ms, time_vs_dense=fp8_ms / bf16_ms,
                              rel_err_vs_emulation=error))
    out.tables["FP8 GEMM (fp8.linear) against the dense GEMM of the same weight"] = table
    out.numbers.update(gemm_paths=",".join(sorted(paths)), gemm_rel_err_max=worst)
    out.require(worst <= GEMM_REL_TOL, f"fp8.linear equals its exact emulation within {GEMM_REL_TOL:g} of the "
                                       f"largest entry on every shape (worst {worst:.1e}; paths {sorted(paths)})")
    if platform.has_fp8_block_gemm(device):
        out.require(paths == {"scaled_mm"}, f"every shape runs torch._scaled_mm on this GPU (paths {sorted(paths)})")
        decode = [row["time_vs_dense"] for row in table if row["rows"] in profile.decode_sequences]
        out.numbers.update(decode_time_vs_dense_median=sorted(decode)[len(decode) // 2])
    else:
        out.notes.append(f"No block-scaled FP8 GEMM on {device.type}: fp8.linear runs its emulation here, so the "
                         "times compare the emulation, not FP8 hardware")


def _engine(profile: Profile, workdir: Path, out: Outcome) -> None:
    from bpo_megatron.models import HFModelConfig
    from bpo_megatron.models.options import TORCH_DTYPES
    from bpo_megatron.rollout import GenerationRequest, SamplingParams
    from bpo_megatron.rollout.hf.engine import HFEngine

    config = profile.small_model
    hf = HFModelConfig.load(config)
    model_dir = random_model_dir(config, workdir / "small_moe", seed=0)
    prompts = random_tokens(profile.engine_prompts, 24, hf.vocab_size, seed=5)
    requests = [GenerationRequest(f"p{i}", p, SamplingParams(temperature=TEMPERATURE, n=profile.engine_n,
                                                              max_new_tokens=profile.engine_new_tokens, seed=10 + i))
                for i, p in enumerate(prompts)]
    runs, times = {}, {}  # the small model: engines built from its checkpoint (each converts its own copy)
    for precision in ("none", "fp8"):
        engine = HFEngine(model_dir, capture_routing=True, dtype=TORCH_DTYPES[profile.dtype], device=platform.device(),
                          quantization=precision)
        engine.generate(requests)  # warm-up: the same shapes' graphs captured, kernels chosen
        with timed(times, precision):
            runs[precision] = engine.generate(requests)
        engine.shutdown()
        del engine

    rows = []
    with single_rank_world():
        actor = build_actor(profile, config, replay=True, micro_batch_size=MICRO_BATCH, weights=model_dir,
                            temperature=TEMPERATURE)
        for precision, samples in runs.items():
            generated = sum(s.response_tokens.numel() for s in samples)
            advantages = torch.tensor([float((s.response_tokens % 2 == 0).float().mean()) - 0.5 for s in samples])
            train = train_samples(samples, advantages)
            scored = actor.compute_logprobs(train)
            free = actor.compute_logprobs(train, record_routing=True)
            diff = torch.cat([(mine - s.rollout_logprobs) for mine, s in zip(scored.logprobs, samples, strict=True)])
            free_same = torch.cat([same_expert_sets(t, s.routed_experts).flatten()
                                   for t, s in zip(free.routed_experts, samples)])
            rows.append(dict(engine=profile.dtype if precision == "none" else "fp8 (block e4m3, w8a8)",
                             response_tokens=generated, tokens_per_s=generated / times[precision],
                             abs_logp_diff_mean=float(diff.abs().mean()), abs_logp_diff_max=float(diff.abs().max()),
                             kl_k3=float((diff.exp() - 1 - diff).mean()),
                             free_routing_agreement=float(free_same.float().mean())))
        actor.close()
    out.tables["the engine in its dtype and in FP8, against the trainer (R3 on)"] = rows
    base, quantized = rows
    out.numbers.update(base_abs_logp_diff_mean=base["abs_logp_diff_mean"],
                       fp8_abs_logp_diff_mean=quantized["abs_logp_diff_mean"], fp8_kl_k3=quantized["kl_k3"],
                       fp8_free_routing_agreement=quantized["free_routing_agreement"])
    out.require(all(row["response_tokens"] > 0 and torch.isfinite(torch.tensor(row["abs_logp_diff_mean"]))
                    for row in rows), "both engines generate, every |Δ log p| finite")
    out.require(quantized["abs_logp_diff_mean"] > base["abs_logp_diff_mean"],
                f"FP8 adds mismatch against the trainer (mean |Δ log p| {quantized['abs_logp_diff_mean']:.2e} "
                f"vs {base['abs_logp_diff_mean']:.2e} with the engine in {profile.dtype})")


def _decode_speed(profile: Profile, out: Outcome) -> None:
    """The throughput model decoding the largest decode size through the engine's default path,
    with and without FP8 (a fresh model each: an FP8 engine converts the model it is given)."""
    from bpo_megatron.gpu_smoke.checks.rollout_decode import decode_model
    from bpo_megatron.rollout import GenerationRequest, SamplingParams
    from bpo_megatron.rollout.hf.engine import HFEngine

    rows, steps = max(profile.decode_sequences), DECODE_TOKENS
    table = []
    for precision in ("none", "fp8"):
        model = decode_model(profile)
        prompts = random_tokens(rows, profile.decode_prompt_tokens, model.config.vocab_size, seed=rows)
        requests = [GenerationRequest(f"p{i}", p, SamplingParams(temperature=TEMPERATURE, max_new_tokens=steps, seed=i))
                    for i, p in enumerate(prompts)]
        engine = HFEngine(model, capture_routing=True, max_batch_rows=rows, quantization=precision)
        engine.generate(requests)  # warm-up: the timed run's decode state built (graphs captured)
        times: dict[str, float] = {}
        with timed(times, "s"):
            samples = engine.generate(requests)
        decode_path = engine.decode_path
        engine.shutdown()
        del engine, model
        generated = sum(s.response_tokens.numel() for s in samples)
        table.append(dict(engine="fp8 (block e4m3, w8a8)" if precision == "fp8" else profile.dtype, rows=rows,
                          new_tokens=steps, decode_path=decode_path, rollout_s=times["s"],
                          tokens_per_s=generated / times["s"]))
        out.require(generated == rows * steps, f"{precision}: every response ran to {steps} tokens ({generated})")
    out.tables["the throughput model decoding, without and with FP8"] = table
    out.numbers.update(fp8_decode_tokens_per_s_vs_base=table[1]["tokens_per_s"] / table[0]["tokens_per_s"])
    out.notes.append("The FP8 engine computes its attention projections with fp8.linear (torch._scaled_mm where "
                     "the shapes fit it, on a Hopper GPU) and its experts with the grouped GEMM of its dtype on "
                     "inputs and weights rounded through e4m3 (torch has no grouped block-scaled FP8 GEMM)")


def run(profile: Profile, workdir: Path) -> Outcome:
    out = Outcome("fp8_rollout")
    try:
        _gemms(profile, out)
    except Exception as error:  # noqa: BLE001 - the kernel's refusal is the finding; the engine part still runs
        out.require(False, f"fp8.linear on {platform.device().type}: {type(error).__name__}: {error}")
    _engine(profile, workdir, out)
    _decode_speed(profile, out)
    return out
