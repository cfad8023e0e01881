"""Where an RL step of the CPU demo goes: rollout, training, weight sync and the driver's own work.

    python benchmarks/bench_step.py                 # 12 steps of configs/tiny_moe_cpu.yaml
    python benchmarks/bench_step.py --steps 20 rollout.group_size=16
"""

import sys

from bpo_megatron.bench.step import main

if __name__ == "__main__":
    sys.exit(main())
