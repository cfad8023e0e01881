"""Wall time of the CPU demo with evaluation inline against eval.mode=background, same schedule.

    python benchmarks/bench_background_eval.py          # 48 steps, evaluation every 8 (k=64), 1 trainer rank, 2 rounds
    python benchmarks/bench_background_eval.py --trainer-ranks 2 --steps 24 --every 4 --k 16 --rounds 3
"""

import sys

from bpo_megatron.bench.background_eval import main

if __name__ == "__main__":
    sys.exit(main())
