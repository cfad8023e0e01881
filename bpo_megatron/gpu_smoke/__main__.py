import sys

from bpo_megatron.gpu_smoke.cli import main

sys.exit(main())
