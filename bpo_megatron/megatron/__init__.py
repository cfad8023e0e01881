"""Megatron-Core integration: everything bpo-megatron needs to drive megatron-core."""

from bpo_megatron.megatron.compat import (
    applied_patches,
    ensure_megatron_cpu_compat,
    megatron_version,
    needs_cpu_compat,
)

__all__ = [
    "applied_patches",
    "ensure_megatron_cpu_compat",
    "megatron_version",
    "needs_cpu_compat",
]
