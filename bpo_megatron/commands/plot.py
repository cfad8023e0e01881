"""``bpo-megatron plot RUN_DIR... [--out curves.png]``: reward and eval curves of runs, overlaid."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bpo-megatron plot", description=__doc__)
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--out", default=None, help="PNG path (default: <first run>/curves.png)")
    parser.add_argument("--labels", nargs="*", default=None)
    parser.add_argument("--smoothing", type=int, default=5)
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.run_dirs):
        parser.error("--labels needs one label per run directory")
    from pathlib import Path

    from bpo_megatron.observability.plot import plot_runs

    out = args.out or str(Path(args.run_dirs[0]) / "curves.png")
    try:
        path = plot_runs(args.run_dirs, out, labels=args.labels, smoothing=args.smoothing)
    except FileNotFoundError as exc:
        print(f"bpo-megatron plot: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
