"""Your cluster's launch script: edit CLUSTER and EXPERIMENTS below once, then, from the checkout,

    python launchers/cluster.py                 # render every job and print it (a dry run)
    python launchers/cluster.py --submit        # submit them through NeMo-Run

It does what `bpo-megatron launch BACKEND CONFIG overrides... --account ... --container-image ...`
does, with the cluster's settings kept in this file instead of on the command line. BACKEND
"slurm" starts a Ray cluster on the allocation (the batch script: the package's
bpo_megatron/launch/templates/ray_on_slurm.sub.j2) and runs the driver on its head node;
"kuberay" submits a RayJob; "local" runs on this machine with an embedded Ray. Every run is checked
against its config before anything is submitted (a bad setting exits 2, naming it).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from bpo_megatron.launch import ExecutorSettings, launch

BACKEND = "slurm"  # "slurm" | "kuberay" | "local"

CLUSTER = ExecutorSettings(
    account="ACCOUNT",
    partition="batch",
    time="48:00:00",
    container_image="registry.example.com/bpo-megatron:latest",  # an image with this package installed
    mounts=("/lustre/models:/models", "/lustre/data:/data"),
    env={"NCCL_DEBUG": "WARN"},
    # submitting from a laptop: the login node and a job directory on the cluster
    ssh_host=None,
    ssh_user=None,
    remote_dir=None,
    # nodes=None, gpus_per_node=None: each recipe's cluster section says
)

# What to run: (config, overrides). A comma-separated value is a grid: one job per point, one
# NeMo-Run experiment per entry.
CHECKPOINTS = ["model.path=/models/Qwen3-30B-A3B-Base", "data.train=/data/dapo_math_17k.jsonl"]
EXPERIMENTS = [
    ("configs/qwen3_30b_a3b_bpo.yaml", CHECKPOINTS),
    ("configs/qwen3_30b_a3b_bpo.yaml", [*CHECKPOINTS, "loss.name=grpo,cispo"]),
]

ROOT = Path(__file__).resolve().parents[1]  # the configs' paths are the checkout's


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--submit", action="store_true", help="submit the jobs (default: render and print them)")
    parser.add_argument("--home", help="NeMo-Run's experiment directory (default: NeMo-Run's home)")
    args = parser.parse_args(argv)
    settings = CLUSTER if args.home is None else dataclasses.replace(CLUSTER, home=args.home)
    for config, overrides in EXPERIMENTS:
        result = launch(BACKEND, str(ROOT / config), overrides, settings, dryrun=not args.submit)
        if args.submit:
            if result:
                return int(result)
            continue
        for job in result:
            print(f"# ---- {job.name} ({job.kind}) ----\n{job.text.rstrip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
