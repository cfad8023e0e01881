"""Write docs/config-reference.md: every key of an experiment config with its type, its default and
the text that documents it in the code (the section dataclass's docstring, the comment above the
field or at the end of its line).

    python tools/config_reference.py           # rewrite docs/config-reference.md
    python tools/config_reference.py --check   # exit 1 when the page is stale or a key is undocumented

The keys are those of :class:`bpo_megatron.experiment.ExperimentConfig`, walked as the config
loader reads them: a nested dataclass is a section, ``metadata={"inline": True}`` shows its keys at
its parent's level, ``metadata={"key": ...}`` renames a key, ``metadata={"derived": ...}`` is no
key, ``metadata={"sections": ...}`` is one section per entry of a registry, each under the entry's
name at its parent's level (``rollout.<engine>``: its spec's options dataclass, one per entry of the
engine registry); a key with ``metadata={"choices": ...}`` (a function) takes the values it returns
as its type (``rollout.engine``: the engine registry's names). A key counts as documented when
the comment above its field or at the end of its line says something (a field without one takes
the comment of an earlier field of its run when that comment names it), or when its section's
docstring names it in double backquotes. The page ends with the cross-section rules
(``bpo_megatron.experiment_rules.RULES``): each rule's name, the keys it reads and what it asks.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "config-reference.md"
COMMAND = "python tools/config_reference.py"


@dataclass(frozen=True)
class Key:
    """One config key: its dotted name, its field and the section dataclass that declares it."""

    dotted: str
    field: dataclasses.Field
    hint: Any
    owner: type
    documentation: str  # the field's own comment text ("" when it has none)


@dataclass(frozen=True)
class Section:
    """One section dataclass at its dotted prefix ("" for the experiment's top level)."""

    prefix: str
    cls: type
    inline: bool  # its keys are written at its parent's level
    keys: list[Key]


# ------------------------------------------------------------------------------ the source's comments
def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment that documents it in ``cls``'s source: the comment lines right
    above it and the one at the end of its line; a field without either takes the nearest such
    comment of the run of adjacent fields it belongs to (no blank line between) when that comment
    names it (``eps_low``'s comment, which names ``eps_high``, documents the next field too)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}  # line number (1-based) -> comment text
    trailing: set[int] = set()
    code_lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
            if token.start[0] in code_lines:
                trailing.add(token.start[0])
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                tokenize.ENCODING, tokenize.ENDMARKER):
            code_lines.update(range(token.start[0], token.end[0] + 1))
    body = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)).body
    out: dict[str, str] = {}
    run_comment = ""  # the comment of the run of adjacent fields the current one belongs to
    previous: ast.stmt | None = None
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
            above: list[str] = []
            line = node.lineno - 1
            while line in comments and line not in trailing:
                above.insert(0, comments[line])
                line -= 1
            own = [*above, *(comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in trailing)]
            text = " ".join(own)
            adjacent = isinstance(previous, ast.AnnAssign) and previous.end_lineno == node.lineno - 1
            if text:
                run_comment = text
            elif adjacent and re.search(rf"\b{re.escape(name)}\b", run_comment):
                text = run_comment
            elif not adjacent:
                run_comment = ""
            out[name] = text
        previous = node
    return out


def own_docstring(cls: type) -> str:
    """``cls``'s docstring, cleaned; "" for none (the signature ``dataclass`` writes in its place)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    return "" if doc.startswith(cls.__name__ + "(") else doc


def named_in_docstring(cls: type, name: str) -> bool:
    """Whether ``cls``'s docstring names ``name`` inside double backquotes (``name``, ``name: x``)."""
    doc = own_docstring(cls)
    return any(re.search(rf"(?<![\w.]){re.escape(name)}\b", span) for span in re.findall(r"``(.+?)``", doc, re.S))


# ------------------------------------------------------------------------------------- the walk
def _section_class(hint: Any) -> type | None:
    options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    return next((o for o in options if dataclasses.is_dataclass(o)), None)


def sections() -> list[Section]:
    """Every section of the experiment config, parents before their children, in field order."""
    from bpo_megatron.config.loader import config_key, derived_from, registered_sections
    from bpo_megatron.experiment import ExperimentConfig

    out: list[Section] = []

    def walk(cls: type, prefix: str, inline: bool) -> None:
        hints = typing.get_type_hints(cls)
        comments = field_comments(cls)
        section = Section(prefix, cls, inline, [])
        out.append(section)
        children: list[tuple[type, str, bool]] = []
        for f in dataclasses.fields(cls):
            if not f.init or derived_from(f):
                continue
            if f.metadata.get("inline"):
                children.append((hints[f.name], prefix, True))
                continue
            if (registered := registered_sections(f)) is not None:  # one section per registry entry
                children += [(options, f"{prefix}{name}.", False) for name, options in registered.items()]
                continue
            dotted = prefix + config_key(f)
            child = _section_class(hints[f.name])
            if child is not None:
                children.append((child, dotted + ".", False))
            else:
                section.keys.append(Key(dotted, f, hints[f.name], cls, comments.get(f.name, "")))
        for child_cls, child_prefix, child_inline in children:
            walk(child_cls, child_prefix, child_inline)

    walk(ExperimentConfig, "", False)
    return out


def keys() -> list[Key]:
    return [key for section in sections() for key in section.keys]


