"""How full an SGLang server's KV pool stays under the chunked client and the one-request-per-sample
client, side by side (against the SGLang stand-in; needs bash tools/setup.sh --sglang).

    python benchmarks/bench_sglang_concurrency.py
    python benchmarks/bench_sglang_concurrency.py --kv-tokens 32768 --max-new-tokens 512
"""

import sys

from bpo_megatron.bench.sglang_concurrency import main

if __name__ == "__main__":
    sys.exit(main())
