"""Every config key is documented where users read it: docs/config-reference.md, generated from the
config dataclasses by tools/config_reference.py, lists each key with its type, default and the
docstring or comment that documents it; a key nothing documents, or a page older than the code,
fails here."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("config_reference", ROOT / "tools" / "config_reference.py")
reference = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = reference  # dataclasses look their module up by name
_spec.loader.exec_module(reference)

REGENERATE = f"run `{reference.COMMAND}` and commit docs/config-reference.md"


@pytest.fixture(scope="module")
def sections():
    return reference.sections()


def test_every_config_key_has_documentation(sections):
    missing = reference.undocumented(sections)
    assert not missing, (
        f"{len(missing)} config key(s) documented nowhere: {', '.join(missing)}. Add a comment above the field (or "
        f"at the end of its line), or name it in ``double backquotes`` in its section's docstring; then {REGENERATE}")


def test_the_reference_page_is_current(sections):
    assert reference.PAGE.is_file(), f"docs/config-reference.md is missing: {REGENERATE}"
    page = reference.PAGE.read_text()
    assert page == reference.render(sections), \
        f"docs/config-reference.md is stale (a config field or its documentation changed): {REGENERATE}"


def _flat(tree: dict, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            keys |= _flat(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


def test_the_page_lists_exactly_the_keys_a_resolved_config_holds(sections):
    """Independent of the walk: the keys of a default experiment as the loader writes config.yaml."""
    from bpo_megatron.config import to_dict
    from bpo_megatron.experiment import ExperimentConfig

    written = _flat(to_dict(ExperimentConfig()))
    listed = {key.dotted for section in sections for key in section.keys}
    assert listed == written, (f"only in the page: {sorted(listed - written)}; only in config.yaml: "
                               f"{sorted(written - listed)}")
    page = reference.PAGE.read_text()
    assert all(f"**`{key}`**" in page for key in written)
    assert len(written) >= 150  # every section, not a part of one


@dataclasses.dataclass(frozen=True)
class _Documented:
    """``by_docstring`` is named here, the last field is not."""

    # above: one line
    # and a second
    above: int = 1
    trailing: float = 2.0  # at the end of its line; names trailing_partner too
    trailing_partner: float = 3.0
    # the run's comment names run_b only
    run_a: bool = True
    run_b: bool = False
    run_c: bool = False

    after_a_blank_line: str = "x"
    by_docstring: int = 0
    nowhere: int = 0


def test_comments_document_the_fields_they_sit_on_or_name():
    comments = reference.field_comments(_Documented)
    assert comments == {
        "above": "above: one line and a second",
        "trailing": "at the end of its line; names trailing_partner too",
        "trailing_partner": "at the end of its line; names trailing_partner too",
        "run_a": "the run's comment names run_b only",
        "run_b": "the run's comment names run_b only",
        "run_c": "",  # the run's comment does not name it
        "after_a_blank_line": "",
        "by_docstring": "",
        "nowhere": "",
    }
    assert reference.named_in_docstring(_Documented, "by_docstring")
    assert not reference.named_in_docstring(_Documented, "nowhere")
    assert not reference.named_in_docstring(_Documented, "by")  # a word of a name is not the name


def test_types_and_defaults_read_as_yaml():
    from typing import Literal

    assert reference.type_text(Literal["a", "b"] | None) == '"a" \\| "b" \\| null'
    assert reference.type_text(tuple[int, ...]) == "list of int"
    assert reference.type_text(tuple[float, float]) == "list of 2 (float, float)"
    assert reference.value_text((0.9, 0.98)) == "[0.9, 0.98]"
    assert reference.value_text({"a": None, "b": True}) == "{a: null, b: true}"
    assert reference.prose("``x`` and :class:`~a.b.C` and :mod:`a.b`") == "`x` and `C` and `a.b`"
    assert reference.prose("<run>/x or ``<run>/y``") == "&lt;run>/x or `<run>/y`"


def test_a_key_nothing_documents_is_named():
    fields, comments = {f.name: f for f in dataclasses.fields(_Documented)}, reference.field_comments(_Documented)
    keys = [reference.Key(f"x.{name}", fields[name], int, _Documented, comments[name])
            for name in ("above", "by_docstring", "run_b", "run_c", "nowhere")]
    assert reference.undocumented([reference.Section("x.", _Documented, False, keys)]) == ["x.run_c", "x.nowhere"]

    class Bare:  # a section without a docstring of its own is named too
        pass

    assert reference.undocumented([reference.Section("y.", Bare, False, [])]) == ["y (the section's docstring)"]


def test_the_page_lists_every_cross_section_rule_with_the_keys_it_reads():
    from bpo_megatron.experiment_rules import RULES

    page = reference.PAGE.read_text()
    table = page[page.index("## Cross-section rules"):]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [rule.name for rule in RULES]
    for row, rule in zip(rows, RULES, strict=True):
        assert all(f"`{key}`" in row for key in rule.reads), row


# ------------------------------------------------------------------ an engine is its folder and one line
@dataclasses.dataclass(frozen=True)
class ToyEngineOptions:
    """A toy engine's own section (``rollout.toy``)."""

    slots: int = 4  # rows it decodes at once
    mode: str = "exact"  # how it samples