def undocumented(all_sections: list[Section] | None = None) -> list[str]:
    """The dotted keys (and sections) nothing in the code documents."""
    missing: list[str] = []
    for section in all_sections if all_sections is not None else sections():
        if section.prefix and not section.inline and not own_docstring(section.cls):
            missing.append(section.prefix.rstrip(".") + " (the section's docstring)")
        for key in section.keys:
            if not key.documentation and not named_in_docstring(key.owner, key.field.name):
                missing.append(key.dotted)
    return missing


# ------------------------------------------------------------------------------------ rendering
def type_text(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return " \\| ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " \\| ".join("null" if a is type(None) else type_text(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_text(args[0])}"
        return f"list of {len(args)} ({', '.join(type_text(a) for a in args)})"
    if origin in (dict, typing.Mapping) or hint is dict:
        return "mapping"
    if hint is Any:
        return "any"
    return getattr(hint, "__name__", str(hint))


def value_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    return repr(value)


def default_text(key: Key) -> str:
    f = key.field
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if key.dotted == "rollout.sglang.launcher":  # the interpreter's path differs from machine to machine
        value = tuple("<python>" if v == sys.executable else v for v in value)
    return value_text(value)


def prose(text: str) -> str:
    """reStructuredText markup of the docstrings as Markdown: ``x`` -> `x`, :class:`~a.B` -> `B`; a
    ``<`` outside code (``<run>/initial_hf.fp8``) written as an entity, not read as an HTML tag."""
    text = re.sub(r":(?:class|mod|func|meth|data|attr):`~?([^`]+)`",
                  lambda m: f"`{m.group(1).rsplit('.', 1)[-1] if m.group(0).find('~') >= 0 else m.group(1)}`", text)
    parts = text.replace("``", "`").split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;") for i, part in enumerate(parts))


def render(all_sections: list[Section] | None = None) -> str:
    all_sections = all_sections if all_sections is not None else sections()
    lines = [
        "# Config reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the config dataclasses; edit their docstrings and comments, "
        "then regenerate. tests/test_config_reference.py checks this page is current. -->",
        "",
        "Every key of an experiment config (`bpo_megatron/experiment.py`), section by section: its type, its default "
        "and what it does, as the code that owns it documents it. How configs are written, composed and overridden: "
        "[the guide](guide.md#running-experiments); where to add a section's own keys: "
        "[extending](extending.md).",
        "",
    ]
    for section in all_sections:
        title = section.prefix.rstrip(".") or "top level"
        where = f"{section.cls.__module__}.{section.cls.__qualname__}"
        heading = f"## `{title}`" if section.prefix else "## The top level"
        if section.inline:
            heading = f"### `{title}` (its keys written at `{title}`'s level)"
        elif not section.keys and not own_docstring(section.cls):
            continue
        lines += [heading, "", f"`{where}`" + ("" if section.keys else " (sections only)"), ""]
        if doc := own_docstring(section.cls):
            lines += [prose(doc), ""]
        first_with: dict[str, str] = {}  # a comment shared by a run of keys -> the first of them
        for key in section.keys:
            text = prose(key.documentation) if key.documentation else "(described above)"
            if key.documentation in first_with:
                text = f"see `{first_with[key.documentation]}`"
            elif key.documentation:
                first_with[key.documentation] = key.dotted
            # a name of a registry: its entries now (metadata={"choices": ...})
            kind = " \\| ".join(f'"{c}"' for c in key.field.metadata["choices"]()) \
                if "choices" in key.field.metadata else type_text(key.hint)
            lines.append(f"- **`{key.dotted}`** ({kind}; default `{default_text(key)}`): {text}")
        if section.keys:
            lines.append("")
    lines += rules_table()
    return "\n".join(lines).rstrip() + "\n"


def rules_table() -> list[str]:
    """The experiment's cross-section rules (``bpo_megatron.experiment_rules.RULES``) as a table, in
    the order they are checked."""
    from bpo_megatron.experiment_rules import RULES

    lines = [
        "## Cross-section rules",
        "",
        "What no single section checks: the experiment's rules (`bpo_megatron/experiment_rules.py`), in the order "
        "`load_experiment`, `train --check` and `plan` apply them. The first one a config breaks is refused (exit 2), "
        "naming the keys to change and how. A rule marked *model* runs where the model is checked (for a launch: on "
        "the cluster, not the submitting machine): it reads the model's `config.json` or the trainer's environment. "
        "`<engine>` is the section of `rollout.engine`.",
        "",
        "| rule | reads | asks |",
        "|---|---|---|",
    ]
    for rule in RULES:
        reads = ", ".join(f"`{key}`" for key in rule.reads)
        asks = prose(rule.summary).replace("|", "\\|") + (" *model*" if rule.model else "")
        lines.append(f"| `{rule.name}` | {reads} | {asks} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page is stale or a key is undocumented")
    args = parser.parse_args(argv)
    all_sections = sections()
    missing = undocumented(all_sections)
    if missing:
        print("config keys nothing documents (add a comment above the field or name it in its section's "
              "docstring, then run " + COMMAND + "):\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    page = render(all_sections)
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}: {sum(len(s.keys) for s in all_sections)} keys")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the package of this checkout, not another one installed in the environment
    sys.exit(main())
