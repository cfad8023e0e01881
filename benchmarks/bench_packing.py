"""Padded against packed micro-batches on RL's long-tailed lengths (DP=2 in one EP=2 group, CPU).

    python benchmarks/bench_packing.py                  # 32 samples, the paper's mix / 32
    python benchmarks/bench_packing.py --samples 64 --scale 0.0625
"""

import sys

from bpo_megatron.bench.packing import main

if __name__ == "__main__":
    sys.exit(main())
