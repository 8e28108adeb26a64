"""Small helpers over `ast` nodes, one copy each: the statements of a block, the names statements
bind, imports, comprehensions and their loop variables, lambdas' parameters, decorators, empty
values and a node's source text."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeGuard

Function = ast.FunctionDef | ast.AsyncFunctionDef  # a `def` or `async def` node
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)  # statements that open a scope


@dataclass(frozen=True)
class ImportedName:
    """What an import binds a name to."""

    target: str  # dotted: 'megatron.core.parallel_state' or 'pkg.state.BUF'


# --- statements ------------------------------------------------------------------------------------

# fields that hold no node to walk: contexts, operators, names and flags
_NO_NODES = frozenset(
    {
        "ctx",
        "op",
        "ops",
        "id",
        "attr",
        "arg",
        "name",
        "asname",
        "module",
        "level",
        "type_comment",
        "kind",
        "is_async",
        "conversion",
        "simple",
    }
)
_NODE_FIELDS: dict[type, tuple[str, ...]] = {}  # by node type, the fields that can hold nodes (filled as types are met)


def child_nodes(node: ast.AST) -> list[ast.AST]:
    """`ast.iter_child_nodes` in the same order, as a list, without its two generators per node, and
    without the contexts and operators (`Load`, `Add`, `Is`), which hold nothing: the walks of an
    audit visit millions of nodes."""
    fields = _NODE_FIELDS.get(type(node))
    if fields is None:
        fields = _NODE_FIELDS[type(node)] = (
            () if isinstance(node, ast.Constant) else tuple(name for name in node._fields if name not in _NO_NODES)
        )
    children: list[ast.AST] = []
    for name in fields:
        value = getattr(node, name, None)
        if isinstance(value, ast.AST):
            children.append(value)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, ast.AST):
                    children.append(item)
    return children


def child_statements(statement: ast.stmt) -> list[ast.stmt]:
    """The statements of a compound statement's blocks, in source order."""
    blocks = _BLOCKS.get(type(statement))
    if blocks is None:
        blocks = _BLOCKS[type(statement)] = tuple(name for name in _BLOCK_FIELDS if name in statement._fields)
    if not blocks:
        return []  # most statements have no block: no lists to build
    bodies = [getattr(statement, name, None) or [] for name in blocks if name not in ("handlers", "cases")]
    bodies += [handler.body for handler in getattr(statement, "handlers", ())]
    bodies += [case.body for case in getattr(statement, "cases", ())]
    return [child for body in bodies for child in body if isinstance(child, ast.stmt)]


_BLOCK_FIELDS = ("body", "orelse", "finalbody", "handlers", "cases")
_BLOCKS: dict[type, tuple[str, ...]] = {}  # by statement type, the block fields it has (filled as types are met)


def scope_statements(body: Sequence[ast.stmt]) -> Iterator[ast.stmt]:
    """A scope's own statements, nested blocks included; nested functions and classes are yielded
    (they bind a name here) but not entered."""
    for statement in body:
        yield statement
        if not isinstance(statement, SCOPES):
            yield from scope_statements(child_statements(statement))


Enclosing = tuple[ast.ClassDef | Function, ...]  # the classes and functions around a function, outermost first


def functions_in(body: Sequence[ast.stmt], enclosing: Enclosing = ()) -> Iterator[tuple[Function, Enclosing]]:
    """Every function and method of a block, nested ones too, in source order, each with the classes
    and functions around it (from which each reader takes the class of `self` it needs)."""
    for statement in body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield statement, enclosing
            yield from functions_in(statement.body, (*enclosing, statement))
        elif isinstance(statement, ast.ClassDef):
            yield from functions_in(statement.body, (*enclosing, statement))
        else:
            yield from functions_in(child_statements(statement), enclosing)


def compound_header(statement: ast.stmt) -> list[ast.expr] | None:
    """What a loop, `if`, `while`, `with` or `match` evaluates on its own line, before its blocks;
    None for other statements."""
    if isinstance(statement, (ast.For, ast.AsyncFor)):
        return [statement.iter]
    if isinstance(statement, (ast.If, ast.While)):
        return [statement.test]
    if isinstance(statement, (ast.With, ast.AsyncWith)):
        return [item.context_expr for item in statement.items]
    if isinstance(statement, ast.Match):
        return [statement.subject]
    return None


def walk_scope(function: Function) -> Iterator[ast.AST]:
    """The nodes of a function's own scope: a nested function, class or lambda is yielded (it binds
    a name, or is a value, here), what is inside it is not."""
    pending: list[ast.AST] = list(function.body)
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, _OWN_SCOPES):
            pending.extend(child_nodes(node))


