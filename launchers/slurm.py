"""Submit an experiment (or a sweep) to Slurm: a Ray cluster on the allocation, then the driver.

    python launchers/slurm.py configs/qwen3_30b_a3b_bpo.yaml model.path=/models/Qwen3-30B-A3B-Base \\
        --account ACCOUNT --partition PARTITION --container-image IMAGE --mounts /lustre/models:/models --dryrun

The same as `bpo-megatron launch slurm ...` (options: `--help`); the implementation lives in
`bpo_megatron.launch`, inside the installed package, so the CLI finds it from anywhere.
"""

import sys

from bpo_megatron.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(["slurm", *sys.argv[1:]]))
