"""Named implementations imported on first use: the one lazy registry behind the rollout engines,
weight transports, experiment trackers, agents, launchers, GPU checks and benchmarks.

Each entry maps a name to ``"module:attribute"`` (or ``"module"``: the module itself), so naming
an implementation never imports its heavy dependencies (SGLang, NeMo-Run, Megatron-Core) until a
run uses it. An unknown name raises ``ValueError`` with the registry's own message, which names
the setting and the choices.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from typing import Any


class LazyRegistry(MutableMapping[str, str]):
    """``entries`` in their order (help texts list them so). ``unknown`` is the message for a name
    that is not one of them, formatted with ``name`` and the choices as ``sorted`` (a sorted
    list), ``listed`` (comma-separated, in order) or ``sorted_listed`` (comma-separated, sorted).
    More can be registered (``REGISTRY[name] = "module:attribute"``), e.g. by a plugin or a test."""

    def __init__(self, entries: dict[str, str], *, unknown: str) -> None:
        self._entries = dict(entries)
        self._unknown = unknown

    def __getitem__(self, name: str) -> str:
        return self._entries[name]

    def __setitem__(self, name: str, target: str) -> None:
        self._entries[name] = target

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def check(self, name: str) -> None:
        """ValueError (the registry's message) unless ``name`` is registered."""
        if name not in self._entries:
            raise ValueError(self._unknown.format(name=name, sorted=sorted(self._entries),
                                                  listed=", ".join(self._entries),
                                                  sorted_listed=", ".join(sorted(self._entries))))

    def load(self, name: str) -> Any:
        """What ``name`` registers, imported now."""
        self.check(name)
        module, _, attribute = self._entries[name].partition(":")
        loaded = importlib.import_module(module)
        return getattr(loaded, attribute) if attribute else loaded
