"""The README's promises: the quick start and CI run the same commands."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_quick_start_has_exactly_two_commands_both_setting_up_first():
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    assert commands[0].startswith("bash tools/setup.sh && ")
    assert commands[1].startswith("bash tools/setup.sh --tests && ")  # its set-up also builds the contract tests' env


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = _quick_start_commands()[1]
    ci_lines = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    assert test_command in ci_lines  # verbatim, besides the extra legs (newest Megatron, oldest transformers)


def test_what_the_default_run_leaves_out_is_marked_declared_and_run_by_ci():
    """A test leaves the default run only through a declared marker; .ci/run runs every test so
    marked over the whole suite, in one leg, but those marked slow, which `.ci/run --full` adds (the
    full set, the extra legs included, in one command)."""
    import tomllib

    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    addopts = pytest_options["addopts"]
    assert "--strict-markers" in addopts.split()  # an undeclared marker fails collection
    [left_out] = re.findall(r"-m '([^']+)'", addopts)
    markers = [re.fullmatch(r"not (\w+)", part.strip()).group(1) for part in left_out.split(" and ")]
    declared = {line.split(":", 1)[0] for line in pytest_options["markers"]}
    assert "slow" in markers and "ci" in markers and set(markers) <= declared, (markers, declared)
    ci_lines = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    assert '.venv/bin/python -m pytest -q -p no:cacheprovider -m "$rest"' in ci_lines  # over testpaths
    assert f'rest="{" or ".join(m for m in markers if m != "slow")}"' in ci_lines
    assert f'    --full) rest="{" or ".join(markers)}" ;;' in ci_lines
    for document in ("README.md", "docs/guide.md"):  # the one documented command for the full set
        assert '.venv/bin/python -m pytest -m "slow or not slow"' in (ROOT / document).read_text(), document


# ------------------------------------------------------------------------------ documents
DOCUMENTS = ("README.md", "docs/guide.md", "docs/internals.md", "docs/results.md", "docs/extending.md",
             "docs/config-reference.md")


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a document's headers: lower case, punctuation dropped, spaces -> '-'."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, flags=re.M)}


def test_the_readme_is_short_and_every_link_of_the_documents_resolves():
    """The README is the overview (at most 300 lines); the manual lives in docs/, one link away,
    and every relative link of these documents names a file that exists and a header it holds."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
    broken = []
    for name in DOCUMENTS:
        doc = ROOT / name
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text())):
                broken.append(f"{name}: {target}")
    assert not broken, broken
    readme = (ROOT / "README.md").read_text()
    for moved in ("docs/guide.md", "docs/internals.md", "docs/results.md", "docs/extending.md",
                  "docs/config-reference.md"):
        assert f"]({moved}" in readme


def test_no_committed_file_names_a_path_of_the_machine_it_was_made_on():
    """Run records, reports and docs name files as the repository does: neither this checkout's
    absolute path nor a home or work directory of some machine."""
    import subprocess

    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                               timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    pattern = re.compile(re.escape(str(ROOT)) + r"|(?<![\w.])/(?:work|home|Users)/[\w.-]+/")
    found = []
    for name in filter(None, files):
        path = ROOT / name
        if not path.is_file() or path.stat().st_size > 5_000_000:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # a binary file
        found += [f"{name}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not found, found[:20]


# ------------------------------------------------------------------------------ import graph
PACKAGE = ROOT / "bpo_megatron"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Project modules ``path`` imports anywhere (functions included), except under
    ``if TYPE_CHECKING:``, which only type checkers run."""
    import ast

    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if "TYPE_CHECKING" in ast.unparse(node.test):
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)

    Visitor().visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, set(files)) for name, path in files.items()}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1].removesuffix(".py") if len(parts) > 1 else "bpo_megatron"


def _package_map() -> dict[str, set[str]]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Package map", 1)[1].split("\n## ", 1)[0]
    allowed = {}
    for row in re.findall(r"^\| `(\w+)` \|[^|]*\| ([^|]*) \|$", section, flags=re.M):
        allowed[row[0]] = set(re.findall(r"`(\w+)`", row[1]))
    return allowed


def test_packages_import_only_what_the_readme_map_allows():
    allowed = _package_map()
    packages = {_top(m) for m in _graph()} - {"bpo_megatron"}
    assert packages == set(allowed), "the README's package map lists exactly the packages"
    for module, imported in _graph().items():
        for target in imported:
            source, dest = _top(module), _top(target)
            if "bpo_megatron" in (source, dest) or source == dest:
                continue
            assert dest in allowed[source], f"{module} imports {target}: not in the README's map for {source}"


def _reached(package: str, allowed: dict[str, set[str]]) -> set[str]:
    """``package`` and every package it may reach through the README's map."""
    reached = {package}
    while True:
        grown = reached | {d for p in reached for d in allowed[p]}
        if grown == reached:
            return reached
        reached = grown


def test_evaluation_and_everything_below_never_import_the_loop():
    allowed = _package_map()
    below_eval = _reached("eval", allowed)
    assert "loop" not in below_eval and "tasks" in below_eval
    for module, imported in _graph().items():
        if _top(module) in below_eval:
            assert not any(_top(t) == "loop" for t in imported), module


def test_no_import_cycle_between_modules():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target] if target in path else [module, target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


# ------------------------------------------------------------------------------ the weights' home
def test_the_weights_sit_below_the_trainer_and_convert_is_only_the_offline_tool():
    """The trainer exports its weights with ``weights`` (the name map, layouts, gather, export,
    buckets); nothing ``weights`` reaches knows of a trainer, an engine, a transport or Ray's
    groups. ``convert`` is the command-line tool alone: only the entry points import it."""
    allowed = _package_map()
    assert "weights" in allowed["trainer"]
    assert not {"trainer", "rollout", "weight_sync", "orchestration", "convert"} & _reached("weights", allowed)
    for module, imported in _graph().items():
        if _top(module) not in {"convert", "cli", "commands"}:
            assert not any(_top(t) == "convert" for t in imported), f"{module} imports the offline converter"


def _transport_modules() -> set[str]:
    """Every transport's module: the generic ones and those the engines' specs declare."""
    from bpo_megatron.rollout.engine import ENGINES
    from bpo_megatron.weight_sync import TRANSPORTS

    declared = [ref for name in ENGINES for ref in ENGINES.load(name).transports.values()]
    return {target.partition(":")[0] for target in [*TRANSPORTS.values(), *declared]}


def test_the_package_reaches_into_no_checkout_folder():
    """An installed package has no tests/, experiments/ or launchers/ beside it: no module of
    bpo_megatron imports from them or builds a path into them (docstrings may name a test)."""
    import ast

    for path in (ROOT / "bpo_megatron").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] in ("tests", "experiments", "launchers") for n in names), path
            if isinstance(node, ast.Constant) and node.value in ("tests", "experiments", "launchers"):
                raise AssertionError(f"{path.relative_to(ROOT)} names the checkout folder {node.value!r}")