def _toy_engine():
    from bpo_megatron.rollout.engine import EngineProfile, EngineSpec

    def build(options, context):
        raise AssertionError("the toy engine is configured, never started")

    return EngineSpec(name="toy", options=ToyEngineOptions, build=build,
                      profile=lambda options, requests, gpus: EngineProfile(tp=1, sequences=options.slots),
                      transport=lambda options, colocated, gpus: "object_store", exposes_weights=True)


TOY_ENGINE = _toy_engine()


def test_a_registered_engine_brings_its_config_section_and_its_name(monkeypatch):
    """One registry line makes the engine's name a value of ``rollout.engine`` and its options
    class the ``rollout.<name>`` section: loaded, typed, written back, listed in this page and
    carried to the engine group; nothing else lists the engines."""
    from bpo_megatron.config import ConfigError, to_dict
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.rollout.engine import ENGINES

    demo = ROOT / "configs" / "tiny_moe_cpu.yaml"
    with pytest.raises(ConfigError, match=r"rollout.engine='toy' is unknown; choose one of \['hf', 'sglang', 'vllm'\]"):
        load_experiment(demo, ["rollout.engine=toy"], check_model=False)
    with pytest.raises(ConfigError, match="unknown key rollout.toy; valid keys of rollout: "):
        load_experiment(demo, ["rollout.toy.slots=7"], check_model=False)

    monkeypatch.setitem(ENGINES, "toy", f"{__name__}:TOY_ENGINE")
    cfg = load_experiment(demo, ["rollout.engine=toy", "rollout.toy.slots=7"], check_model=False)
    assert cfg.rollout.spec is TOY_ENGINE and cfg.rollout.options == ToyEngineOptions(slots=7, mode="exact")
    assert to_dict(cfg)["rollout"]["toy"] == {"slots": 7, "mode": "exact"}
    assert cfg.engine_group_spec().rollout.options.slots == 7  # what the engine group starts the engines with
    with pytest.raises(ConfigError, match="unknown key rollout.toy.slotz; valid keys of rollout.toy: mode, slots"):
        load_experiment(demo, ["rollout.engine=toy", "rollout.toy.slotz=7"], check_model=False)
    with pytest.raises(ConfigError, match="rollout.toy.slots='many' must be an integer"):
        load_experiment(demo, ["rollout.toy.slots=many"], check_model=False)
    # under another engine its section is never read, and the preflight says so
    assert load_experiment(demo, ["rollout.toy.slots=7"], check_model=False).rollout.unused_settings() == [("toy", "slots", 7)]
    toy_keys = [key for section in reference.sections() if section.prefix == "rollout.toy." for key in section.keys]
    assert [(k.dotted, k.documentation) for k in toy_keys] == [("rollout.toy.slots", "rows it decodes at once"),
                                                               ("rollout.toy.mode", "how it samples")]
    assert '- **`rollout.engine`** ("hf" \\| "sglang" \\| "vllm" \\| "toy"; default `"hf"`)' in reference.render()
