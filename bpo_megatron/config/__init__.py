"""Experiment configs: typed sections owned by each component, YAML files and dotted overrides."""

from bpo_megatron.config.loader import (
    ConfigError,
    apply_overrides,
    build,
    build_sections,
    expand_shorthands,
    load_yaml,
    refuse_moved,
    refuse_removed,
    to_dict,
)

__all__ = ["ConfigError", "apply_overrides", "build", "build_sections", "expand_shorthands", "load_yaml", "refuse_moved",
           "refuse_removed", "to_dict"]
