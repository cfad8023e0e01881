"""The one lazy registry: names import their implementation only when loaded."""

import sys

import pytest

from bpo_megatron.registry import LazyRegistry


def test_a_name_imports_its_module_or_attribute_on_load_only():
    registry = LazyRegistry({"json": "json", "dumps": "json:dumps", "colorsys": "colorsys:rgb_to_hsv"},
                            unknown="x={name!r}: choose {sorted}")
    sys.modules.pop("colorsys", None)
    assert list(registry) == ["json", "dumps", "colorsys"] and "dumps" in registry and len(registry) == 3
    assert "colorsys" not in sys.modules, "listing the names imports nothing"
    import json

    assert registry.load("json") is json and registry.load("dumps") is json.dumps
    assert registry.load("colorsys").__name__ == "rgb_to_hsv" and "colorsys" in sys.modules


def test_an_unknown_name_raises_the_registrys_own_message():
    registry = LazyRegistry({"b": "json", "a": "json"}, unknown="{name!r}: {sorted} | {listed} | {sorted_listed}")
    with pytest.raises(ValueError, match=r"^'c': \['a', 'b'\] \| b, a \| a, b$"):
        registry.load("c")
    registry["c"] = "json:loads"
    assert registry.load("c")("[1]") == [1]
    del registry["c"]
    with pytest.raises(ValueError):
        registry.check("c")


def test_every_registry_of_the_package_is_lazy_and_names_real_code():
    from bpo_megatron.bench import BENCHMARKS
    from bpo_megatron.cli import _MODULES as COMMANDS
    from bpo_megatron.gpu_smoke.checks import CHECKS
    from bpo_megatron.launch import LAUNCHERS
    from bpo_megatron.observability.trackers import TRACKERS
    from bpo_megatron.rollout.agents.config import AGENTS
    from bpo_megatron.rollout.engine import ENGINES
    from bpo_megatron.weight_sync import TRANSPORTS

    for registry in (BENCHMARKS, COMMANDS, CHECKS, LAUNCHERS, TRACKERS, AGENTS, ENGINES, TRANSPORTS):
        assert isinstance(registry, LazyRegistry)
        for target in registry.values():  # each names a module that exists, without importing it
            import importlib.util

            assert importlib.util.find_spec(target.partition(":")[0]) is not None, target


def test_each_engines_declared_transports_name_real_classes():
    import importlib

    from bpo_megatron.rollout.engine import ENGINES

    for name in ENGINES:
        for transport, target in ENGINES.load(name).transports.items():
            module, _, cls = target.partition(":")
            assert module.startswith(f"bpo_megatron.rollout.{name}.") and hasattr(importlib.import_module(module), cls)
