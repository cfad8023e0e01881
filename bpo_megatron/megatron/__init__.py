"""Megatron-Core integration: everything bpo-megatron needs to drive megatron-core."""

from bpo_megatron.megatron.compat import (
    applied_fixes,
    applied_patches,
    ensure_megatron_cpu_compat,
    ensure_megatron_fixes,
    megatron_version,
    needs_cpu_compat,
)

__all__ = [
    "applied_fixes",
    "applied_patches",
    "ensure_megatron_cpu_compat",
    "ensure_megatron_fixes",
    "megatron_version",
    "needs_cpu_compat",
]
