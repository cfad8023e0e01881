"""Implementations of the ``bpo-megatron`` sub-commands (imported only when used)."""
