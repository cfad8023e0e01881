"""Run an experiment (or a sweep) on this machine with an embedded Ray, through NeMo-Run's local executor.

    python launchers/local.py configs/tiny_moe_cpu.yaml train.steps=20

The same as `bpo-megatron launch local ...` (options: `--help`); the implementation lives in
`bpo_megatron.launch`, inside the installed package, so the CLI finds it from anywhere.
"""

import sys

from bpo_megatron.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(["local", *sys.argv[1:]]))
