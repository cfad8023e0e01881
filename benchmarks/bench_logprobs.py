"""Vocab-parallel log-probs: ours vs Megatron-Core vs naive log_softmax (time and peak memory).

    python benchmarks/bench_logprobs.py                 # 4096 tokens x 151936 vocab, TP 1 and 2
    python benchmarks/bench_logprobs.py --tokens 512 --tp 1 --dtype fp32
"""

import sys

from bpo_megatron.bench.logprobs import main

if __name__ == "__main__":
    sys.exit(main())
