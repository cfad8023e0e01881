"""Benchmark: log-probs of sampled tokens from vocabulary-parallel logits, forward + backward.

Compares, in one run and on the same logits, :func:`bpo_megatron.ops.vocab_parallel_logprobs`
(copy-safe and in-place) with Megatron-Core's ``vocab_parallel_cross_entropy`` and with a naive
full-vocabulary ``log_softmax`` + gather (all-gathering the vocabulary when TP > 1). Reports
forward/backward time (median of repeats) and the peak memory allocated on top of the logits.

The ranks are gloo processes with CPU logits, so the op's fused triton kernels (CUDA only) get a
row that says they were not run; the GPU kit's ``logprobs_kernel`` check times them with the same
measurement (:mod:`bpo_megatron.testing.logprob_timing`) on a device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

import torch

from bpo_megatron.bench.memory import PeakMemory, use_exact_allocation_tracking
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.testing.logprob_timing import METHODS, Timing, time_methods

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MiB = 2**20


@dataclass(frozen=True)
class BenchConfig:
    tokens: int = 4096
    vocab: int = 151936  # Qwen3's vocabulary
    tp_sizes: tuple[int, ...] = (1, 2)
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    repeats: int = 3
    temperature: float = 1.0
    methods: tuple[str, ...] = METHODS


FUSED_NOT_RUN = "not run: the fused kernels need CUDA logits and triton"


def _runs(method: str) -> bool:
    return not method.startswith("fused")  # the ranks' logits are CPU tensors


def _bench_rank(cfg: BenchConfig, tp: int, dtype_name: str) -> dict[str, Timing]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from bpo_megatron.megatron.compat import ensure_megatron_cpu_compat

    ensure_megatron_cpu_compat()
    use_exact_allocation_tracking()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        rank = parallel_state.get_tensor_model_parallel_rank()
        shard = cfg.vocab // tp

        def fresh_logits() -> torch.Tensor:
            # regenerated rather than cloned from a kept copy: at 4k x 152k that copy alone
            # would be 2.5 GB per rank
            gen = torch.Generator().manual_seed(1234 + rank)
            return (torch.randn(cfg.tokens, shard, generator=gen) * 4.0).to(DTYPES[dtype_name])

        targets = torch.randint(0, shard * tp, (cfg.tokens,), generator=torch.Generator().manual_seed(7))
        grad_out = torch.randn(cfg.tokens, generator=torch.Generator().manual_seed(8))
        return time_methods([m for m in cfg.methods if _runs(m)], group, fresh_logits, targets, grad_out,
                            repeats=cfg.repeats, temperature=cfg.temperature, peak=PeakMemory,
                            barrier=lambda: dist.barrier(group))
    finally:
        parallel_state.destroy_model_parallel()


@dataclass(frozen=True)
class Row:
    tp: int
    dtype: str
    method: str
    forward_ms: float
    backward_ms: float
    peak_mib: float
    max_abs_diff: float
    note: str = ""  # why a method has no numbers

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.backward_ms


def _merge_ranks(tp: int, dtype: str, per_rank: list[dict[str, Timing]]) -> list[Row]:
    rows = []
    for method in per_rank[0]:
        results = [rank[method] for rank in per_rank]
        # a collective step takes as long as its slowest rank
        fwd = [max(r.forward_s[i] for r in results) for i in range(len(results[0].forward_s))]
        bwd = [max(r.backward_s[i] for r in results) for i in range(len(results[0].backward_s))]
        rows.append(Row(tp=tp, dtype=dtype, method=method, forward_ms=1e3 * statistics.median(fwd),
                        backward_ms=1e3 * statistics.median(bwd),
                        peak_mib=max(r.peak_bytes for r in results) / MiB,
                        max_abs_diff=max(r.diff_vs_megatron for r in results)))
    return rows


def _ratio(ours: float, theirs: float, floor: float) -> str:
    if theirs < floor and ours < floor:
        return "≈1 (both ≈0)"
    if theirs < floor:
        return "∞"
    return f"{ours / theirs:.2f}×"


def format_table(rows: list[Row], cfg: BenchConfig) -> str:
    lines = [
        f"tokens={cfg.tokens} vocab={cfg.vocab} temperature={cfg.temperature} "
        f"repeats={cfg.repeats} (median; per TP rank the vocab shard is vocab/TP)",
        "",
        "| TP | dtype | method | fwd ms | bwd ms | total ms | time vs Megatron | peak extra MiB "
        "| memory vs Megatron | max abs Δ log π vs Megatron |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if row.note:
            lines.append(f"| {row.tp} | {row.dtype} | {row.method} | {row.note} |" + " |" * 6)
            continue
        megatron = next(r for r in rows if (r.tp, r.dtype, r.method) == (row.tp, row.dtype, "megatron"))
        lines.append(
            f"| {row.tp} | {row.dtype} | {row.method} | {row.forward_ms:.0f} | {row.backward_ms:.0f} "
            f"| {row.total_ms:.0f} | {_ratio(row.total_ms, megatron.total_ms, 1e-9)} "
            f"| {row.peak_mib:.1f} | {_ratio(row.peak_mib, megatron.peak_mib, 1.0)} "
            f"| {row.max_abs_diff:.1e} |"
        )
    return "\n".join(lines)


def run(cfg: BenchConfig) -> list[Row]:
    rows: list[Row] = []
    for tp in cfg.tp_sizes:
        for dtype in cfg.dtypes:
            print(f"[bench] TP={tp} {dtype}: {', '.join(cfg.methods)} ...", file=sys.stderr, flush=True)
            per_rank = run_gloo_world(_bench_rank, tp, cfg, tp, dtype, timeout=3600)
            rows.extend(_merge_ranks(tp, dtype, per_rank))
            nan = float("nan")
            rows.extend(Row(tp, dtype, method, nan, nan, nan, nan, note=FUSED_NOT_RUN)
                        for method in cfg.methods if not _runs(method))
    return rows


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = BenchConfig()
    parser.add_argument("--tokens", type=int, default=defaults.tokens)
    parser.add_argument("--vocab", type=int, default=defaults.vocab)
    parser.add_argument("--tp", type=int, nargs="+", default=list(defaults.tp_sizes))
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=list(defaults.dtypes))
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--temperature", type=float, default=defaults.temperature)
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    args = build_parser(parser).parse_args(argv)
    if args.vocab % max(args.tp) != 0:
        raise SystemExit(f"--vocab {args.vocab} must be divisible by every --tp size {args.tp}")
    cfg = BenchConfig(
        tokens=args.tokens,
        vocab=args.vocab,
        tp_sizes=tuple(args.tp),
        dtypes=tuple(args.dtype),
        repeats=args.repeats,
        temperature=args.temperature,
    )
    print(format_table(run(cfg), cfg))
    return 0
