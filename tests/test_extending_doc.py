"""docs/extending.md stays true: every registry it names exists and has entries, every registry of the
package has a section there, and every file and folder it names is in the repository (its links are
checked with the other documents' in tests/test_project.py)."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from bpo_megatron.registry import LazyRegistry

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "extending.md"
TEXT = PAGE.read_text()

# "**Registry:** `bpo_megatron.models.families:FAMILIES`": the one form a section names its registry in
NAMED_REGISTRIES = re.findall(r"^\*\*Registry:\*\* `([\w.]+):(\w+)`", TEXT, re.M)
# a path in backquotes: relative to the repository's root, no placeholder (<name>) or pattern in it
PATHS = sorted({p for p in re.findall(r"`([\w.\-/]+)`", TEXT) if "/" in p and not p.startswith("/")})


def test_the_page_names_the_registries_and_files_it_is_checked_for():
    assert len(NAMED_REGISTRIES) >= 15 and len(PATHS) >= 80, (len(NAMED_REGISTRIES), len(PATHS))


@pytest.mark.parametrize("module, name", NAMED_REGISTRIES, ids=[f"{m}:{n}" for m, n in NAMED_REGISTRIES])
def test_each_named_registry_exists_and_has_entries(module, name):
    registry = getattr(importlib.import_module(module), name)
    assert isinstance(registry, (LazyRegistry, dict)), f"{module}:{name} is a {type(registry).__name__}"
    assert len(registry) > 0 and all(isinstance(key, str) and key for key in registry), f"{module}:{name}"
    if isinstance(registry, LazyRegistry):  # every entry names a module that exists (imported by no one here)
        for target in registry.values():
            assert importlib.util.find_spec(target.partition(":")[0]) is not None, f"{module}:{name} -> {target}"


def _package_registries() -> set[tuple[str, str]]:
    """Every registry defined in the package: a ``LazyRegistry(...)``, or a module-level dictionary
    that starts empty and a decorator fills (``CORRECTIONS: dict[str, Correction] = {}``)."""
    found = set()
    for path in (ROOT / "bpo_megatron").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        source = path.read_text()
        for name in re.findall(r"^(\w+)(?:: [^=\n]+)? = LazyRegistry\(", source, re.M):
            found.add((module, name))
        for name in re.findall(r"^([A-Z][A-Z_]*): dict\[str, [^\n]+\] = \{\}$", source, re.M):
            if re.search(rf"^\s+{name}\[\w+\] = ", source, re.M):  # filled by a register function
                found.add((module, name))
    return found


def test_every_registry_of_the_package_has_a_section():
    registries = _package_registries()
    assert len(registries) >= 12, registries
    named_modules = {module for module, _ in NAMED_REGISTRIES}
    # a lazy registry built from a table beside it (the CLI's) is named by that table
    missing = sorted(f"{m}:{n}" for m, n in registries if (m, n) not in NAMED_REGISTRIES and m not in named_modules)
    assert not missing, f"registries docs/extending.md has no section for: {missing} (add one: files, line, tests)"


def test_each_section_names_its_registry_line_and_its_contract_tests():
    sections = [part for part in re.split(r"^## ", TEXT, flags=re.M)[1:] if "**Registry:**" in part]
    assert len(sections) >= 11
    for section in sections:
        title = section.splitlines()[0]
        assert "**Contract tests.**" in section or "`tests/test_" in section, f"{title}: no contract tests named"
        assert re.search(r"`tests/test_\w+\.py`", section), f"{title}: no test module named"
        assert "```python" in section or "one line" in section, f"{title}: no registry line"


@pytest.mark.parametrize("path", PATHS)
def test_each_named_file_is_in_the_repository(path):
    target = ROOT / path
    assert (target.is_dir() if path.endswith("/") else target.exists()), f"docs/extending.md names {path}"


def test_the_guide_leads_to_the_page_where_it_speaks_of_adding_things():
    """(The README's docs map links it, and every link of the page resolves: tests/test_project.py.)"""
    guide = (ROOT / "docs" / "guide.md").read_text()
    assert "(extending.md)" in guide and "(extending.md#model-families)" in guide
    assert "(extending.md#policy-losses-aggregations-and-mismatch-corrections)" in guide
