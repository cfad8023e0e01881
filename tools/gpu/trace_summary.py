"""Where a training step's time goes, read from a torch.profiler Chrome trace (``.json`` or
``.json.gz``, e.g. ``train_fast_paths``' ``traces/*.json.gz`` or a committed one under
``tools/gpu/records/``), on any machine (no GPU needed).

Prints the traced span and the GPU's busy time (the union of its kernels), the phase table
(before the first kernel, each forward and backward, gradients finished and clipped, the
optimizer step, what follows; each with its wall time, host operators, kernels, GPU busy time and
idle share, host syncs), where the host syncs fall (by phase and the operator that asked), the
kernels that take the most GPU time, and per host thread the top-level operators that take the most
host time with their counts: an operator run once per parameter shows up with the parameter count.
How the phases are read from the trace: ``bpo_megatron/gpu_smoke/trace.py``.

Usage: python tools/gpu/trace_summary.py TRACE [--top N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bpo_megatron.gpu_smoke.trace import load, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    print(summary(load(args.trace), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
