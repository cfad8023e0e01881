"""Wall time of the CPU demo with evaluation inline against eval.mode=background, same schedule.

    python benchmarks/bench_background_eval.py                    # 8 steps, evaluation every step, 2 rounds
    python benchmarks/bench_background_eval.py --steps 12 --every 2 --rounds 3
"""

import sys

from bpo_megatron.bench.background_eval import main

if __name__ == "__main__":
    sys.exit(main())
