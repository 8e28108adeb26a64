"""The package's plan, read from its imports: folders that are stages, imports that only run down
the stack, and no import circle. The order of the stages is written here once.

Every `import` and `from ... import` counts, at any depth and under `if TYPE_CHECKING:` too: a
circle a type checker needs is still a circle a reader has to follow.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "unsafe_doctor"

# Lowest first: a stage imports only the stages before it (and itself).
STAGES = ("errors", "npu", "log", "source", "knowledge", "recovery_code", "audit", "diagnose", "adaptor", "sentinel", "replay",
          "report", "cli")
# Entry points, not stages: `python -m unsafe_doctor` and the replay's `torchrun -m unsafe_doctor.replay` run the CLI.
ENTRY_POINTS = {"unsafe_doctor.__main__", "unsafe_doctor.replay.__main__"}
ROOT_MODULES = {"__init__.py", "__main__.py", "errors.py"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _imports(name: str) -> set[str]:
    """The package's modules that `name` imports (a `from X import y` names module X.y when there is one)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module in MODULES:
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                      for alias in node.names}
    found.discard(name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_the_package_root_holds_only_its_entry_points_and_errors():
    assert {path.name for path in PACKAGE.glob("*.py")} == ROOT_MODULES


def test_every_folder_is_a_stage_with_a_docstring():
    folders = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    assert folders == set(STAGES) - {"errors"}
    for folder in folders:
        assert ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())), folder


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a stage higher than the importer's, as 'module -> target'."""
    upward = []
    for module, imported in graph.items():
        stage = _stage(module)
        if module in ENTRY_POINTS or stage is None:
            continue
        for target in imported:
            higher = _stage(target)
            if higher is not None and STAGES.index(higher) > STAGES.index(stage):
                upward.append(f"{module} -> {target}")
    return sorted(upward)


def _circles(graph: dict[str, set[str]]) -> list[str]:
    """Every circle a depth-first walk of the imports closes, as 'a -> b -> a'."""
    circles = []
    state: dict[str, str] = defaultdict(lambda: "new")
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state[target] == "open":
                circles.append(" -> ".join([*path[path.index(target):], target]))
            elif state[target] == "new":
                visit(target)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if state[module] == "new":
            visit(module)
    return circles


def test_no_stage_imports_a_higher_one():
    assert _upward(GRAPH) == []


def test_no_import_circle():
    assert _circles(GRAPH) == []


def test_the_checks_see_an_upward_import_and_a_circle():
    graph = {
        "unsafe_doctor.log.lines": {"unsafe_doctor.cli.main"},
        "unsafe_doctor.cli.main": set(),
        "unsafe_doctor.knowledge.a": {"unsafe_doctor.knowledge.b"},
        "unsafe_doctor.knowledge.b": {"unsafe_doctor.knowledge.a"},
    }
    assert _upward(graph) == ["unsafe_doctor.log.lines -> unsafe_doctor.cli.main"]
    assert _circles(graph) == ["unsafe_doctor.knowledge.a -> unsafe_doctor.knowledge.b -> unsafe_doctor.knowledge.a"]



def test_no_module_imports_a_private_module_of_rich():
    """rich's private modules (rich._wrap) may change in any release the pins allow (rich>=13)."""
    private = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                private += [f"{name} imports {alias.name}" for alias in node.names if alias.name.startswith("rich._")]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rich._"):
                private.append(f"{name} imports {node.module}")
    assert private == []
