"""A framework file reduced to what resolving a global needs, at its own line numbers.

The framework index (`unsafe_doctor.source.index`) ships, per release and file, a *skeleton*: the
file's imports, `global` declarations, classes and functions (name, parameters, decorators, span),
and every binding (module, class and local assignments, loop and `with` targets) with its value
reduced to its kind. Each statement sits at the line it had, so a log frame's line falls in the
same function and sees the same bindings before it, and the one resolver (`source.resolve`) reads a
skeleton as it reads a file. No expression survives but reference chains (`get_tracker()`,
`parallel_state._X`): calls lose their arguments, strings their text, literals their elements.

Beside it, `line_hashes`: a 16-bit hash of each line as a traceback prints it (stripped), which is
what release fingerprinting compares a frame's printed line against.
"""

from __future__ import annotations

import ast
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from unsafe_doctor.source.syntax import Function, flatten

_INDENT = "    "
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)


def line_hash(printed: str) -> int:
    """The hash fingerprinting compares: a line as a traceback prints it, stripped."""
    return zlib.crc32(printed.strip().encode("utf-8", "replace")) & 0xFFFF


def line_hashes(text: str) -> list[int]:
    return [line_hash(line) for line in text.splitlines()]


def skeleton(text: str) -> str | None:
    """The file's skeleton (see the module docstring); None when the file does not parse."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return None
    lines = _Lines()
    _body(tree.body, 0, lines)
    result = lines.text()
    try:
        ast.parse(result)
    except SyntaxError:
        return None
    return result


@dataclass
class _Lines:
    """Statements placed at their line numbers; a second statement on a line joins the first."""

    placed: dict[int, tuple[int, str]] = field(default_factory=dict)  # line -> (depth, text)
    last: int = 0

    def put(self, line: int, depth: int, text: str) -> None:
        if line in self.placed:
            first_depth, first = self.placed[line]
            joiner = " " if first.endswith(":") else "; "
            self.placed[line] = (first_depth, first + joiner + text)
        else:
            self.placed[line] = (depth, text)
        self.last = max(self.last, line)

    def text(self) -> str:
        rows = [""] * self.last
        for line, (depth, text) in self.placed.items():
            rows[line - 1] = _INDENT * depth + text
        return "\n".join(rows) + "\n"


def _body(statements: Sequence[ast.stmt], depth: int, lines: _Lines) -> None:
    """Kept statements of a body at `depth`; compound statements other than scopes are flattened
    into it (their bindings hold whichever branch ran, as far as a resolver can tell)."""
    for statement in statements:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _function(statement, depth, lines)
        elif isinstance(statement, ast.ClassDef):
            _class(statement, depth, lines)
        else:
            for line, text in _kept(statement):
                lines.put(line, depth, text)
            _body(_nested(statement), depth, lines)


def _nested(statement: ast.stmt) -> list[ast.stmt]:
    """Statements inside a compound statement that is not a scope, handlers included."""
    found: list[ast.stmt] = []
    for name in ("body", "orelse", "finalbody"):
        found += getattr(statement, name, [])
    for handler in getattr(statement, "handlers", []):
        found += handler.body
    for case in getattr(statement, "cases", []):
        found += case.body
    return sorted(found, key=lambda node: node.lineno)


def _kept(statement: ast.stmt) -> Iterator[tuple[int, str]]:
    """The statement's skeleton lines: bindings, imports, `global`, returns of chains, and calls
    written over several lines (`_spread_call`)."""
    spread = _spread_call(statement)
    if spread:
        yield from spread
    elif isinstance(statement, (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal)):
        yield statement.lineno, ast.unparse(statement)
    elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        yield from _assignment(statement)
    elif isinstance(statement, ast.Return) and statement.value is not None:
        value = reduce_value(statement.value)
        if flatten(value) is not None:
            yield statement.lineno, f"return {ast.unparse(value)}"
    else:
        yield from _block_targets(statement)


def _spread_call(statement: ast.stmt) -> list[tuple[int, str]]:
    """A statement whose value is a call written over several lines keeps its arguments (each
    reduced), since a traceback prints only the call's first line: `x = f(` on the statement's
    line, the arguments and `)` on the next, so that it still spans lines in the skeleton (what
    tells `locate` to read it there rather than from the log)."""
    value = getattr(statement, "value", None)
    spans = (statement.end_lineno or statement.lineno) > statement.lineno
    if not spans or not isinstance(value, ast.Call) or not isinstance(statement, (ast.Expr, ast.Assign, ast.Return)):
        return []
    if flatten(value.func) is None or (isinstance(statement, ast.Assign) and not all(map(_kept_target, statement.targets))):
        return []
    if isinstance(statement, ast.Assign):
        head = " = ".join(ast.unparse(_target(target)) for target in statement.targets) + " = "
    else:
        head = "return " if isinstance(statement, ast.Return) else ""
    arguments = [ast.unparse(_argument(argument)) for argument in value.args]
    for keyword in value.keywords:
        reduced = ast.unparse(reduce_value(keyword.value))
        arguments.append(f"{keyword.arg}={reduced}" if keyword.arg else f"**{reduced}")
    callee = ast.unparse(_chain(flatten(value.func) or []))
    return [(statement.lineno, f"{head}{callee}("), (statement.lineno + 1, ", ".join(arguments) + ")")]


def _argument(argument: ast.expr) -> ast.expr:
    return ast.Starred(reduce_value(argument.value), ast.Load()) if isinstance(argument, ast.Starred) else reduce_value(argument)


def _assignment(statement: ast.Assign | ast.AnnAssign | ast.AugAssign) -> Iterator[tuple[int, str]]:
    if isinstance(statement, ast.Assign):
        targets = [target for target in statement.targets if _kept_target(target)]
        if targets:
            text = " = ".join(ast.unparse(_target(target)) for target in targets)
            yield statement.lineno, f"{text} = {ast.unparse(reduce_value(statement.value))}"
    elif isinstance(statement, ast.AnnAssign) and _kept_target(statement.target):
        value = f" = {ast.unparse(reduce_value(statement.value))}" if statement.value is not None else ""
        yield statement.lineno, f"{ast.unparse(_target(statement.target))}: object{value}"
    elif isinstance(statement, ast.AugAssign) and _kept_target(statement.target):
        yield statement.lineno, f"{ast.unparse(_target(statement.target))} += ..."


def _block_targets(statement: ast.stmt) -> Iterator[tuple[int, str]]:
    """Names a `for`, `with` or `except` binds, bound to nothing a resolver follows."""
    if isinstance(statement, (ast.For, ast.AsyncFor)):
        yield statement.lineno, f"{ast.unparse(_target(statement.target))} = None"
    elif isinstance(statement, (ast.With, ast.AsyncWith)):
        for item in statement.items:
            if item.optional_vars is not None and _kept_target(item.optional_vars):
                yield statement.lineno, f"{ast.unparse(_target(item.optional_vars))} = None"
    else:
        for handler in getattr(statement, "handlers", []):  # try, and try/except* from 3.11
            if handler.name:
                yield handler.lineno, f"{handler.name} = None"


def _kept_target(target: ast.expr) -> bool:
    """Names, tuples of them, and attributes of a name (`self.x`, `Cls.x`); not subscripts."""
    if isinstance(target, ast.Name):
        return True
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_kept_target(element) for element in target.elts)
    if isinstance(target, ast.Starred):
        return _kept_target(target.value)
    return (
        isinstance(target, ast.Attribute)
        and flatten(target) is not None
        and all(isinstance(part, (ast.Name, ast.Attribute)) for part in flatten(target) or ())
    )


def _target(target: ast.expr) -> ast.expr:
    """A target as the skeleton writes it: subscripts inside a tuple become a throwaway name."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return ast.Tuple([_target(element) for element in target.elts], ast.Store())
    if isinstance(target, ast.Starred):
        return ast.Starred(_target(target.value), ast.Store())
    return target if _kept_target(target) else ast.Name("_", ast.Store())


