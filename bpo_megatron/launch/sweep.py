"""Grids of overrides: ``loss.name=bpo,grpo`` × ``loss.bpo_eps=0.05,0.1`` → one run per point.

A value with commas is a list of grid values unless it is YAML flow syntax (starts with ``[``,
``{`` or a quote), so ``eval.datasets=[aime24,aime25]`` stays one value. Every point gets its
own ``name=<base>-<key>-<value>...`` (the key's last component — its section for ``*.name`` —
or the full dotted key if two grid keys would share a label), so run directories never collide.
"""

from __future__ import annotations

import itertools
import re

from bpo_megatron.launch.runs import Batch, Run, experiment_name

_FLOW_START = ("[", "{", '"', "'")


def split_grid(overrides: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """``(fixed overrides, [(key, values), ...])``."""
    fixed, axes = [], []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and "," in value and not value.lstrip().startswith(_FLOW_START):
            values = [v.strip() for v in value.split(",")]
            if not all(values):
                raise ValueError(f"override {override!r}: empty grid value")
            axes.append((key.strip(), values))
        else:
            fixed.append(override)
    if any(key == "name" for key, _ in axes):
        raise ValueError("name cannot be swept: each grid point is named after its values")
    return fixed, axes


def _label(key: str) -> str:
    parts = key.split(".")
    # "loss.name=grpo" reads better as "-loss-grpo" than as "-name-grpo"
    return parts[-2] if parts[-1] == "name" and len(parts) > 1 else parts[-1]


def _labels(keys: list[str]) -> list[str]:
    short = [_label(key) for key in keys]
    return [label if short.count(label) == 1 else key for label, key in zip(short, keys)]


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def expand(config: str, overrides: list[str]) -> Batch:
    """One run without grid values, else one per point of the grid (in row-major order)."""
    fixed, axes = split_grid(overrides)
    base = experiment_name(config, fixed)
    if not axes:
        return Batch(title=base, runs=(Run(name=base, config=config, overrides=tuple(fixed)),))
    keys = [key for key, _ in axes]
    labels = _labels(keys)
    runs = []
    for point in itertools.product(*(values for _, values in axes)):
        name = _safe(base + "".join(f"-{label}-{value}" for label, value in zip(labels, point)))
        chosen = [f"{key}={value}" for key, value in zip(keys, point)]
        runs.append(Run(name=name, config=config, overrides=(*fixed, *chosen, f"name={name}")))
    return Batch(title=base, runs=tuple(runs))
