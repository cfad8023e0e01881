"""``vocab_parallel_logprobs`` against Megatron-Core's ``vocab_parallel_cross_entropy`` on the
device: forward + backward time and peak memory on top of the logits, side by side in one run,
and all against an fp64 log-softmax of the same logits. Our op runs both ways: the chunked PyTorch
passes ("ours") and the fused triton kernels ("fused"), each copy-safe and in place (the trainer's
mode). Where the fused kernels cannot run (a CPU) their rows say so instead of timing anything."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from bpo_megatron import platform
from bpo_megatron.gpu_smoke.common import single_rank_world, synchronize
from bpo_megatron.gpu_smoke.profiles import Profile
from bpo_megatron.gpu_smoke.report import Outcome

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CHECKED_ROWS = 256  # rows compared with the fp64 reference (all of them would double the memory)
MiB = 2**20


# the trainer's mode with the fused kernels, against Megatron at bf16 (issue #26): no slower, and
# a tenth of the memory at most (the gradient lands in the logits buffer; Megatron keeps a softmax)
FUSED_TIME_VS_MEGATRON = 1.0
FUSED_MEMORY_VS_MEGATRON = 0.1


def _methods(group):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from bpo_megatron.ops import vocab_parallel_logprobs

    def ours(kernel, inplace):
        return lambda logits, targets: vocab_parallel_logprobs(logits, targets, group, inplace=inplace,
                                                               kernel=kernel)

    return {
        "megatron": lambda logits, targets: -vocab_parallel_cross_entropy(logits, targets),
        "ours": ours("chunked", False),
        "ours-inplace": ours("chunked", True),
        "fused": ours("fused", False),
        "fused-inplace": ours("fused", True),
    }


def _peak_tracking() -> tuple:
    if platform.has_cuda():
        return torch.cuda.reset_peak_memory_stats, torch.cuda.memory_allocated, torch.cuda.max_memory_allocated
    return (lambda: None), (lambda: 0), (lambda: 0)


def _measure(tokens: int, vocab: int, dtype: str, repeats: int, group) -> list[dict]:
    device = platform.device()
    gen = torch.Generator(device=device).manual_seed(tokens)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    grad_out = torch.randn(tokens, device=device, generator=gen)

    def fresh() -> torch.Tensor:  # in-place methods consume their input: a new one every run
        return (torch.randn(tokens, vocab, device=device, generator=torch.Generator(device=device).manual_seed(1))
                * 4.0).to(DTYPES[dtype])

    with torch.no_grad():
        exact = torch.log_softmax(fresh()[:CHECKED_ROWS].double(), dim=-1)
    exact_lp = exact.gather(-1, targets[:CHECKED_ROWS, None]).squeeze(-1)
    exact_grad = (torch.nn.functional.one_hot(targets[:CHECKED_ROWS], vocab).double() - exact.exp()) \
        * grad_out[:CHECKED_ROWS, None].double()
    grad_scale = float(exact_grad.abs().max())
    del exact
    reset, allocated, peak = _peak_tracking()
    rows = []
    for name, fn in _methods(group).items():
        if name.startswith("fused") and not platform.runs_triton(device):
            rows.append({"tokens": tokens, "vocab": vocab, "dtype": dtype, "method": name,
                         "note": "not run: needs CUDA and triton"})
            continue
        forward, backward, peaks = [], [], []
        lp_err = grad_err = 0.0
        for repeat in range(repeats + 1):  # the first run warms up and is checked for accuracy
            logits = fresh().requires_grad_()
            synchronize()
            reset()
            base = allocated()
            start = time.perf_counter()
            logp = fn(logits, targets)
            synchronize()
            mid = time.perf_counter()
            (grad,) = torch.autograd.grad(logp, logits, grad_out)
            synchronize()
            end = time.perf_counter()
            if repeat == 0:
                lp_err = float((logp.detach()[:CHECKED_ROWS].double() - exact_lp).abs().max())
                grad_err = float((grad.detach()[:CHECKED_ROWS].double() - exact_grad).abs().max())
            else:
                forward.append(mid - start)
                backward.append(end - mid)
                peaks.append(peak() - base)
            del logp, grad, logits
        fwd, bwd = statistics.median(forward), statistics.median(backward)
        rows.append({"tokens": tokens, "vocab": vocab, "dtype": dtype, "method": name,
                     "forward_ms": 1e3 * fwd, "backward_ms": 1e3 * bwd, "total_ms": 1e3 * (fwd + bwd),
                     "peak_extra_mib": max(peaks) / MiB, "logp_err_vs_fp64": lp_err,
                     "grad_err_vs_fp64": grad_err,
                     # the gradient comes back in the logits' dtype: half an ulp of the largest entry
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
