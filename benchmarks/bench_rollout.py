"""Embedded rollout engine vs transformers.generate (tokens/s), weight sync vs an in-process copy.

    python benchmarks/bench_rollout.py                       # 16 prompts x 32 tokens; 233 MiB sync
    python benchmarks/bench_rollout.py --repeats 2 --sync-model tiny
"""

import sys

from bpo_megatron.bench.rollout import main

if __name__ == "__main__":
    sys.exit(main())
