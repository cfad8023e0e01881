"""ATen ops and host syncs per training micro-batch and optimizer step, before and after each fast
path of the local spec (Megatron's modules, then grouped experts, fused attention, the sorted
dispatch turned on in turn; CPU, the project's train actor).

    python benchmarks/bench_ops.py                  # 2 layers (+1 for the per-layer row)
    python benchmarks/bench_ops.py --tokens 256 --micro-batches 4
"""

import sys

from bpo_megatron.bench.ops import main

if __name__ == "__main__":
    sys.exit(main())
