"""The package's plan, read from its imports: folders that are stages, imports that only run down
the stack, and no import circle. The order of the stages is written here once, and tests/ keeps a
folder for each stage.

Every `import` and `from ... import` counts, at any depth and under `if TYPE_CHECKING:` too: a
circle a type checker needs is still a circle a reader has to follow.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "unsafe_doctor"

# Lowest first: a stage imports only the stages before it (and itself).
STAGES = (
    "errors",
    "npu",
    "log",
    "source",
    "knowledge",
    "recovery_code",
    "audit",
    "diagnose",
    "adaptor",
    "sentinel",
    "replay",
    "report",
    "cli",
)
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
            found |= {
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module for alias in node.names
            }
    found.discard(name)
    return found


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Each module's imports of the package (parsed when a test asks, not at collection in every worker)."""
    return {name: _imports(name) for name in MODULES}


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


TESTS = Path(__file__).resolve().parents[1]
# tests/ mirrors the package: a folder per stage, plus the commands driven end to end over several stages
# and the checks of the repository itself. Beside them, the tests' own data (corpus, fixtures, golden).
TEST_FOLDERS = {*STAGES, "commands", "project"} - {"errors"}
TEST_DATA = {"corpus", "fixtures", "golden"}


def test_every_test_file_lives_in_a_folder_named_for_a_stage_commands_or_project():
    files = [path for path in TESTS.rglob("test_*.py") if path.relative_to(TESTS).parts[0] not in TEST_DATA]
    misplaced = sorted(
        str(path.relative_to(TESTS)) for path in files if path.parent.parent != TESTS or path.parent.name not in TEST_FOLDERS
    )
    assert misplaced == []
    names = [path.name for path in files]
    assert sorted({name for name in names if names.count(name) > 1}) == []  # pytest imports each by its bare name
    assert not any((TESTS / folder / "__init__.py").exists() for folder in TEST_FOLDERS)


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
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif state[target] == "new":
                visit(target)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if state[module] == "new":
            visit(module)
    return circles


def test_no_stage_imports_a_higher_one():
    assert _upward(import_graph()) == []


def test_no_import_circle():
    assert _circles(import_graph()) == []


def test_the_checks_see_an_upward_import_and_a_circle():
    graph = {
        "unsafe_doctor.log.lines": {"unsafe_doctor.cli.main"},
        "unsafe_doctor.cli.main": set(),
        "unsafe_doctor.knowledge.a": {"unsafe_doctor.knowledge.b"},
        "unsafe_doctor.knowledge.b": {"unsafe_doctor.knowledge.a"},
    }
    assert _upward(graph) == ["unsafe_doctor.log.lines -> unsafe_doctor.cli.main"]
    assert _circles(graph) == ["unsafe_doctor.knowledge.a -> unsafe_doctor.knowledge.b -> unsafe_doctor.knowledge.a"]


# The one home of code generation (knowledge/render/__init__.py says why it sits in the knowledge stage).
RENDER_HOME = "unsafe_doctor.knowledge.render"


