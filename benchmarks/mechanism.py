"""Tier A, the exact mechanism test: every policy loss on a tabular autoregressive softmax policy,
exact J by enumeration, ≥ 200 seeds at once, six conditions (docs/mechanism.md).

    python benchmarks/mechanism.py --out-dir docs/mechanism      # the full run (8 minutes on 2 shared cores)
    python benchmarks/mechanism.py --out-dir docs/mechanism --summarise-only   # tables + plot from its CSVs
    python benchmarks/mechanism.py --conditions control stale4 --methods bpo grpo --seeds 50
"""

import sys

from bpo_megatron.bench.mechanism import main

if __name__ == "__main__":
    sys.exit(main())
