"""Where a training step's time goes, read from a torch.profiler Chrome trace (``.json`` or
``.json.gz``, e.g. ``train_fast_paths``' ``traces/train_micro_batch.json.gz``).

Prints the traced span, the GPU's busy time (the union of its kernels) and idle share, the
kernels that take the most GPU time, and per host thread the top-level operators (those no other
operator on the thread encloses; the autograd thread's are backward nodes) that take the most host
time, with their counts: an operator run once per parameter shows up with the parameter count.

Usage: python tools/gpu/trace_summary.py TRACE [--top N]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

from bpo_megatron.gpu_smoke.checks.train_fast_paths import covered_length  # the kit's busy-time rule


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def top_level(ops: list[dict]) -> list[dict]:
    """The operators of one thread that no other operator encloses."""
    out, end = [], float("-inf")
    for op in sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0))):
        if op["ts"] >= end:
            out.append(op)
            end = op["ts"] + op.get("dur", 0)
    return out


def summarise(events: list[dict], top: int) -> str:
    timed = [e for e in events if "ts" in e and e.get("ph") == "X"]
    kernels = [e for e in timed if e.get("cat") == "kernel"]
    ops = [e for e in timed if e.get("cat") == "cpu_op"]
    start = min(e["ts"] for e in timed)
    span = max(e["ts"] + e.get("dur", 0) for e in timed) - start
    busy = covered_length(sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels))
    lines = [f"span {span / 1e3:.1f} ms; GPU busy {busy / 1e3:.1f} ms ({len(kernels)} kernels), "
             f"idle {1 - busy / span:.1%} of the span" if span else "empty trace"]
    by_kernel: collections.Counter = collections.Counter()
    for k in kernels:
        by_kernel[k["name"][:100]] += k["dur"]
    lines.append(f"\nkernels by GPU time (top {top}):")
    lines += [f"  {us / 1e3:8.2f} ms  {name}" for name, us in by_kernel.most_common(top)]
    threads: dict[int, list[dict]] = collections.defaultdict(list)
    for op in ops:
        threads[op["tid"]].append(op)
    for tid, thread_ops in sorted(threads.items(), key=lambda kv: -len(kv[1])):
        outer = top_level(thread_ops)
        time: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        for op in outer:
            time[op["name"][:90]] += op.get("dur", 0)
            count[op["name"][:90]] += 1
        lines.append(f"\nhost thread {tid}: {len(thread_ops)} operators, {len(outer)} top-level, "
                     f"{sum(time.values()) / 1e3:.1f} ms (top {top}: ms, count, operator):")
        lines += [f"  {us / 1e3:8.2f} {count[name]:6d}  {name}" for name, us in time.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    print(summarise(load(args.trace), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
