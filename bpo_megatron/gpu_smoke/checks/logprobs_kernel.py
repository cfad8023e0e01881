"""``vocab_parallel_logprobs`` against Megatron-Core's ``vocab_parallel_cross_entropy`` on the
device: the benchmark's measurement (:mod:`bpo_megatron.testing.logprob_timing`, as ``bpo-megatron
bench logprobs`` runs it on gloo ranks) run on one device, forward + backward time and peak memory
on top of the logits, and the errors against an fp64 log-softmax of the same logits; this check
adds the thresholds. Our op runs both ways: the chunked PyTorch passes ("ours") and the fused
triton kernels ("fused"), each copy-safe and in place (the trainer's mode). Where the fused kernels
cannot run (a CPU) their rows say so instead of timing anything."""

from __future__ import annotations

from pathlib import Path

import torch

from bpo_megatron import platform
from bpo_megatron.gpu_smoke.common import single_rank_world, synchronize
from bpo_megatron.gpu_smoke.profiles import Profile
from bpo_megatron.gpu_smoke.report import Outcome
from bpo_megatron.testing.logprob_timing import DevicePeak, NoPeak, time_methods

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CHECKED_ROWS = 256  # rows compared with the fp64 reference (all of them would double the memory)
MiB = 2**20
METHODS = ["ours", "ours-inplace", "fused", "fused-inplace"]  # besides Megatron's, the reference

# the trainer's mode with the fused kernels, against Megatron at bf16 (issue #26): no slower, and
# a tenth of the memory at most (the gradient lands in the logits buffer; Megatron keeps a softmax)
FUSED_TIME_VS_MEGATRON = 1.0
FUSED_MEMORY_VS_MEGATRON = 0.1


def _measure(tokens: int, vocab: int, dtype: str, repeats: int, group) -> list[dict]:
    device = platform.device()
    gen = torch.Generator(device=device).manual_seed(tokens)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    grad_out = torch.randn(tokens, device=device, generator=gen)

    def fresh() -> torch.Tensor:  # in-place methods consume their input: a new one every run
        return (torch.randn(tokens, vocab, device=device, generator=torch.Generator(device=device).manual_seed(1))
                * 4.0).to(DTYPES[dtype])

    runnable = [m for m in METHODS if not m.startswith("fused") or platform.runs_triton(device)]
    timings = time_methods(runnable, group, fresh, targets, grad_out, repeats=repeats,
                           peak=DevicePeak if platform.has_cuda() else NoPeak, synchronize=synchronize,
                           fp64_rows=CHECKED_ROWS)
    with torch.no_grad():  # the gradient comes back in the logits' dtype: half an ulp of its largest entry
        exact = torch.log_softmax(fresh()[:CHECKED_ROWS].double(), dim=-1)
        grad_scale = float(((torch.nn.functional.one_hot(targets[:CHECKED_ROWS], vocab).double() - exact.exp())
                            * grad_out[:CHECKED_ROWS, None].double()).abs().max())
        del exact
    rows = []
    for name in ["megatron", *METHODS]:
        if name not in timings:
            rows.append({"tokens": tokens, "vocab": vocab, "dtype": dtype, "method": name,
                         "note": "not run: needs CUDA and triton"})
            continue
        t = timings[name]
        rows.append({"tokens": tokens, "vocab": vocab, "dtype": dtype, "method": name,
                     "forward_ms": t.forward_ms, "backward_ms": t.backward_ms,
                     "total_ms": t.forward_ms + t.backward_ms, "peak_extra_mib": t.peak_bytes / MiB,
                     "logp_err_vs_fp64": t.logp_err_vs_fp64, "grad_err_vs_fp64": t.grad_err_vs_fp64,
                     "grad_tol": grad_scale * (2.0**-8 if dtype == "bf16" else 1e-6)})
    base_row = rows[0]
    for row in _measured(rows):
        row["time_vs_megatron"] = row["total_ms"] / base_row["total_ms"]
        row["memory_vs_megatron"] = (row["peak_extra_mib"] / base_row["peak_extra_mib"]
                                     if base_row["peak_extra_mib"] else float("nan"))
        row["note"] = ""
    return rows


def _measured(rows: list[dict]) -> list[dict]:
    return [row for row in rows if "total_ms" in row]


def run(profile: Profile, workdir: Path) -> Outcome:
    from megatron.core import parallel_state

    from bpo_megatron.megatron import ensure_megatron_cpu_compat

    out = Outcome("logprobs_kernel")
    rows: list[dict] = []
    with single_rank_world():
        ensure_megatron_cpu_compat()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        try:
            group = parallel_state.get_tensor_model_parallel_group()
            for tokens in profile.kernel_tokens:
                for dtype in ("bf16", "fp32"):
                    rows += _measure(tokens, profile.kernel_vocab, dtype, profile.kernel_repeats, group)
        finally:
            parallel_state.destroy_model_parallel()
    out.tables["forward + backward, TP=1 (median of repeats; memory: peak allocated on top of the logits)"] = rows
    # Accuracy against fp64 of the same (already rounded) logits: both methods accumulate in fp32.
    for row in _measured(rows):
        if row["method"] == "megatron":
            continue
        ok = row["logp_err_vs_fp64"] <= 1e-3 and row["grad_err_vs_fp64"] <= row["grad_tol"]
        out.require(ok, f"{row['method']} {row['dtype']} T={row['tokens']}: log-prob error {row['logp_err_vs_fp64']:.1e} "
                        f"≤ 1e-3, gradient error {row['grad_err_vs_fp64']:.1e} ≤ {row['grad_tol']:.1e} "
                        f"({'half a bf16 ulp' if row['dtype'] == 'bf16' else '1e-6 relative'} of the largest entry)")
    for row in _measured(rows):
        if row["method"] == "fused-inplace" and row["dtype"] == "bf16":
            out.require(row["time_vs_megatron"] <= FUSED_TIME_VS_MEGATRON
                        and row["memory_vs_megatron"] <= FUSED_MEMORY_VS_MEGATRON,
                        f"fused-inplace bf16 T={row['tokens']}: {row['time_vs_megatron']:.2f}x Megatron's time "
                        f"≤ {FUSED_TIME_VS_MEGATRON}x, {row['memory_vs_megatron']:.2f}x its memory "
                        f"≤ {FUSED_MEMORY_VS_MEGATRON}x")
    for row in _measured(rows):
        if row["method"] != "megatron":
            out.numbers[f"{row['method']} {row['dtype']} T={row['tokens']} time/memory vs Megatron"] = (
                f"{row['time_vs_megatron']:.2f}x / {row['memory_vs_megatron']:.2f}x")
    if profile.device != "cuda":
        out.notes.append("CPU mode: memory is not tracked (no device allocator); times are CPU times.")
    if not platform.runs_triton(platform.device()):
        out.notes.append("The fused kernels were not run: they need CUDA and triton (their numerics are "
                         "tested on CPU in triton's interpreter, tests/test_fused_logprobs.py).")
    return out
