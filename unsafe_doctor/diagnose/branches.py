"""The values a local (or `self.attr`) can hold at the culprit line, when its function binds it on
more than one path: `total_input = all_gather_buffer` under `if sequence_parallel:`, else
`total_input = input`. Each is a `Route`: the value bound (None: the parameter as the caller passed
it, or the attribute as another method set it) and the `if` test that leads there.

With the function's source, a binding counts when it can reach the line: the latest binding whose
blocks all hold the line ends the search (it runs on every path to the line); later bindings in
blocks that do not hold the line are the other paths. An index's skeleton keeps no `if`, so there
every binding before the line is taken as a path, with no test.

`decided(paths, arguments)`: the paths the run's arguments dump allows, when a test reads a switch
the dump prints (`if sequence_parallel:`, `if not args.x:`, `if getattr(args, "x", False):`).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass

from unsafe_doctor.source.syntax import Function, child_statements, parameter_names

_FALSE_VALUES = frozenset({"False", "None", "0", "0.0", "", "[]", "{}"})


@dataclass(frozen=True)
class Route:
    value: ast.expr | None  # None: as the caller passed it (a parameter) or another method set it (self.attr)
    test: ast.expr | None  # the `if` test on the way to this binding; None when unconditional or unknown
    holds: bool = True  # the binding is under the test being true (False: in its `else`)

    def describe(self) -> str:
        if self.test is None:
            return "on one path"
        test = ast.unparse(self.test)
        return f"when {test}" if self.holds else f"when not ({test})"


def paths_to(function: Function, target: ast.expr, line: int, *, skeleton: bool) -> list[Route]:
    """The values `target` (a name, or `self.attr`) can hold when `line` runs; [] when the function
    binds it on one path only (the resolver's own reading then stands)."""
    bindings = [(statement, value) for statement, value in _bindings(function, target) if statement.lineno < line]
    if not bindings:
        return []
    bindings.sort(key=lambda binding: binding[0].lineno)
    if skeleton:
        return _skeleton_paths(bindings)
    blocks = _blocks(function)
    held = blocks.get(line, _holding(function, line))
    paths: list[Route] = []
    for statement, value in reversed(bindings):
        own = blocks.get(statement.lineno, ())
        if all(block in held for block in own):
            paths.append(Route(value, None))
            break
        test, holds = _deciding_test(own, held)
        paths.append(Route(value, test, holds))
    else:
        paths.append(Route(None, None))  # no binding runs on every path: the value it came in with
    if isinstance(target, ast.Name) and target.id not in parameter_names(function) and paths[-1].value is None:
        paths.pop()  # a plain local bound on some paths only: unbound on the others
    return paths if len(paths) > 1 or (paths and not isinstance(target, ast.Name)) else []


def earlier_values(function: Function, name: str, line: int) -> list[ast.expr]:
    """Every value `name` is bound to before `line` (a plain `name = value`), latest first."""
    found = [
        (statement, value) for statement, value in _bindings(function, ast.Name(name, ast.Load())) if statement.lineno < line
    ]
    return [value for _, value in sorted(found, key=lambda binding: -binding[0].lineno)]


def decided(paths: list[Route], arguments: Mapping[str, str]) -> tuple[list[Route], str | None]:
    """The paths the arguments dump allows, and the fact that decided (None: nothing did)."""
    kept, because = [], None
    for path in paths:
        switch = _switch(path.test) if path.test is not None else None
        if switch is None or switch[0] not in arguments:
            kept.append(path)
            continue
        name, negated = switch
        value = arguments[name]
        on = (value not in _FALSE_VALUES) != negated
        if on == path.holds:
            kept.append(path)
        because = f"the arguments dump says {name} = {value}"
    return (kept, because) if kept else (paths, None)


def _bindings(function: Function, target: ast.expr) -> list[tuple[ast.stmt, ast.expr]]:
    found: list[tuple[ast.stmt, ast.expr]] = []
    for statement in _statements(function.body):
        if isinstance(statement, ast.Assign) and any(_same(each, target) for each in statement.targets):
            found.append((statement, statement.value))
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None and _same(statement.target, target):
            found.append((statement, statement.value))
    return found


def _same(written: ast.expr, target: ast.expr) -> bool:
    if isinstance(target, ast.Name):
        return isinstance(written, ast.Name) and written.id == target.id
    return (
        isinstance(written, ast.Attribute)
        and isinstance(target, ast.Attribute)
        and written.attr == target.attr
        and isinstance(written.value, ast.Name)
        and isinstance(target.value, ast.Name)
        and written.value.id == target.value.id
    )


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """Every statement of a function body, nested blocks included, not nested functions or classes."""
    found = []
    for statement in body:
        found.append(statement)
        if not isinstance(statement, (Function, ast.ClassDef)):
            found.extend(_statements(child_statements(statement)))
    return found


# A block: the statement list of one branch, named by its compound statement and field.
_Block = tuple[ast.AST, str]


def _blocks(function: Function) -> dict[int, tuple[_Block, ...]]:
    """For each line that starts a statement, the blocks around it, outermost first."""
    found: dict[int, tuple[_Block, ...]] = {}

    def visit(body: list[ast.stmt], around: tuple[_Block, ...]) -> None:
        for statement in body:
            found.setdefault(statement.lineno, around)
            if isinstance(statement, (Function, ast.ClassDef)):
                continue
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(statement, field, None)
                if inner:
                    visit(inner, (*around, (statement, field)))
            for handler in getattr(statement, "handlers", ()):
                visit(handler.body, (*around, (handler, "body")))

    visit(function.body, ())
    return found


def _holding(function: Function, line: int) -> tuple[_Block, ...]:
    """The blocks around a line inside a statement (a call spread over lines): its statement's."""
    blocks = _blocks(function)
    starts = [start for start in blocks if start <= line]
    return blocks[max(starts)] if starts else ()


def _deciding_test(own: tuple[_Block, ...], held: tuple[_Block, ...]) -> tuple[ast.expr | None, bool]:
    """The test of the outermost `if` whose branch holds the binding but not the line."""
    for block in own:
        if block not in held:
            node = block[0]
            return (node.test, block[1] == "body") if isinstance(node, ast.If) else (None, True)
    return None, True


def _skeleton_paths(bindings: list[tuple[ast.stmt, ast.expr]]) -> list[Route]:
    """An index skeleton keeps no `if`: every binding before the line is a path, latest first."""
    return [Route(value, None) for _, value in reversed(bindings)] if len(bindings) > 1 else []


def _switch(test: ast.expr) -> tuple[str, bool] | None:
    """The run argument an `if` test reads, and whether it is negated: `sequence_parallel`,
    `ctx.sequence_parallel`, `args.x`, `not x`, `getattr(args, "x", default)`."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _switch(test.operand)
        return (inner[0], not inner[1]) if inner else None
    if isinstance(test, ast.Name):
        return test.id, False
    if isinstance(test, ast.Attribute):
        return test.attr, False
    if (
        isinstance(test, ast.Call)
        and isinstance(test.func, ast.Name)
        and test.func.id == "getattr"
        and len(test.args) >= 2
        and isinstance(test.args[1], ast.Constant)
        and isinstance(test.args[1].value, str)
    ):
        return test.args[1].value, False
    return None