def _generates_code(tree: ast.AST) -> list[str]:
    """What in a module makes a fix's code: a `string.Template` made or filled, a block's marker lines
    put together (one list or tuple holding `MARKER_BEGIN + key` and `MARKER_END + key`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in ("substitute", "safe_substitute") or (name == "Template" and ast.unparse(func) == "string.Template"):
                found.append(f"line {node.lineno}: {ast.unparse(func)}()")
        elif isinstance(node, ast.ImportFrom) and node.module == "string" and any(a.name == "Template" for a in node.names):
            found.append(f"line {node.lineno}: from string import Template")
        elif isinstance(node, (ast.List, ast.Tuple)):
            marked = {
                element.left.id
                for element in node.elts
                if isinstance(element, ast.BinOp) and isinstance(element.op, ast.Add) and isinstance(element.left, ast.Name)
            }
            if {"MARKER_BEGIN", "MARKER_END"} <= marked:
                found.append(f"line {node.lineno}: a marked block")
    return found


def _outside_the_render_home(modules: dict[str, ast.AST]) -> list[str]:
    return sorted(
        f"{name} {what}"
        for name, tree in modules.items()
        if name != RENDER_HOME and not name.startswith(RENDER_HOME + ".")
        for what in _generates_code(tree)
    )


def test_code_generation_lives_in_its_one_home():
    modules = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}
    assert _outside_the_render_home(modules) == []
    assert any(_generates_code(tree) for name, tree in modules.items() if name.startswith(RENDER_HOME + "."))


def test_the_render_home_check_sees_a_template_and_a_marked_block():
    sample = ast.parse("import string\nstring.Template(t).substitute(s)\nlines = [MARKER_BEGIN + key, *body, MARKER_END + key]\n")
    assert _outside_the_render_home({"unsafe_doctor.adaptor.x": sample}) == [
        "unsafe_doctor.adaptor.x line 2: string.Template()",
        "unsafe_doctor.adaptor.x line 2: string.Template(t).substitute()",
        "unsafe_doctor.adaptor.x line 3: a marked block",
    ]
    assert _outside_the_render_home({RENDER_HOME + ".block": sample}) == []


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


def _defined_names(tree: ast.Module) -> set[str]:
    """The public classes, functions and type names (aliases and TypeVars: `Role = Literal[...]`,
    capitalised, not a CONSTANT) a module defines at its top level."""
    kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    names = {node.name for node in tree.body if isinstance(node, kinds)}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names |= {
            target.id for target in targets if isinstance(target, ast.Name) and re.fullmatch(r"[A-Z]\w*[a-z]\w*", target.id)
        }
    return {name for name in names if not name.startswith("_")}


def _twins(modules: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each name defined by more than one module, with the modules."""
    where: dict[str, list[str]] = defaultdict(list)
    for module, names in sorted(modules.items()):
        for name in names:
            where[name].append(module)
    return {name: found for name, found in sorted(where.items()) if len(found) > 1}


def test_each_public_class_function_and_type_name_is_defined_once():
    """One name, one definition: a reader (or grep) finding `Verdict` or `Mode` must not have to ask whose."""
    defined = {name: _defined_names(ast.parse(path.read_text())) for name, path in MODULES.items()}
    assert _twins(defined) == {}


# The parts of a global's name: only GlobalName holds all three, so only it joins them.
NAME_PARTS = {"module", "owner", "variable"}
GLOBAL_NAME_MODULE = "unsafe_doctor.log.global_name"
# Classes that have all three for a reason of their own, each with it.
NAME_PARTS_KEPT = {
    "unsafe_doctor.knowledge.rules.RuleMatch": "a rule's match as the knowledge files write it: its module may "
    "be a glob and its variable a pattern (variable_regex), a matcher rather than a name",
}


def _attributes(cls: ast.ClassDef) -> set[str]:
    """What a class holds: its annotated and assigned names, its properties, and what its methods set on self."""
    found = set()
    for statement in cls.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            found.add(statement.target.id)
        elif isinstance(statement, ast.Assign):
            found |= {target.id for target in statement.targets if isinstance(target, ast.Name)}
        elif isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef) and any(
            isinstance(decorator, ast.Name) and decorator.id == "property" for decorator in statement.decorator_list
        ):
            found.add(statement.name)
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            found.add(node.attr)
    return found


def _classes_with_name_parts(modules: dict[str, ast.Module]) -> list[str]:
    return sorted(
        f"{module}.{node.name}"
        for module, tree in modules.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and NAME_PARTS <= _attributes(node)
    )


def test_only_global_name_holds_a_globals_module_owner_and_variable():
    """Every stage names a global with log.global_name.GlobalName: no class keeps its own three parts
    (and so its own `.dotted`)."""
    trees = {name: ast.parse(path.read_text()) for name, path in MODULES.items() if name != GLOBAL_NAME_MODULE}
    assert [name for name in _classes_with_name_parts(trees) if name not in NAME_PARTS_KEPT] == []
    assert {"GlobalName"} <= _defined_names(ast.parse(MODULES[GLOBAL_NAME_MODULE].read_text()))


def test_the_name_checks_see_a_twin_and_a_name_of_its_own():
    twice = {"unsafe_doctor.a": {"Verdict", "judge"}, "unsafe_doctor.b": {"Verdict"}}
    assert _twins(twice) == {"Verdict": ["unsafe_doctor.a", "unsafe_doctor.b"]}
    tree = ast.parse(
        "class Holder:\n    module: str\n    owner: str | None\n\n    @property\n    def variable(self): ...\n"
        "class Other:\n    def __init__(self):\n        self.module = self.owner = self.variable = None\n"
        "class Fine:\n    name: str\n"
    )
    assert _classes_with_name_parts({"unsafe_doctor.x": tree}) == ["unsafe_doctor.x.Holder", "unsafe_doctor.x.Other"]
