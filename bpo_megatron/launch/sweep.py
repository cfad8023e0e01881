"""Grids of overrides: ``loss.name=bpo,grpo`` × ``loss.bpo_eps=0.05,0.1`` → one run per point
(the grammar: :mod:`bpo_megatron.config.grid`). Every point gets its own
``name=<base>-<label>-<value>...``, so run directories never collide.
"""

from __future__ import annotations

from bpo_megatron.config.grid import points, safe_name, split_grid
from bpo_megatron.launch.runs import Batch, Run, experiment_name


def expand(config: str, overrides: list[str]) -> Batch:
    """One run without grid values, else one per point of the grid (in row-major order)."""
    fixed, axes = split_grid(overrides)
    base = experiment_name(config, fixed)
    if not axes:
        return Batch(title=base, runs=(Run(name=base, config=config, overrides=tuple(fixed)),))
    runs = []
    for point in points(axes):
        name = safe_name(f"{base}-{point.label}")
        runs.append(Run(name=name, config=config, overrides=(*fixed, *point.overrides, f"name={name}")))
    return Batch(title=base, runs=tuple(runs))
