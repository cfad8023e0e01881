"""Typed configs from YAML and ``dotted.key=value`` overrides, with errors that name the key.

Any frozen dataclass tree works: nested dataclasses become YAML mappings, ``Literal`` fields
accept only their choices, tuples accept lists, ``X | None`` accepts null. An unknown key is
refused with the list of valid ones; a value of the wrong type names its full dotted key. A field
whose value another section decides (``field(metadata={"derived": "rollout.temperature"})``) is
no key; a section composed of another whose keys it shows as its own
(``field(metadata={"inline": True})``: ``model.routing_replay`` builds ``model.options``) reads
and writes them at its level; a field holding one section per entry of a registry
(``field(metadata={"sections": engine_options})``, a function returning key -> dataclass:
``rollout.sglang`` builds ``rollout.engine_sections["sglang"]``) reads and writes each at its level under
the entry's name, so a new entry brings its section with it; a section class with ``SHORTHAND = "name"``
also accepts a plain value as that one key (``loss.correction: tis``); a key that moved is refused naming
its new home (:func:`refuse_moved`), one that was removed naming what replaces it
(:func:`refuse_removed`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the dotted key and the fix."""


def _parse(text: str, where: str) -> Any:
    """YAML, or a ConfigError naming ``where`` (and the line:column of a file) and the problem."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None and not where.startswith("override") else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        context = getattr(exc, "context", None)
        raise ConfigError(f"{where}{at}: not valid YAML: {problem}" + (f" ({context})" if context else "")) from None


EXTENDS = "extends"


def load_yaml(path: str | Path, *, relative_paths: tuple[str, ...] = (), _chain: tuple[Path, ...] = ()
              ) -> dict[str, Any]:
    """A YAML mapping of sections. ``extends: other.yaml`` (relative to this file) starts from that
    file's mapping, then this file's keys win: mappings merge key by key, anything else (values,
    lists, null) replaces. ``relative_paths``: dotted keys whose values, when they name an existing
    path relative to the file that sets them, become paths that work from anywhere."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist" + (f" (extended by {_chain[-1]})" if _chain else ""))
    if path.resolve() in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path.resolve()))
        raise ConfigError(f"{path}: '{EXTENDS}' makes a cycle: {cycle}")
    data = _parse(path.read_text(), str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    _resolve_relative(data, path.parent, relative_paths)
    parent = data.pop(EXTENDS, None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"{path}: '{EXTENDS}' must name one YAML file, got {parent!r}")
    base = load_yaml(path.parent / parent, relative_paths=relative_paths, _chain=(*_chain, path.resolve()))
    return _merged(base, data)


def _merged(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in child.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _resolve_relative(data: dict[str, Any], base: Path, keys: tuple[str, ...]) -> None:
    for key in keys:
        *sections, name = key.split(".")
        node: Any = data
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        value = node.get(name)
        if isinstance(value, str) and value and not Path(value).is_absolute() and (base / value).exists():
            node[name] = str(base / value)


def apply_overrides(data: dict[str, Any], overrides: list[str], cls: type | None = None) -> dict[str, Any]:
    """``["loss.name=grpo", "parallel.tp=2"]`` applied to a nested dict (values parsed as YAML).
    With ``cls`` (the config class the dict is for) a section written in its shorthand, in the dict
    or by an earlier override, takes keys of its mapping form (:func:`expand_shorthands`)."""
    for override in overrides:
        if cls is not None:
            data = expand_shorthands(cls, data)
        key, sep, raw = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {override!r} is not of the form section.key=value")
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {override!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = _parse(raw, f"override {override!r}") if raw.strip() else ""
    return data


def config_key(field: dataclasses.Field) -> str:
    """A field's key in YAML: its name, or ``metadata["key"]`` for a key Python cannot spell as
    a name (``train.async``: ``field(metadata={"key": "async"})``)."""
    return field.metadata.get("key", field.name)


def expand_shorthands(cls: type, data: Any) -> Any:
    """``data`` with every section of ``cls``'s tree written in its shorthand (``loss.correction:
    tis``) expanded to its mapping (``{name: tis}``), so an override may set a key inside it
    (``loss.correction.tis_cap=3``). Anything that is not a mapping where a section is expected
    is left for :func:`build` to refuse."""
    if not dataclasses.is_dataclass(cls):
        return data
    shorthand = getattr(cls, "SHORTHAND", None)
    if shorthand and data is not None and not isinstance(data, Mapping):
        return {shorthand: data}
    if not isinstance(data, Mapping):
        return data
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for f in dataclasses.fields(cls):
        key = config_key(f)
        if _inline(f):
            out.update(expand_shorthands(hints[f.name], {k: v for k, v in out.items() if k in _keys(hints[f.name])}))
        elif (sections := registered_sections(f)) is not None:
            out.update({k: expand_shorthands(sections[k], v) for k, v in out.items() if k in sections})
        elif key in out:
            hint = hints[f.name]
            options = [o for o in get_args(hint) if o is not type(None)] if get_origin(hint) in (Union, types.UnionType) \
                else [hint]
            section = next((o for o in options if dataclasses.is_dataclass(o)), None)
            if section is not None:
                out[key] = expand_shorthands(section, out[key])
    return out


def refuse_moved(data: Mapping[str, Any], moved: Mapping[str, str]) -> None:
    """A ConfigError for the first key of ``data`` (nested sections) that ``moved`` maps from its
    old dotted name to its new home, saying where it goes now."""
    for old, new in moved.items():
        *sections, name = old.split(".")
        node: Any = data
        for section in sections:
            node = node.get(section) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping) and name in node:
            *new_sections, new_name = new.split(".")
            nested = f"{new_name}: {node[name]!r}"
            for section in reversed(new_sections):
                nested = f"{section}: {{{nested}}}"
            raise ConfigError(f"{old} moved to {new}: write {nested} (override: {new}={node[name]!r})")


def refuse_removed(data: Mapping[str, Any], removed: Mapping[str, str]) -> None:
    """A ConfigError for the first key of ``data`` (nested sections) that ``removed`` maps from its
    old dotted name to what to write instead (a setting that no longer exists, its job done by
    another that is not simply its new home: another unit, or one setting for several)."""
    for old, instead in removed.items():
        *sections, name = old.split(".")
        node: Any = data
        for section in sections:
            node = node.get(section) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping) and name in node:
            raise ConfigError(f"{old} is no longer a setting: {instead}; remove it")


def _inline(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get("inline"))


def registered_sections(field: dataclasses.Field) -> Mapping[str, type] | None:
    """For a field holding one section per entry of a registry: each entry's key and the dataclass
    of its section, as the registry has them now (None: the field is no such holder)."""
    sections = field.metadata.get("sections")
    return None if sections is None else sections()


def build_sections(sections: Mapping[str, type], data: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Every section of ``sections`` (key -> dataclass) from ``data`` (key -> a mapping, null, or a
    section already built), at its defaults where ``data`` has none; a key of ``data`` that is no
    entry is refused naming the entries."""
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ConfigError(f"unknown key {_join(path, unknown[0])}; the sections of {path or 'the top level'} "
                          f"by registered name: {', '.join(sections)}")
    return {key: value if isinstance(value := data.get(key), cls)
            else _coerce(cls, {} if value is None else value, _join(path, key))
            for key, cls in sections.items()}


def _keys(cls: type) -> set[str]:
    """The keys a section of ``cls`` accepts."""
    keys = set()
    for f in dataclasses.fields(cls):
        if f.init and not derived_from(f):
            sections = registered_sections(f)
            keys |= {config_key(f)} if sections is None else set(sections)
    return keys


def derived_from(field: dataclasses.Field) -> str | None:
    """The setting that decides a field no config sets (None: the field is a key)."""
    return field.metadata.get("derived")


def build(cls: type[T], data: Mapping[str, Any] | None, path: str = "") -> T:
    """Construct dataclass ``cls`` from ``data``, checking keys and types recursively."""
    data = dict(data or {})
    for f in dataclasses.fields(cls):
        if derived_from(f) and config_key(f) in data:
            raise ConfigError(f"{_join(path, config_key(f))} is not a setting of its own: it is {derived_from(f)}; "
                              f"set that instead")
    hints = typing.get_type_hints(cls)
    registered = {f.name: sections for f in dataclasses.fields(cls) if (sections := registered_sections(f)) is not None}
    fields = {config_key(f): f for f in dataclasses.fields(cls)
              if f.init and not derived_from(f) and not _inline(f) and f.name not in registered}
    inline = {f.name: _keys(hints[f.name]) for f in dataclasses.fields(cls) if _inline(f)}
    valid = set(fields).union(*inline.values(), *registered.values())
    unknown = sorted(set(data) - valid)
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"unknown key {where}{unknown[0]}; valid keys{' of ' + path if path else ''}: "
                          f"{', '.join(sorted(valid))}")
    removed = getattr(cls, "REMOVED_VALUES", {})  # field key -> {value no longer valid: what to write}
    for key, value in data.items():
        if isinstance(value, str) and value in removed.get(key, {}):
            raise ConfigError(f"{_join(path, key)}={value!r} {removed[key][value]}")
    kwargs = {fields[key].name: _coerce(hints[fields[key].name], value, _join(path, key))
              for key, value in data.items() if key in fields}
    for name, keys in inline.items():  # its keys written at this level, under this section's path
        kwargs[name] = build(hints[name], {k: v for k, v in data.items() if k in keys}, path)
    for name, sections in registered.items():  # each entry's section written at this level under its name
        kwargs[name] = build_sections(sections, {k: v for k, v in data.items() if k in sections}, path)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc) if path.split(".")[0] in str(exc) else f"{path}: {exc}") from exc


def to_dict(config: Any) -> dict[str, Any]:
    """Plain data (tuples as lists), ready for YAML."""
    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out: dict[str, Any] = {}
            for f in dataclasses.fields(value):
                if _inline(f) or registered_sections(f) is not None:
                    out.update(plain(getattr(value, f.name)))
                elif not derived_from(f):
                    out[config_key(f)] = plain(getattr(value, f.name))
            return out
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(config)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _coerce(hint: Any, value: Any, path: str) -> Any:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        options = get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(option, value, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}={value!r} matches none of {hint}")
    if origin is Literal:
        if value not in get_args(hint):
            raise ConfigError(f"{path}={value!r} must be one of {', '.join(map(repr, get_args(hint)))}")
        return value
    if dataclasses.is_dataclass(hint):
        shorthand = getattr(hint, "SHORTHAND", None)
        if shorthand and not isinstance(value, Mapping):
            value = {shorthand: value}  # ``loss.correction: tis`` is ``loss.correction: {name: tis}``
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path} must be a section (mapping), got {value!r}")
        return build(hint, value, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {value!r}")
        args = get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{path} must have {len(args)} entries, got {len(value)}")
        return tuple(_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin in (dict, Mapping) or hint in (dict, Any):
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}={value!r} must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}={value!r} must be an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}={value!r} must be a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}={value!r} must be a string")
        return value
    return value
