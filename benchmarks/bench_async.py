"""The CPU demo's RL throughput with rollouts generated ahead of training (k = 1, 2) vs synchronous.

    python benchmarks/bench_async.py                       # k = 0, 1, 2; 10 steps each
    python benchmarks/bench_async.py --steps 20 --staleness 0 1
"""

import sys

from bpo_megatron.bench.asynchronous import main

if __name__ == "__main__":
    sys.exit(main())
