"""A fix block run in its function's scope, when the function's own code cannot run here.

The real adaptors' own repair serialises the optimizer to the NPU (``.to('npu')``), which no
stand-in can run; the fix blocks beside it can. The function is rebuilt from the patched file with
its signature, the statements of its body that bind names the blocks read (``group =
get_repair_group()``), and the blocks, at their own lines, and defined in the adaptor module's
namespace: the blocks read the module's own ``torch``, ``dist`` and imports, as in the job.
"""

from __future__ import annotations

import ast
import types
from collections.abc import Callable, Iterable
from typing import cast


def scoped_function(
    module: types.ModuleType, text: str, path: str, name: str, block_lines: Iterable[tuple[int, int]], *, bound: frozenset[str]
) -> types.FunctionType:
    """Function ``name`` of ``text`` cut to its fix blocks (first, last line) and the bindings they need;
    the names in ``bound`` (the group the replay gives) become parameters instead."""
    spans = list(block_lines)
    tree = ast.parse(text, path)
    function = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name == name
        and any(node.lineno <= first <= (node.end_lineno or first) for first, _ in spans)
    )

    def in_block(statement: ast.stmt) -> bool:
        return any(first <= statement.lineno <= last for first, last in spans)

    blocks = _outermost(function.body, in_block)
    needed = _reads(blocks)
    kept: list[ast.stmt] = []
    for statement in reversed([item for item in function.body if not in_block(item)]):
        names = _binds(statement)
        if names & needed and not names & bound:
            kept.insert(0, statement)
            needed |= _reads([statement])
    function.body = sorted(kept + blocks, key=lambda statement: statement.lineno)
    function.decorator_list = []
    function.args.kwonlyargs += [ast.arg(local) for local in sorted(bound)]
    function.args.kw_defaults += [ast.Constant(None) for _ in bound]
    namespace: dict[str, object] = {}
    tree = ast.fix_missing_locations(ast.Module([function], []))
    exec(compile(tree, path, "exec"), vars(module), namespace)  # noqa: S102 (the user's adaptor)
    return cast(types.FunctionType, namespace[name])


def _outermost(body: list[ast.stmt], inside: Callable[[ast.stmt], bool]) -> list[ast.stmt]:
    """The statements inside a block, outermost first: a block placed in a ``with`` or ``if`` of the
    function's own is found there."""
    found = []
    for statement in body:
        if inside(statement):
            found.append(statement)
            continue
        for field in ("body", "orelse", "finalbody"):
            found += _outermost(getattr(statement, field, []), inside)
        for handler in getattr(statement, "handlers", []):
            found += _outermost(handler.body, inside)
    return found


def _reads(statements: list[ast.stmt]) -> set[str]:
    return {
        node.id
        for statement in statements
        for node in ast.walk(statement)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    }


def _binds(statement: ast.stmt) -> set[str]:
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).partition(".")[0] for alias in statement.names}
    if isinstance(statement, (ast.Assign, ast.AnnAssign)):
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        return {node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name)}
    return set()