_OWN_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def returned_values(function: Function) -> list[ast.expr]:
    """What the function's own `return` statements hand back, in source order (a nested function's
    returns are its own): the one reader of what an accessor returns, for the resolver, the
    audit's index and walk, and the heuristics."""
    return [
        statement.value
        for statement in _in_source_order(function.body)
        if isinstance(statement, ast.Return) and statement.value is not None
    ]


def _in_source_order(body: Sequence[ast.stmt]) -> Iterator[ast.stmt]:
    """A scope's own statements as they are written (`try`'s handlers before its `else`, unlike
    `scope_statements`); statements only, cheaper than `walk_scope`."""
    for statement in body:
        yield statement
        if isinstance(statement, SCOPES):
            continue
        for name in statement._fields:
            if name in ("body", "orelse", "finalbody"):
                yield from _in_source_order(getattr(statement, name))
            elif name in ("handlers", "cases"):
                for part in getattr(statement, name):
                    yield from _in_source_order(part.body)


# --- bindings --------------------------------------------------------------------------------------


def import_bindings(statement: ast.Import | ast.ImportFrom, package: str | None) -> dict[str, ImportedName]:
    """The names an import statement binds; relative imports resolve against `package`."""
    if isinstance(statement, ast.Import):
        # `import a.b` binds `a`; `import a.b as c` binds `c` to `a.b`.
        bound = {}
        for alias in statement.names:
            top = alias.name.split(".")[0]
            bound[alias.asname or top] = ImportedName(alias.name if alias.asname else top)
        return bound
    base = statement.module or ""
    if statement.level:
        if not package:
            return {}
        kept = package.split(".")[: len(package.split(".")) - statement.level + 1]
        base = ".".join([*kept, *([statement.module] if statement.module else [])])
    return {
        alias.asname or alias.name: ImportedName(f"{base}.{alias.name}" if base else alias.name)
        for alias in statement.names
        if alias.name != "*"
    }


def same_target(bound: str, wanted: str) -> bool:
    """An import that binds `bound` imports `wanted`: the same dotted name, or a relative import whose
    package is unknown (`.tft_replica_group.get_repair_group`) and whose tail is `wanted`'s."""
    if bound == wanted:
        return True
    tail = bound.lstrip(".")
    return bound.startswith(".") and bool(tail) and wanted.endswith("." + tail)


def names_bound(targets: Sequence[ast.expr]) -> Iterator[str]:
    """The plain names assignment targets bind (`a, (b, *c) = ...`); not attributes or subscripts."""
    for target in targets:
        if isinstance(target, ast.Name):
            yield target.id
        elif isinstance(target, (ast.Tuple, ast.List)):
            yield from names_bound(target.elts)
        elif isinstance(target, ast.Starred):
            yield from names_bound([target.value])


def parameter_names(function: Function | ast.Lambda) -> set[str]:
    """Every name the function's parameters bind, `*args` and `**kwargs` included."""
    arguments = function.args
    every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]
    return {argument.arg for argument in every if argument is not None}


def flatten(node: ast.expr) -> list[ast.expr] | None:
    """`a.b[c]()` -> [a, a.b, a.b[c], a.b[c]()]: each part wraps the one before; None unless rooted at a name."""
    parts: list[ast.expr] = []
    while True:
        parts.append(node)
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Name):
            return parts[::-1]
        else:
            return None


def declared_globals(function: Function) -> set[str]:
    return {name for node in walk_scope(function) if isinstance(node, ast.Global) for name in node.names}


OPAQUE = ast.Constant(value=None)  # bound locally by something not worth following (loop target, `with ... as`)


def local_binding(function: Function, name: str, line: int | None, package: str | None) -> ast.expr | ImportedName | None:
    """The last binding of `name` in the function up to `line` (any line when None, or when all are
    after it): the assigned value (for `a, b = chain`, the chain), an import (relative to
    `package`), `OPAQUE`, or None when the function does not bind it."""
    bindings: list[tuple[int, ast.expr | ImportedName]] = []
    for node in walk_scope(function):
        if isinstance(node, ast.Assign) and name in names_bound(node.targets):
            simple = any(isinstance(target, ast.Name) and target.id == name for target in node.targets)
            bindings.append((node.lineno, node.value if simple or _unpacked_from_chain(node, name) else OPAQUE))
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and getattr(node.target, "id", None) == name:
            if node.value is not None:
                bindings.append((node.lineno, node.value))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported = import_bindings(node, package).get(name)
            if imported is not None:
                bindings.append((node.lineno, imported))
        elif isinstance(node, (ast.For, ast.AsyncFor)) and name in names_bound([node.target]):
            bindings.append((node.lineno, OPAQUE))
        elif isinstance(node, (ast.With, ast.AsyncWith)) and name in names_bound(
            [item.optional_vars for item in node.items if item.optional_vars is not None]
        ):
            bindings.append((node.lineno, OPAQUE))
        elif isinstance(node, ast.ExceptHandler) and node.name == name:
            bindings.append((node.lineno, OPAQUE))
    if not bindings:
        return None
    before = [binding for binding in bindings if line is None or binding[0] <= line] or bindings
    return max(before, key=lambda binding: binding[0])[1]


