"""Submit an experiment (or a sweep) to Kubernetes as KubeRay RayJobs.

    python launchers/kuberay.py configs/qwen3_30b_a3b_bpo.yaml --container-image IMAGE --mounts models-pvc:/models --dryrun

The same as `bpo-megatron launch kuberay ...` (options: `--help`); the implementation lives in
`bpo_megatron.launch`, inside the installed package, so the CLI finds it from anywhere.
"""

import sys

from bpo_megatron.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(["kuberay", *sys.argv[1:]]))
