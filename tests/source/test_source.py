"""The source model on its own: file discovery, the workspace, and the resolver called from an index
of modules (no log frame)."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.source.files import package_folder, python_files
from unsafe_doctor.source.imports import Imports, module_member, module_named
from unsafe_doctor.source.resolve import Scope, Tier, resolve
from unsafe_doctor.source.syntax import Function, is_empty_container, is_empty_value, loop_iterable, walk_scope, words
from unsafe_doctor.source.workspace import RECENT_SOURCES, Workspace

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORK = ROOT / "samples" / "framework"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def function_named(source, name: str) -> Function:
    function = source.bindings[name]
    assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
    return function


def test_python_files_skip_environments_caches_tests_and_hidden_folders(tmp_path):
    for kept in ("pkg/__init__.py", "pkg/a.py", "pkg/sub/b.py"):
        write(tmp_path / kept, "")
    for skipped in (
        ".venv/x.py",
        "venv/x.py",
        "myvenv/x.py",
        "pkg/__pycache__/x.py",
        "pkg/tests/x.py",
        "site-packages/x.py",
        "pkg.egg-info/x.py",
        ".git/x.py",
        "build/x.py",
    ):
        write(tmp_path / skipped, "")
    write(tmp_path / "pkg" / "notes.txt", "")
    found = [path.relative_to(tmp_path).as_posix() for path in python_files(tmp_path)]
    assert found == ["pkg/__init__.py", "pkg/a.py", "pkg/sub/b.py"]


def test_a_file_given_itself_is_its_only_file(tmp_path):
    script = write(tmp_path / "job.txt", "")
    assert list(python_files(script)) == [script]


def test_package_folder_is_the_top_package_and_none_for_a_top_level_module(tmp_path):
    module = write(tmp_path / "pkg" / "sub" / "mod.py", "")
    assert package_folder(module, "pkg.sub.mod") == (tmp_path / "pkg").resolve()
    assert package_folder(write(tmp_path / "alone.py", ""), "alone") is None


def test_a_scope_walk_yields_nested_functions_classes_and_lambdas_but_not_what_is_inside_them():
    function = ast.parse(
        textwrap.dedent("""\
        def outer(x):
            def first():
                return 1
            if x:
                class Inner:
                    y = 2
                key = lambda item: item.z
            return 3
        """)
    ).body[0]
    nodes = list(walk_scope(function))
    assert sorted(node.lineno for node in nodes if isinstance(node, ast.Return)) == [8]
    assert {type(node).__name__ for node in nodes} >= {"FunctionDef", "ClassDef", "Lambda"}
    assert not [node for node in nodes if isinstance(node, ast.Name) and node.id in ("item", "y")]


def test_empty_values_and_empty_containers():
    def value(code: str) -> ast.expr:
        return ast.parse(code, mode="eval").body

    assert all(is_empty_value(value(code)) for code in ("None", "()", "[]", "{}", "set()", "deque()"))
    assert not any(is_empty_container(value(code)) for code in ("None", "()", "[0]", "dict(a=1)"))
    assert not is_empty_value(value("torch.zeros(3)"))


def test_a_loop_variable_is_drawn_from_the_innermost_comprehension_that_binds_it_where_it_is_written():
    tree = ast.parse("r = [[x * y for y in x.rows] for x in X] + [x for x in [x for x in Z]] + [x]")
    drawn = [
        (name.id, ast.unparse(iterable) if (iterable := loop_iterable(tree, name)) else None)
        for name in ast.walk(tree)
        if isinstance(name, ast.Name) and name.id in ("x", "y")
    ]
    assert sorted(drawn, key=str) == sorted(
        [
            ("x", "X"),
            ("y", "x.rows"),
            ("x", "X"),
            ("y", "x.rows"),
            ("x", "X"),  # x.rows: x is the outer element
            ("x", "[x for x in Z]"),
            ("x", "[x for x in Z]"),
            ("x", "Z"),
            ("x", "Z"),
            ("x", None),  # outside every comprehension
        ],
        key=str,
    )


def test_a_workspace_parses_a_file_once_and_types_its_bindings(tmp_path):
    path = write(
        tmp_path / "pkg" / "mod.py",
        """
        import os
        from . import state as st
        try:
            from pkg.other import HELPER
        except ImportError:
            HELPER = None
        X: int = 1
        def f():
            global Y
        class C:
            pass
    """,
    )
    write(tmp_path / "pkg" / "__init__.py", "")
    workspace = Workspace([tmp_path])
    source = workspace.module_source("pkg.mod")
    assert source is not None and workspace.source(path, "pkg.mod") is source
    assert source.imports["st"].target == "pkg.state" and source.imports["HELPER"].target == "pkg.other.HELPER"
    assert isinstance(source.bindings["HELPER"], ast.Assign)  # the later assignment is the binding
    assert isinstance(source.bindings["X"], ast.AnnAssign) and isinstance(source.bindings["C"], ast.ClassDef)
    assert source.declared_globals == {"Y"}


def parsed_and_let_go(tmp_path, path, module):
    """A workspace that parsed the file of package `pkg`, then let its tree go."""
    write(tmp_path / "pkg" / "__init__.py", "")
    workspace = Workspace([tmp_path])
    assert workspace.source(path, module) is not None
    for number in range(RECENT_SOURCES):  # later files push its tree out of the latest ones kept
        workspace.source(write(tmp_path / "pkg" / f"later{number}.py", "A = 1\n"), f"pkg.later{number}")
    return workspace


def test_a_file_parsed_again_in_part_keeps_its_line_numbers_and_its_imports(tmp_path):
    path = write(
        tmp_path / "pkg" / "mod.py",
        """
        from pkg.state import BUF
        def unrelated():
            return 1
        @decorated
        def reset():
            BUF.zero_()
        w = (1,
             2); v = 3
        def other():
            pass
    """,
    )
    workspace = parsed_and_let_go(tmp_path, path, "pkg.mod")
    part = workspace.selected(path, "pkg.mod", lambda statement: not statement.definition or "BUF" in statement.text)
    assert part is not None and part.imports["BUF"].target == "pkg.state.BUF"
    kept = [(type(statement).__name__, statement.lineno) for statement in part.tree.body]
    assert kept == [("ImportFrom", 2), ("FunctionDef", 6), ("Assign", 8), ("Assign", 9)]
    assert part.lines[6] == "    BUF.zero_()"
    only_v = workspace.selected(path, "pkg.mod", lambda statement: statement.text.endswith("v = 3") and statement.first == 9)
    assert only_v is not None and len(only_v.tree.body) == 6  # `v` starts on the line `w` ends on: the whole file is parsed


def test_a_class_parsed_again_in_part_keeps_only_the_methods_chosen(tmp_path):
    path = write(
        tmp_path / "pkg" / "model.py",
        """
        from pkg.state import BUF
        class Model:
            \"\"\"Holds a model.\"\"\"
            size = 4
            def forward(self, x):
                return x
            @staticmethod
            def reset():
                BUF.zero_()
            def backward(self):
                pass
        @registered(BUF)
        class Quiet:
            def step(self):
                pass
        class Packed:
            a = 1; b = BUF
    """,
    )
    workspace = parsed_and_let_go(tmp_path, path, "pkg.model")
    part = workspace.selected(path, "pkg.model", lambda statement: not statement.definition or "BUF" in statement.text)
    assert part is not None and not part.bindings  # parsed in part
    model, quiet, packed = part.tree.body[1:]
    assert [(type(inner).__name__, inner.lineno) for inner in model.body] == [("Expr", 4), ("Assign", 5), ("FunctionDef", 9)]
    assert part.lines[model.body[-1].body[0].lineno - 1].strip() == "BUF.zero_()"  # lines keep their numbers
    # none chosen: a `pass` holds its place
    assert [(type(inner).__name__, inner.lineno) for inner in quiet.body] == [("Pass", 15)]
    assert len(packed.body) == 2  # statements sharing a line are kept together


def test_resolver_called_from_an_index_of_modules_names_the_global_a_function_reads():
    workspace = Workspace([FRAMEWORK])
    source = workspace.module_source("toytrain.train")
    assert source is not None
    function = function_named(source, "clip_gradients")
    scope = Scope.of(source, function)
    found = {ast.unparse(node): resolve(node, scope, workspace) for node in ast.walk(function) if isinstance(node, ast.Attribute)}
    ema = found["state._EMA_GRAD_NORM"]
    assert ema is not None
    assert (ema.tier, ema.name) == (Tier.GLOBAL, GlobalName("toytrain.state", None, "_EMA_GRAD_NORM"))


def test_module_member_follows_a_package_re_export_and_descends_into_submodules(tmp_path):
    write(tmp_path / "fw" / "__init__.py", "from . import parallel_state as mpu\n")
    write(tmp_path / "fw" / "parallel_state.py", "_X = None\n")
    write(tmp_path / "fw" / "sub" / "__init__.py", "")
    write(tmp_path / "fw" / "sub" / "inner.py", "Y = []\n")
    workspace = Workspace([tmp_path])
    assert module_named("fw.mpu", workspace) == "fw.parallel_state"
    member = module_member("fw.mpu", ("_X", None, "field"), workspace)
    assert member is not None and (member.module, member.name, member.rest) == ("fw.parallel_state", "_X", (None, "field"))
    deeper = module_member("fw", ("sub", "inner", "Y"), workspace)
    assert deeper is not None and (deeper.module, deeper.name, deeper.rest) == ("fw.sub.inner", "Y", ())
    assert module_member("missing.module", ("X",), workspace) is None


def test_imports_of_a_function_take_its_last_import_before_the_line(tmp_path):
    path = write(
        tmp_path / "adaptor.py",
        """
        import fw.parallel_state as mpu
        def rollback():
            mpu._X = None
            from fw import other_state as mpu
            mpu._X = None
    """,
    )
    source = Workspace([tmp_path]).source(path, "adaptor")
    assert source is not None
    function = function_named(source, "rollback")
    first, second = (statement.lineno for statement in function.body if isinstance(statement, ast.Assign))
    assert Imports.of(source, function, first).target("mpu") == "fw.parallel_state"
    imports = Imports.of(source, function, second)
    assert imports.target("mpu") == "fw.other_state"
    assert imports.dotted(ast.parse("mpu._X.y", mode="eval").body) == "fw.other_state._X.y"


@settings(deadline=None)  # no test depends on timing: a loaded machine may take long over an example
@given(st.text(alphabet=st.sampled_from("ab_9 \t\n.,(=\u00e9\u4e2d\uff0c\u00a0\u2028\ud800\x1c") | st.characters()))
def test_words_are_what_the_word_expression_finds_in_any_text(text):
    assert words(text) == set(re.findall(r"\w+", text))


def test_words_cut_a_piece_of_chinese_at_its_punctuation():
    assert words("x = 1  # 中文，abc_1 é\u00a0y") == {"x", "1", "中文", "abc_1", "é", "y"}