def _unpacked_from_chain(assignment: ast.Assign, name: str) -> bool:
    """`cos, sin = rope_cache(n)`: the name is an element of what a reference chain holds, which
    stands for it (a tuple of values, `a, b = x, y`, or a starred target does not)."""
    unpacked = any(
        isinstance(target, (ast.Tuple, ast.List))
        and any(isinstance(element, ast.Name) and element.id == name for element in target.elts)
        for target in assignment.targets
    )
    return unpacked and flatten(assignment.value) is not None


# --- comprehensions --------------------------------------------------------------------------------

Comprehension = ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)

# The frames a comprehension runs in, as a traceback names them (before Python 3.12 all four have
# their own; from 3.12 only a generator expression does, the others run inline).
COMPREHENSION_FRAMES: dict[str, type[Comprehension]] = {
    "<genexpr>": ast.GeneratorExp,
    "<listcomp>": ast.ListComp,
    "<setcomp>": ast.SetComp,
    "<dictcomp>": ast.DictComp,
}


def _elements(comprehension: Comprehension) -> list[ast.expr]:
    """What a comprehension makes of each element: `elt`, or a dict comprehension's key and value."""
    if isinstance(comprehension, ast.DictComp):
        return [comprehension.key, comprehension.value]
    return [comprehension.elt]


def comprehension_element(value: ast.expr) -> ast.expr:
    """What each element of a comprehension is (a dict comprehension's value); any other value itself."""
    return _elements(value)[-1] if isinstance(value, _COMPREHENSIONS) else value


def comprehension_body(comprehension: Comprehension) -> list[ast.expr]:
    """What a comprehension evaluates in its own frame, in source order: its element, then each
    `for` target and condition, and the iterables after the first (the enclosing code evaluates the
    first and passes it in)."""
    reads = _elements(comprehension)
    for position, generator in enumerate(comprehension.generators):
        reads += [*([generator.iter] if position else []), generator.target, *generator.ifs]
    return reads


def loop_iterable(root: ast.AST, name: ast.Name) -> ast.expr | None:
    """The iterable `name` (a node inside `root`) draws its elements from, when the innermost
    comprehension around it binds it with a `for` target (`for k, v in X.items()`: both from
    `X.items()`); None when `name` is not a comprehension's loop variable."""
    found = None
    for node in ast.walk(root):  # breadth first: a nested comprehension comes after its outer one
        if isinstance(node, _COMPREHENSIONS):
            found = _drawn_from(node, name) or found
    return found


def _drawn_from(comprehension: Comprehension, name: ast.Name) -> ast.expr | None:
    """The iterable of the last `for` of `comprehension` that binds `name` where it is written."""
    binder = None
    for generator in comprehension.generators:
        if _inside(generator.iter, name):
            return binder  # only the `for`s before this one have bound names
        if name.id in names_bound([generator.target]):
            binder = generator.iter
        if _inside(generator.target, name) or any(_inside(condition, name) for condition in generator.ifs):
            return binder
    return binder if any(_inside(element, name) for element in _elements(comprehension)) else None


def is_lambda_parameter(root: ast.AST, name: ast.Name) -> bool:
    """`name` (a node inside `root`) is a parameter of a lambda it is written in: what the lambda
    is called with, which its line does not say."""
    return any(
        isinstance(node, ast.Lambda) and name.id in parameter_names(node) and _inside(node.body, name) for node in ast.walk(root)
    )


def _inside(node: ast.AST, name: ast.Name) -> bool:
    return any(child is name for child in ast.walk(node))


# --- calls, decorators, values ---------------------------------------------------------------------


def callee_name(func: ast.expr) -> str | None:
    """The name a call or decorator uses: `f` for `f(...)`, `g` for `mod.g(...)`."""
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def dotted_name(node: ast.AST) -> str | None:
    """`a.b.c` for a name or an attribute chain on one, as written (no import followed); None for
    anything else (`f().x`, `a[0].x`)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted_name(node.value)
        return f"{base}.{node.attr}" if base is not None else None
    return None


def decorator_name(decorator: ast.expr) -> str | None:
    """`lru_cache` for `@lru_cache`, `@functools.lru_cache(maxsize=8)` and `@cache`-like forms."""
    return callee_name(decorator.func if isinstance(decorator, ast.Call) else decorator)


_CACHE_DECORATORS = frozenset({"lru_cache", "cache"})


def is_cache_decorator(decorator: ast.expr) -> bool:
    """functools' `lru_cache` / `cache`, called or not, by any module path."""
    return decorator_name(decorator) in _CACHE_DECORATORS


