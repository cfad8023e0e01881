"""Check that every torch name the code uses exists in the torch this interpreter imports.

Usage: python tools/check_torch_names.py [PATH ...]     (default: bpo_megatron)

Parses every .py file under the paths (nothing is imported from them) and resolves each torch name
they use against the importable torch: modules named by ``import torch.x.y [as z]`` and
``from torch.x import y [as z]``, attribute chains rooted at any of those names
(``torch.accelerator.empty_host_cache``, ``F.scaled_dot_product_attention``,
``torch.ops.aten._flash_attention_forward``; a chain ends at a call or subscript) and
``getattr(<torch name>, "literal")`` without a default. Imports inside functions count too: the
CUDA-only branches that no CPU test reaches are exactly those. Run it under the oldest torch the
package admits to catch names that only newer torch has, and under a CUDA build: a CPU build lacks
the CUDA-only bindings (torch._C._host_emptyCache, torch.distributed.ProcessGroupNCCL).

A use on a line with the comment ``# torch-window: <reason>`` is exempt (a name deliberately
guarded for newer torch); the summary counts the exempted uses. Aliases are collected per file, not per scope. A name assigned to
(``torch.x.y = v``) checks only ``torch.x``. Exit status: 1 when a name does not resolve, else 0.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

EXEMPT = "# torch-window:"


def _dotted(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None when the chain starts at anything but a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _is_torch(module: str | None) -> bool:
    return module is not None and (module == "torch" or module.startswith("torch."))


class _Uses(ast.NodeVisitor):
    """Collects (line, dotted torch name) for one module."""

    def __init__(self, tree: ast.Module) -> None:
        self.aliases: dict[str, str] = {}  # local name -> the torch name it stands for
        self.uses: list[tuple[int, str]] = []
        for node in ast.walk(tree):  # aliases first: a function may use a name imported below it
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _is_torch(alias.name):
                        self.uses.append((node.lineno, alias.name))
                        if alias.asname:
                            self.aliases[alias.asname] = alias.name
                        else:
                            self.aliases["torch"] = "torch"
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_torch(node.module):
                self.uses.append((node.lineno, node.module))
                for alias in node.names:
                    if alias.name != "*":
                        self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                        self.uses.append((node.lineno, f"{node.module}.{alias.name}"))
        self.visit(tree)

    def _torch_name(self, node: ast.AST) -> str | None:
        parts = _dotted(node)
        if parts is None or parts[0] not in self.aliases:
            return None
        return ".".join([self.aliases[parts[0]], *parts[1:]])

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = self._torch_name(node)
        if name is None:
            self.generic_visit(node)  # e.g. torch.cuda.CUDAGraph().replay: the call's chain
            return
        if not isinstance(node.ctx, ast.Load):
            name = name.rsplit(".", 1)[0]  # an assignment creates its last attribute
        self.uses.append((node.lineno, name))

    def visit_Call(self, node: ast.Call) -> None:
        if (isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) == 2
                and not node.keywords and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)):
            owner = self._torch_name(node.args[0])
            if owner is not None:
                self.uses.append((node.lineno, f"{owner}.{node.args[1].value}"))
        self.generic_visit(node)


def lookup(name: str) -> str | None:
    """None when ``name`` (torch.a.b...) exists: attribute by attribute, importing a submodule
    where the attribute is missing (unknown ``torch.ops`` ops raise AttributeError or
    RuntimeError). Otherwise why not: "missing", or the error of a torch module that exists but
    does not import here (a third-party module it needs is absent; the names below it go unchecked)."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i in range(1, len(parts)):
        try:
            obj = getattr(obj, parts[i])
        except (AttributeError, RuntimeError, ImportError):
            module = ".".join(parts[:i + 1])
            try:
                obj = importlib.import_module(module)
            except Exception as error:  # noqa: BLE001 - whatever importing it raises
                return f"{module} does not import here ({error})" if _is_module(module) else "missing"
    return None


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # its parent is no package; a module without a spec
        return False


def python_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for path in map(Path, paths):
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def check(paths: list[str]) -> tuple[list[str], list[str], int, int, int]:
    """Returns (one line per name that does not resolve, one per name left unchecked, uses
    checked, uses exempted, files)."""
    missing, unchecked, checked, exempted = [], [], 0, 0
    known: dict[str, str | None] = {}
    files = python_files(paths)
    for path in files:
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for line, name in sorted(set(_Uses(ast.parse(source, str(path))).uses)):
            if EXEMPT in lines[line - 1]:
                exempted += 1
                continue
            checked += 1
            if name not in known:
                known[name] = lookup(name)
            if known[name] == "missing":
                missing.append(f"{path}:{line}: {name}")
            elif known[name] is not None:
                unchecked.append(f"{path}:{line}: {name} unchecked: {known[name]}")
    return missing, unchecked, checked, exempted, len(files)


def main(argv: list[str] | None = None) -> int:
    paths = (sys.argv[1:] if argv is None else argv) or ["bpo_megatron"]
    missing, unchecked, checked, exempted, files = check(paths)
    import torch

    for line in missing:
        print(f"{line} (not in torch {torch.__version__})")
    for line in unchecked:
        print(f"note: {line}")
    print(f"torch names: {checked} uses checked in {files} files against torch {torch.__version__}, "
          f"{len(missing)} missing, {exempted} exempted ({EXEMPT})")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