def reduce_value(value: ast.expr) -> ast.expr:
    """A value reduced to its kind: a reference chain without call arguments or computed keys,
    a comprehension over such a chain, a number or bool, an empty or non-empty display, `...`."""
    if isinstance(value, ast.Constant):
        if isinstance(value.value, str):
            return ast.Constant("")
        if isinstance(value.value, bytes):
            return ast.Constant(b"")
        return value if value.value is None or isinstance(value.value, (bool, int, float)) else ast.Constant(...)
    parts = flatten(value)
    if parts is not None:
        return _chain(parts)
    if isinstance(value, _COMPREHENSIONS):
        iterable = reduce_value(value.generators[0].iter)
        return ast.ListComp(ast.Name("__"), [ast.comprehension(ast.Name("__", ast.Store()), iterable, [], 0)])
    if isinstance(value, ast.Set):  # `{}` would be a dict: an empty set is only ever written set()
        return ast.Set([ast.Constant(...)])
    if isinstance(value, ast.List):
        return ast.List([ast.Constant(...)] if value.elts else [], ast.Load())
    if isinstance(value, ast.Tuple):
        return ast.Tuple([ast.Constant(...)] if value.elts else [], ast.Load())
    if isinstance(value, ast.Dict):
        return ast.Dict([ast.Constant(...)], [ast.Constant(...)]) if value.keys else ast.Dict([], [])
    if isinstance(value, ast.UnaryOp) and isinstance(value.operand, ast.Constant):
        return reduce_value(value.operand)
    return ast.Constant(...)