def is_cached(node: ast.AST) -> TypeGuard[Function]:
    """A function decorated with functools' `lru_cache` / `cache`: its results are kept across calls."""
    return isinstance(node, Function) and any(is_cache_decorator(decorator) for decorator in node.decorator_list)


_CONTAINER_TYPES = frozenset({"list", "dict", "set", "OrderedDict", "defaultdict", "deque"})


def is_empty_container(value: ast.expr | None) -> bool:
    """A new empty mutable container: `[]`, `{}`, `set()`, `deque()`, ... (one `.clear()` empties in place)."""
    if isinstance(value, (ast.List, ast.Set)):
        return not value.elts
    if isinstance(value, ast.Dict):
        return not value.keys
    if isinstance(value, ast.Call) and not value.args and not value.keywords:
        return callee_name(value.func) in _CONTAINER_TYPES
    return False


def is_empty_value(value: ast.expr | None) -> bool:
    """`None`, `()` or a new empty container: a value that holds no tensor."""
    if isinstance(value, ast.Constant):
        return value.value is None
    if isinstance(value, ast.Tuple):
        return not value.elts
    return is_empty_container(value)


# --- source text -----------------------------------------------------------------------------------

_LINE_ENDS = re.compile(r"(?<=\r\n)|(?<=\r)(?!\n)|(?<=\n)")


@lru_cache(maxsize=16)
def _lines(text: str) -> list[str]:
    """The text's lines with their ends, as Python counts lines (`\\r\\n`, `\\r`, `\\n`)."""
    if "\r" in text:
        return _LINE_ENDS.split(text)
    lines = text.split("\n")  # most files: split by `split`, many times faster than by a pattern
    return [line + "\n" for line in lines[:-1]] + lines[-1:]


def source_segment(text: str, node: object) -> str | None:
    """`ast.get_source_segment` without re-splitting a large file on every call; `node`: anything
    with a node's four positions."""
    first, last = getattr(node, "lineno", 0) - 1, getattr(node, "end_lineno", None)
    start, end = getattr(node, "col_offset", 0), getattr(node, "end_col_offset", None)
    lines = _lines(text)
    if first < 0 or last is None or end is None or last - 1 >= len(lines):
        return None
    last -= 1
    if first == last:
        return lines[first].encode()[start:end].decode(errors="replace")
    head = lines[first].encode()[start:].decode(errors="replace")
    tail = lines[last].encode()[:end].decode(errors="replace")
    return head + "".join(lines[first + 1 : last]) + tail


def one_line(text: str) -> str:
    """A multi-line expression's text on one line: each line break, with the blank space around it, one
    space. Cut at the breaks, as a regular expression searched over a long run of spaces (in a string) is quadratic."""
    if "\n" not in text:
        return text
    first, *middle, last = text.split("\n")
    return " ".join([first.rstrip(), *(line.strip() for line in middle if not line.isspace() and line), last.lstrip()])


def word_starts(text: str, word: str) -> Iterator[int]:
    """Where the text spells `word` as a word (as `\\b` bounds it), found by `find`: a regular
    expression's word boundaries take longer than parsing the file."""
    start = text.find(word)
    while start != -1:
        end = start + len(word)
        if not (_in_word(text, start - 1) or _in_word(text, end)):
            yield start
        start = text.find(word, end)


def _in_word(text: str, at: int) -> bool:
    return 0 <= at < len(text) and (text[at].isalnum() or text[at] == "_")


def words(text: str) -> set[str]:
    """The words a text spells (what `\\w+` finds), at a third of the expression's cost: ASCII
    punctuation is made spaces by a byte table and the text split; only a piece that holds other
    characters (a comment in Chinese, `中文，abc`) is cut by the expression."""
    pieces = set(text.encode("utf-8", "surrogatepass").translate(_ASCII_NOT_WORD).split())
    found = {piece.decode("ascii") for piece in pieces if piece.isascii()}
    for piece in pieces:
        if not piece.isascii():
            found.update(_WORD.findall(piece.decode("utf-8", "surrogatepass")))
    return found


_WORD = re.compile(r"\w+")
_ASCII_PUNCTUATION = bytes(code for code in range(128) if not (chr(code).isalnum() or chr(code) == "_"))  # and spaces
_ASCII_NOT_WORD = bytes.maketrans(_ASCII_PUNCTUATION, b" " * len(_ASCII_PUNCTUATION))


def word_lines(text: str, word: str) -> list[int]:
    """The lines on which the text spells `word` as a word."""
    lines: list[int] = []
    line, counted = 1, 0
    for start in word_starts(text, word):
        line += text.count("\n", counted, start)
        counted = start
        lines.append(line)
    return lines
