"""Wall time of the CPU demo with evaluation inline against eval.mode=background, same schedule.

    python benchmarks/bench_background_eval.py          # 12 steps, evaluation every 3 (k=16), 3 rounds
    python benchmarks/bench_background_eval.py --steps 8 --every 1 --k 4 --rounds 2
"""

import sys

from bpo_megatron.bench.background_eval import main

if __name__ == "__main__":
    sys.exit(main())