def _chain(parts: list[ast.expr]) -> ast.expr:
    """A reference chain rebuilt without call arguments; a subscript keeps a constant key only."""
    node: ast.expr = ast.Name(parts[0].id) if isinstance(parts[0], ast.Name) else ast.Name("_")
    for part in parts[1:]:
        if isinstance(part, ast.Attribute):
            node = ast.Attribute(node, part.attr)
        elif isinstance(part, ast.Call):
            node = ast.Call(node, [], [])
        elif isinstance(part, ast.Subscript):
            key = part.slice
            kept = key if isinstance(key, ast.Constant) and isinstance(key.value, (int, bool)) else ast.Constant(0)
            node = ast.Subscript(node, kept)
    return node


def _function(function: Function, depth: int, lines: _Lines) -> None:
    for decorator in function.decorator_list:
        reduced = _decorator(decorator)
        if reduced is not None:
            lines.put(decorator.lineno, depth, f"@{reduced}")
    keyword = "async def" if isinstance(function, ast.AsyncFunctionDef) else "def"
    lines.put(function.lineno, depth, f"{keyword} {function.name}({_parameters(function.args)}):")
    _scope_body(function, depth, lines)


def _class(cls: ast.ClassDef, depth: int, lines: _Lines) -> None:
    for decorator in cls.decorator_list:
        reduced = _decorator(decorator)
        if reduced is not None:
            lines.put(decorator.lineno, depth, f"@{reduced}")
    bases = [ast.unparse(_chain(parts)) for base in cls.bases if (parts := flatten(base)) is not None]
    lines.put(cls.lineno, depth, f"class {cls.name}({', '.join(bases)}):")
    _scope_body(cls, depth, lines)


def _scope_body(scope: Function | ast.ClassDef, depth: int, lines: _Lines) -> None:
    """The body, then `pass` at the scope's last line so that its span is the original's."""
    _body(scope.body, depth + 1, lines)
    end = scope.end_lineno or scope.lineno
    if end not in lines.placed or lines.placed[end][1].endswith(":"):
        lines.put(end, depth + 1, "pass")


def _decorator(decorator: ast.expr) -> str | None:
    """The decorator's dotted name (`functools.lru_cache`); a call keeps no arguments."""
    parts = flatten(decorator)
    if parts is None:
        return None
    return ast.unparse(_chain(parts))


def _parameters(arguments: ast.arguments) -> str:
    """Parameter names and kinds only (no defaults, no annotations); keyword-only ones get `=...`
    so that any order stays valid."""
    written: list[str] = [argument.arg for argument in arguments.posonlyargs]
    if arguments.posonlyargs:
        written.append("/")
    written += [
        argument.arg + ("=..." if _has_default(arguments, index) else "") for index, argument in enumerate(arguments.args)
    ]
    if arguments.vararg is not None:
        written.append(f"*{arguments.vararg.arg}")
    elif arguments.kwonlyargs:
        written.append("*")
    written += [f"{argument.arg}=..." for argument in arguments.kwonlyargs]
    if arguments.kwarg is not None:
        written.append(f"**{arguments.kwarg.arg}")
    return ", ".join(written)


def _has_default(arguments: ast.arguments, index: int) -> bool:
    return index >= len(arguments.args) - len(arguments.defaults)
