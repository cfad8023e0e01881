"""Imported first by the gloo-world fork server: megatron-core warns at import time that apex and
transformer-engine are absent, which is expected on CPU and would repeat for every test world."""

import warnings

warnings.filterwarnings("ignore", module=r"megatron\.")
