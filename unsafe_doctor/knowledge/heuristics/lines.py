"""Scenario evidence when the source says nothing (no file here, or the index's skeleton, which
keeps no `if` and no reset): what the culprit's printed line itself shows, and the accessor that
builds the global, as the index keeps it.

* **self-update** (2): the line rebinds the global from its own value (`_X = 0.9 * _X + v`,
  `_X += v`, `_X.mul_(d).add_(v)`): a value carried from step to step.
* **ring buffer** (2): the line reads the global at an index taken modulo something
  (`_HIST[(step - 1) % N]`): past steps' values, read to decide this one.
* **lazily built** (1), read from the index only: a function declares the global, binds it and
  returns it, and nothing else in its module binds it but a `None` at module level
  (`get_rotation_matrix()`): a framework value built on first use, rebuilt when set back to None.
  With the file itself the source heuristics read the builder and decide.

Each gives a low confidence: one line cannot show a reset elsewhere (for 2) or a write elsewhere (for 1).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Literal

from unsafe_doctor.knowledge.subject import Evidence, Subject, TensorRef
from unsafe_doctor.source.printed import parse_printed_line
from unsafe_doctor.source.syntax import Function, declared_globals, walk_scope
from unsafe_doctor.source.workspace import Workspace

_IN_PLACE_UPDATES = frozenset({"mul_", "add_", "lerp_", "addcmul_", "sub_", "div_", "mul", "add", "lerp"})


@dataclass(frozen=True)
class LineVerdict:
    scenario: Literal[1, 2]
    reason: str
    evidence: Evidence


def from_the_line(subject: Subject, tensor: TensorRef, workspace: Workspace) -> LineVerdict | None:
    frame = subject.frame
    variable = tensor.name.variable or ""
    if frame is not None and frame.source:
        parsed = parse_printed_line(frame.source)
        statement = parsed[0] if parsed else None
        where = Evidence(frame.file, frame.line or 0, (frame.source.strip().splitlines() or [""])[0])
        if statement is not None and _updates_itself(statement, variable):
            return LineVerdict(
                2,
                f"{variable} is updated from its own previous value on the culprit line: a value carried into the next iteration",
                where,
            )
        if statement is not None and _ring_read(statement, variable):
            return LineVerdict(
                2,
                f"{variable} is read at an index taken modulo its length on the culprit line: "
                "a ring buffer of past iterations' values",
                where,
            )
    return _lazily_built(tensor, variable, workspace)


def _names(node: ast.AST, variable: str) -> bool:
    return any(
        isinstance(each, ast.Name) and each.id == variable or isinstance(each, ast.Attribute) and each.attr == variable
        for each in ast.walk(node)
    )


def _is(node: ast.expr, variable: str) -> bool:
    return isinstance(node, ast.Name) and node.id == variable or isinstance(node, ast.Attribute) and node.attr == variable


def _updates_itself(statement: ast.stmt, variable: str) -> bool:
    if isinstance(statement, ast.AugAssign):
        return _is(statement.target, variable)
    if isinstance(statement, ast.Assign) and any(_is(target, variable) for target in statement.targets):
        return _names(statement.value, variable)
    for node in ast.walk(statement):  # `_X.mul_(d).add_(v)`: a method chain on the global itself
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _IN_PLACE_UPDATES:
            receiver = node.func.value
            while isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Attribute):
                receiver = receiver.func.value
            if _is(receiver, variable) and node.func.attr.endswith("_"):
                return True
    return False


def _ring_read(statement: ast.stmt, variable: str) -> bool:
    return any(
        isinstance(node, ast.Subscript)
        and _is(node.value, variable)
        and any(isinstance(part, ast.BinOp) and isinstance(part.op, ast.Mod) for part in ast.walk(node.slice))
        for node in ast.walk(statement)
    )


def _lazily_built(tensor: TensorRef, variable: str, workspace: Workspace) -> LineVerdict | None:
    source = workspace.module_source(tensor.name.module) if tensor.name.module and variable else None
    if source is None or tensor.name.owner is not None or not workspace.is_indexed(source.path):
        return None  # with the file itself the source heuristics have read the builder: they decide
    initial = source.bindings.get(variable)
    if not isinstance(initial, ast.Assign) or not (isinstance(initial.value, ast.Constant) and initial.value.value is None):
        return None
    builders = [
        node
        for node in ast.walk(source.tree)
        if isinstance(node, Function) and variable in declared_globals(node) and _binds(node, variable)
    ]
    if len(builders) != 1 or not _returns(builders[0], variable):
        return None
    builder = builders[0]
    evidence = Evidence(str(source.path), builder.lineno, f"def {builder.name}(): builds {variable} on first use")
    return LineVerdict(
        1,
        f"{variable} is built on first use by {builder.name}() and returned as is: a value that "
        "does not change with the iterations, rebuilt once set back to None",
        evidence,
    )


def _binds(function: Function, variable: str) -> bool:
    return any(
        isinstance(node, ast.Assign) and any(_is(target, variable) for target in node.targets) for node in walk_scope(function)
    )


def _returns(function: Function, variable: str) -> bool:
    return any(
        isinstance(node, ast.Return) and node.value is not None and _is(node.value, variable) for node in walk_scope(function)
    )