def test_the_weight_seam_names_no_engine():
    """``weight_sync`` imports nothing of an engine, type-only imports included, and its text
    names none of their modules: each engine's spec declares its transports."""
    for path in (ROOT / "bpo_megatron" / "weight_sync").rglob("*.py"):
        text = path.read_text()
        assert "bpo_megatron.rollout" not in text and "rollout/" not in text, path.name


def _closure(module: str, graph: dict[str, set[str]]) -> set[str]:
    """The modules ``module`` reaches through its imports."""
    seen, todo = set(), [module]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_transports_import_no_engine_group_and_the_loop_imports_no_transport():
    """A transport receives endpoint records (what the driver asked of the engines) and never
    reaches back into the engine group, or anything else of Ray's orchestration; an engine's
    transports live in its folder, found by name through the registry, so the generic seam
    (``weight_sync``) imports no engine and the loop no transport."""
    graph, transports = _graph(), _transport_modules()
    assert transports <= set(graph), "every registered transport is a module of the package"
    for module in transports:
        reached = _closure(module, graph)
        assert not any(_top(t) in {"orchestration", "loop", "trainer"} for t in reached), module
    for module, imported in graph.items():
        if _top(module) == "loop":
            assert not imported & transports, f"{module} imports a transport"
        if _top(module) == "weight_sync":
            assert not any(_top(t) == "rollout" for t in imported), f"{module} imports an engine"
    allowed = _package_map()
    assert "rollout" not in _reached("weight_sync", allowed) and "weight_sync" in allowed["rollout"]


def test_orchestration_reads_no_experiment_config():
    """The groups are built from their specs (``TrainerSpec``, ``EngineGroupSpec``) and the sections
    they are given, never from the experiment: no module of ``orchestration`` imports it, the config
    loader or the loop (type-only imports included), takes a ``cfg`` or reads a member only the
    experiment has (``cfg.trainer_spec()``, ``cfg.hf_config()``, ...)."""
    import ast
    import dataclasses

    from bpo_megatron.experiment import ExperimentConfig

    sections = {f.name for f in dataclasses.fields(ExperimentConfig)}  # a spec may hold sections of the same names
    experiment_only = {name for name in vars(ExperimentConfig) if not name.startswith("__")} - sections
    assert {"trainer_spec", "engine_group_spec", "hf_config", "weight_transport"} <= experiment_only
    modules = sorted((ROOT / "bpo_megatron" / "orchestration").glob("*.py"))
    assert len(modules) >= 10
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.startswith(("bpo_megatron.experiment", "bpo_megatron.config", "bpo_megatron.loop"))
                               for n in names), f"{path.name} imports {names}"
            if isinstance(node, ast.arg):
                assert node.arg not in {"cfg", "config", "experiment"}, f"{path.name}: a parameter {node.arg!r}"
            if isinstance(node, ast.Attribute):
                assert node.attr not in experiment_only, f"{path.name} reads .{node.attr} of an experiment"


def test_an_engine_process_imports_no_megatron():
    """The engines' modules (what every engine actor and server process imports) load without
    Megatron: its import costs seconds of start-up per process, and an engine never touches a
    Megatron model (bpo_megatron.weights imports its gather, which does, on first use)."""
    import os
    import subprocess
    import sys

    modules = ["bpo_megatron.rollout.hf.engine", "bpo_megatron.rollout.sglang.engine",
               "bpo_megatron.rollout.sglang.server", "bpo_megatron.orchestration.workers"]
    probe = (f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
             "print(sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    import bpo_megatron.weights as weights

    assert weights.ExportPlan.__module__ == "bpo_megatron.weights.gather"  # the lazy names still resolve
    assert all(getattr(weights, name) is not None for name in weights.__all__)
