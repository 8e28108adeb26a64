"""What an adaptor file and one of its functions bind, so that a block is written in the file's own names.

A block goes at the end of a function. It reads what the file already has (its module-level
`torch`, the repair-group getter it imports, the function's own `group` local) instead of importing
it again, and it must not rebind a name the function still needs: one it declares `global`, one a
nested function reads, one the trailing `return` reads, or one it reads as a global before the
block (any assignment in a function makes the name local to all of it).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

from unsafe_doctor.source.syntax import Function, import_bindings, names_bound, parameter_names, same_target, walk_scope


@dataclass(frozen=True)
class ModuleNames:
    """The names a file binds at module level; `imports`: name -> what it imports (`dist` ->
    `torch.distributed`; a relative import whose package is unknown keeps its dots)."""

    bound: frozenset[str]
    imports: dict[str, str]

    def local_for(self, target: str) -> str | None:
        """The module-level name the file binds `target` to (`torch.distributed` -> `dist`)."""
        return next((name for name, bound in self.imports.items() if same_target(bound, target)), None)


@dataclass(frozen=True)
class FunctionNames:
    parameters: frozenset[str]
    assigned: frozenset[str]  # every name the function binds, parameters included
    locals_before: dict[str, ast.expr]  # top-level `name = value` statements before the block, last one kept
    kept: frozenset[str]  # names a block must not rebind


def module_names(tree: ast.Module, package: str | None) -> ModuleNames:
    bound: set[str] = set()
    imports: dict[str, str] = {}
    for statement in _module_statements(tree.body):
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            targets = {name: imported.target for name, imported in import_bindings(statement, package).items()}
            if isinstance(statement, ast.ImportFrom) and statement.level and not package:
                base = "." * statement.level + (statement.module or "")
                targets = {alias.asname or alias.name: f"{base}.{alias.name}" for alias in statement.names}
            imports.update(targets)
            bound.update(targets)
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(statement.name)
            imports.pop(statement.name, None)
        elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets_of = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            for name in names_bound(targets_of):
                bound.add(name)
                imports.pop(name, None)
    return ModuleNames(frozenset(bound), imports)


def _module_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, also those under `if` / `try` (an import guarded by a version check)."""
    for statement in body:
        yield statement
        if isinstance(statement, (ast.If, ast.Try)):
            for block in (statement.body, statement.orelse, getattr(statement, "finalbody", [])):
                yield from _module_statements(block)
            for handler in getattr(statement, "handlers", []):
                yield from _module_statements(handler.body)


def function_names(function: Function, insert_line: int) -> FunctionNames:
    """`insert_line`: the 1-based line the block goes before."""
    parameters = frozenset(parameter_names(function))
    assigned: set[str] = set(parameters)
    read_before: set[str] = set()
    declared: set[str] = set()
    for node in walk_scope(function):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                if node.lineno < insert_line:
                    read_before.add(node.id)
            else:
                assigned.add(node.id)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            declared.update(node.names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            assigned.update(import_bindings(node, None) or {alias.asname or alias.name for alias in node.names})
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            assigned.add(node.name)
    nested = {
        name.id
        for node in walk_scope(function)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
        for name in ast.walk(node)
        if isinstance(name, ast.Name)
    }
    after = {
        node.id
        for statement in function.body
        if statement.lineno >= insert_line
        for node in ast.walk(statement)
        if isinstance(node, ast.Name)
    }
    locals_before: dict[str, ast.expr] = {}
    for statement in function.body:
        if statement.lineno >= insert_line:
            break
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name):
            locals_before[statement.targets[0].id] = statement.value
    kept = declared | nested | after | (read_before - assigned)
    return FunctionNames(parameters, frozenset(assigned), locals_before, frozenset(kept))


def find_function(tree: ast.Module, name: str, first_line: int) -> Function:
    """The function `name` whose `def` (or one of its decorators) is at `first_line`."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            start = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
            if start <= first_line <= node.lineno:
                return node
    raise LookupError(f"no function {name}() at line {first_line}")
