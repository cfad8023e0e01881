"""The log-prob benchmark runs end to end at a tiny size and its numbers are sane."""

import torch

from bpo_megatron.bench.logprobs import BenchConfig, format_table, run
from bpo_megatron.bench.memory import PeakMemory, use_exact_allocation_tracking


def test_peak_memory_sees_a_known_allocation():
    use_exact_allocation_tracking()
    size = 64 * 2**20
    with PeakMemory() as peak:
        buffer = torch.ones(size // 4)  # touched, so every page is resident
        del buffer
    # RSS is read at page granularity and unrelated allocations or frees inside the region (the
    # interpreter, the allocator's own bookkeeping) move it by a few MiB at most
    assert size - 4 * 2**20 <= peak.extra_bytes < size + 8 * 2**20


def test_benchmark_runs_and_methods_agree():
    cfg = BenchConfig(tokens=256, vocab=4096, tp_sizes=(1, 2), dtypes=("fp32",), repeats=1)
    rows = run(cfg)
    assert {(r.tp, r.method) for r in rows} == {(tp, m) for tp in (1, 2) for m in cfg.methods}
    # CPU logits: the fused kernels (CUDA only) are listed as not run rather than left out
    assert {r.method for r in rows if r.note} == {"fused", "fused-inplace"}
    for row in (r for r in rows if not r.note):
        assert row.max_abs_diff < 1e-5, row  # every method computes the same log-probs
        assert row.forward_ms > 0 and row.backward_ms > 0
        # memory is reported, not judged here: the benchmark compares it side by side at real sizes
        assert 0 <= row.peak_mib < 1024
    table = format_table(rows, cfg)
    assert "| 2 | fp32 | ours-inplace |" in table
    assert "| 2 | fp32 | fused-inplace | not run: the fused kernels need CUDA logits and triton |" in table


def test_the_benchmark_and_the_gpu_kit_time_the_log_prob_op_one_way():
    """One measurement of the log-prob op: the benchmark's ratio table and the kit's thresholds
    both come from bpo_megatron.testing.logprob_timing."""
    from bpo_megatron.bench import logprobs as bench
    from bpo_megatron.gpu_smoke.checks import logprobs_kernel as kit
    from bpo_megatron.testing import logprob_timing

    assert bench.time_methods is kit.time_methods is logprob_timing.time_methods
    assert not hasattr(bench, "_method_fns") and not hasattr(kit, "_methods")
