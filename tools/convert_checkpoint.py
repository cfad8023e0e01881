"""Convert checkpoints between Hugging Face and Megatron-Core (see bpo_megatron.convert.cli).

    python tools/convert_checkpoint.py hf-to-mcore --hf-dir HF --out CKPT [--tp N --ep N --pp N]
    python tools/convert_checkpoint.py mcore-to-hf --ckpt CKPT --out HF [--hf-config HF_OR_CONFIG_JSON]
"""

import sys

from bpo_megatron.convert.cli import main

# The guard matters: the conversion's worker processes re-import this file.
if __name__ == "__main__":
    sys.exit(main())
