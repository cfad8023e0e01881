"""Submit a grid of runs as one NeMo-Run experiment: comma-separated override values are the grid.

    python launchers/sweep.py slurm configs/qwen3_30b_a3b_bpo.yaml loss.name=bpo,grpo,gspo,cispo,dppo_tv ...
    python launchers/sweep.py slurm configs/qwen3_4b_ablation.yaml loss.bpo_eps=0.05,0.1,0.2,0.3 ...

Every launcher sweeps this way (`bpo-megatron launch BACKEND CONFIG key=a,b ...`); this entry point
only spells it out. Each point runs as `name=<base>-<key>-<value>` in its own run directory.
"""

import sys

from bpo_megatron.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
