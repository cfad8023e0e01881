"""The one grid grammar of overrides, shared by ``bpo-megatron launch`` and ``compare --sweep``.

``key=a,b,c`` is an axis of three values; ``loss.name=bpo,grpo`` × ``loss.bpo_eps=0.05,0.1`` is a
grid of four points (row-major). A value with commas is one value when it is YAML flow syntax
(starts with ``[``, ``{`` or a quote), so ``eval.datasets=[aime24,aime25]`` stays one value. A
point is labelled ``<label>-<value>-...`` with each key's last component (its section for
``*.name``: ``loss-grpo`` reads better than ``name-grpo``), or the whole dotted key where two
axes would share a label, so names made from points never collide.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import NamedTuple

_FLOW_START = ("[", "{", '"', "'")


class Axis(NamedTuple):
    key: str
    values: list[str]


@dataclass(frozen=True)
class GridPoint:
    overrides: tuple[str, ...]  # ``key=value`` for each axis
    label: str  # ``<label>-<value>`` for each axis, safe in a file name


def grid_values(value: str) -> list[str] | None:
    """The values a comma-separated override value sweeps, or None for one value (no comma, or
    YAML flow syntax)."""
    if "," not in value or value.lstrip().startswith(_FLOW_START):
        return None
    values = [v.strip() for v in value.split(",")]
    if not all(values):
        raise ValueError(f"{value!r}: empty grid value (write key=a,b,c)")
    return values


def parse_axis(text: str) -> Axis:
    """``key=a,b,...`` (one value is an axis of one) as an :class:`Axis`."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise ValueError(f"{text!r} must look like section.key=v1,v2,...")
    return Axis(key.strip(), grid_values(value) or [value.strip()])


def split_grid(overrides: list[str]) -> tuple[list[str], list[Axis]]:
    """``(fixed overrides, axes)``: the overrides whose values sweep are the axes."""
    fixed, axes = [], []
    for override in overrides:
        key, sep, value = override.partition("=")
        values = grid_values(value) if sep else None
        if values is None:
            fixed.append(override)
        else:
            axes.append(Axis(key.strip(), values))
    if any(axis.key == "name" for axis in axes):
        raise ValueError("name cannot be swept: each grid point is named after its values")
    return fixed, axes


def points(axes: list[Axis]) -> list[GridPoint]:
    """Every point of the grid, row-major, with its overrides and its label."""
    labels = _labels([axis.key for axis in axes])
    return [GridPoint(overrides=tuple(f"{axis.key}={value}" for axis, value in zip(axes, point)),
                      label=safe_name("-".join(f"{label}-{value}" for label, value in zip(labels, point))))
            for point in itertools.product(*(axis.values for axis in axes))]


def safe_name(text: str) -> str:
    """``text`` with anything but letters, digits, ``.``, ``_`` and ``-`` replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def _label(key: str) -> str:
    parts = key.split(".")
    return parts[-2] if parts[-1] == "name" and len(parts) > 1 else parts[-1]


def _labels(keys: list[str]) -> list[str]:
    short = [_label(key) for key in keys]
    return [label if short.count(label) == 1 else key for label, key in zip(short, keys)]
