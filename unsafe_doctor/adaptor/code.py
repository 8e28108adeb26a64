"""The user's recovery adaptor as code: its files, their functions, the blocks unsafe-doctor wrote.

The adaptor is the file given (or found by the adaptor profile) and the profile's sibling files
beside it. Each is read once as bytes and parsed with `ast`, so that an edit can be spliced in at
a line boundary: for every function, the line a block goes before (a trailing `return`, else the
end of the body), its indentation, parameters, early returns and the process group it builds
itself. Blocks are read back between their `# unsafe-doctor: begin/end <key>` markers.
"""

from __future__ import annotations

import ast
import tokenize
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from unsafe_doctor.adaptor.own_names import FunctionNames, ModuleNames, find_function, function_names, module_names
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.render.template import INDENT
from unsafe_doctor.knowledge.versions import Environment, profile_files
from unsafe_doctor.recovery_code.model import Role
from unsafe_doctor.source.files import package_of, shown_path
from unsafe_doctor.source.markers import MARKER_END, SENTINEL_KEYS, markers
from unsafe_doctor.source.syntax import SCOPES, Function, callee_name
from unsafe_doctor.source.workspace import module_from_path

ROLES: tuple[Role, ...] = ("rollback", "send", "recv")


def adaptor_files(environment: Environment) -> list[Path]:
    adaptor = environment.adaptor
    if adaptor is None:
        globs = ", ".join(environment.profile.files)
        raise UsageError(f"no adaptor file found ({globs} under the source roots): give --adaptor FILE or --source-root DIR")
    siblings = [path for path in profile_files(environment.profile, adaptor) if path != adaptor.resolve()]
    return [adaptor, *(shown_path(path) for path in siblings)]


@dataclass(frozen=True)
class AdaptorFunction:
    name: str
    path: Path
    first_line: int  # 1-based, the `def` line
    last_line: int  # 1-based, the comments after the body indented into it included: a block's end marker trails the body
    parameters: frozenset[str]
    indent: str  # the body's indentation
    unit: str  # one indentation level of this function
    insert_at: int | None  # 0-based index of the line a block goes before; None for a one-line body
    early_returns: tuple[int, ...]  # lines of returns other than a trailing one
    own_group: str | None  # local name of a process group the function builds with new_group()


@dataclass(frozen=True)
class AdaptorClass:
    """A `class` statement's lines, counted as a function's are: a block never crosses one."""

    name: str
    first_line: int  # 1-based, the `class` line
    last_line: int  # 1-based, the comments after the body indented into it included


@dataclass(frozen=True)
class AdaptorSource:
    path: Path
    shown: str
    data: bytes
    encoding: str  # as Python reads the file: PEP 263 coding line, BOM (utf-8-sig), else utf-8
    newline: str
    lines: tuple[bytes, ...]  # with their line endings
    functions: tuple[AdaptorFunction, ...]  # top to bottom
    classes: tuple[AdaptorClass, ...]  # top to bottom

    @property
    def scopes(self) -> tuple[AdaptorFunction | AdaptorClass, ...]:
        """Every def and class: a block lies in one function's body and crosses no def or class line."""
        return (*self.functions, *self.classes)

    def encode(self, text: str) -> bytes:
        """Text for the middle of the file: a BOM belongs only at its start."""
        return text.encode("utf-8" if self.encoding == "utf-8-sig" else self.encoding)


@dataclass(frozen=True)
class BlockSite:
    """The function a block goes into, with what it and its file bind."""

    function: AdaptorFunction
    module: ModuleNames
    names: FunctionNames


class Adaptor:
    """The adaptor's files, each read and parsed once."""

    def __init__(self, paths: list[Path], source_roots: Sequence[Path] = ()):
        self.paths = paths
        self.source_roots = tuple(source_roots)
        self._sources: dict[Path, AdaptorSource] = {}
        self._trees: dict[Path, tuple[ast.Module, ModuleNames]] = {}

    def source(self, path: Path) -> AdaptorSource:
        if path not in self._sources:
            self._sources[path] = read_adaptor_file(path)
        return self._sources[path]

    def site(self, function: AdaptorFunction) -> BlockSite:
        """The function with its file's module-level names and its own, for a block at its insertion point."""
        if function.path not in self._trees:
            source = self.source(function.path)
            tree = ast.parse(source.data.decode(source.encoding))
            module = module_from_path(str(function.path.resolve()), self.source_roots)
            self._trees[function.path] = (tree, module_names(tree, package_of(function.path, module)))
        tree, names = self._trees[function.path]
        assert function.insert_at is not None, "Adaptor.function refuses a function whose body is on its `def` line"
        node = find_function(tree, function.name, function.first_line)
        return BlockSite(function, names, function_names(node, function.insert_at + 1))

    def function(self, name: str, role: Role) -> AdaptorFunction:
        """The one function of that name in the adaptor's files; refuses zero or several."""
        found = [function for path in self.paths for function in self.source(path).functions if function.name == name]
        if not found:
            present = sorted({function.name for path in self.paths for function in self.source(path).functions})
            listed = ", ".join(present[:12]) + (", ..." if len(present) > 12 else "") if present else "none"
            raise UsageError(
                f"no {role} function {name}() in {', '.join(map(str, self.paths))} (functions there: {listed}); "
                f"name it with --function {role}=NAME"
            )
        if len(found) > 1:
            places = ", ".join(f"{function.path}:{function.first_line}" for function in found)
            raise UsageError(f"several functions named {name}() ({places}): cannot tell which is the {role} function")
        function = found[0]
        if function.insert_at is None:
            raise UsageError(
                f"{function.path}:{function.first_line}: {name}() has its body on the `def` line; put it on lines of its own"
            )
        return function


def read_adaptor_file(path: Path) -> AdaptorSource:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise UsageError(f"cannot read adaptor {path}: {error.strerror or error}") from None
    return _parsed_source(path, data)


def detached_site(name: str, parameters: Sequence[str]) -> BlockSite:
    """A function of that name and those parameters, alone in a file that binds nothing: where a
    block goes that is to be pasted at the end of the user's function, with no adaptor at hand."""
    text = f"def {name}({', '.join(parameters)}):\n    pass\n"
    source = _parsed_source(Path(f"{name}.py"), text.encode())
    [function] = source.functions
    tree = ast.parse(text)
    assert function.insert_at is not None
    return BlockSite(function, module_names(tree, None), function_names(find_function(tree, name, 1), function.insert_at + 1))


def _parsed_source(path: Path, data: bytes) -> AdaptorSource:
    lines = tuple(data.splitlines(keepends=True))  # where Python ends lines: LF, CRLF and a lone CR
    try:
        # the coding line looked for in the lines as Python counts them (a BytesIO splits at LF alone)
        encoding, _ = tokenize.detect_encoding(iter(lines).__next__)
        text = data.decode(encoding)
        tree = ast.parse(text)
    except (SyntaxError, ValueError, UnicodeDecodeError, LookupError, RecursionError, MemoryError) as error:
        raise UsageError(f"adaptor {path} is not valid Python: {str(error).splitlines()[0]}") from None
    text_lines = [line.decode(encoding) for line in lines]
    scopes = list(_scopes(tree))
    functions = tuple(_describe(node, text_lines, path) for node in scopes if not isinstance(node, ast.ClassDef))
    classes = tuple(
        AdaptorClass(node.name, node.lineno, _last_line(node, text_lines)) for node in scopes if isinstance(node, ast.ClassDef)
    )
    return AdaptorSource(path, str(path), data, encoding, _newline(lines), lines, functions, classes)


def _last_line(node: Function | ast.ClassDef, text_lines: list[str]) -> int:
    """The 1-based last line of a def or class, with the comment lines after its body that are
    indented deeper than its header: a block's end marker trails the body's last statement."""
    depth = len(_indent(text_lines[node.lineno - 1]))
    last = node.end_lineno or node.lineno
    for index in range(last, len(text_lines)):
        line = text_lines[index]
        if not line.strip():
            continue
        if not line.lstrip().startswith("#") or len(_indent(line)) <= depth:
            break
        last = index + 1
    return last


def _newline(lines: Sequence[bytes]) -> str:
    for line in lines:
        for ending in ("\r\n", "\n", "\r"):
            if line.endswith(ending.encode()):
                return ending
    return "\n"


_TRY = (ast.Try, *((ast.TryStar,) if hasattr(ast, "TryStar") else ()))  # try/except* from Python 3.11


def _scopes(node: ast.AST) -> Iterator[Function | ast.ClassDef]:
    """Every def and class of the tree, top to bottom (one before those it defines)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, SCOPES):
            yield child
        yield from _scopes(child)


def _returns(node: ast.AST) -> Iterator[ast.Return]:
    """Returns of one function, not those of the functions and classes it defines."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Return):
            yield child
        elif not isinstance(child, SCOPES):
            yield from _returns(child)


def _describe(node: Function, text_lines: list[str], path: Path) -> AdaptorFunction:
    """Where a block goes in this function, how it is indented, what the function takes."""
    parameters = frozenset(_parameter_names(node.args))
    first_line, last_line = node.lineno, _last_line(node, text_lines)
    body = node.body
    if _shares_line(body[0], text_lines):  # `def f(): pass`: no line of its own to put a block before
        return AdaptorFunction(node.name, path, first_line, last_line, parameters, "", INDENT, None, (), None)
    indent = _indent(text_lines[body[0].lineno - 1])
    def_indent = _indent(text_lines[first_line - 1])
    unit = indent[len(def_indent) :] if indent.startswith(def_indent) and len(indent) > len(def_indent) else INDENT
    last_row = [statement for statement in body if statement.lineno == body[-1].lineno]
    trailing = [statement for statement in last_row if isinstance(statement, ast.Return)]
    if trailing:
        before = body[len(body) - len(last_row) - 1] if len(body) > len(last_row) else None
        insert_at = last_row[0].lineno - 1 - _leading_lines(text_lines, last_row[0].lineno, before)
    else:
        insert_at = body[-1].end_lineno or body[-1].lineno
    early = tuple(ret.lineno for ret in _returns(node) if ret not in trailing)
    group = _own_group(body)
    return AdaptorFunction(node.name, path, first_line, last_line, parameters, indent, unit, insert_at, early, group)


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _shares_line(statement: ast.stmt, text_lines: list[str]) -> bool:
    """Whether code comes before the statement on its line (the `def` or another statement)."""
    prefix = text_lines[statement.lineno - 1].encode()[: statement.col_offset]  # ast counts UTF-8 bytes
    return bool(prefix.strip())


def _leading_lines(text_lines: list[str], line: int, before: ast.stmt | None) -> int:
    """How many blank and comment lines just above `line` (1-based) go with the statement there, not
    with the block the statement before it ends in: a comment indented as deep as that block, and
    all above it, stay with the block, so that a fix goes between the block and the return's own
    comments."""
    if before is not None:
        first = before.end_lineno or before.lineno  # 0-based index of the line after it
    else:
        first = line - 1
        while first > 0 and _blank_or_comment(text_lines[first - 1]):
            first -= 1
    between = range(first, line - 1)
    depth = _last_block_indent(before, text_lines) if before is not None else None
    if depth is not None:
        deep = [index for index in between if _as_deep(text_lines[index], depth)]
        if deep:
            return line - 2 - deep[-1]
    return len(between)


def _as_deep(line: str, depth: str) -> bool:
    """A comment, or a line of spaces alone, indented at least `depth`."""
    content = line.rstrip("\r\n")
    code = content.lstrip()
    return (code.startswith("#") or (not code and bool(content))) and len(content) - len(code) >= len(depth)


def _blank_or_comment(line: str) -> bool:
    stripped = line.strip()
    return not stripped or stripped.startswith("#")


def _last_block_indent(statement: ast.stmt, text_lines: list[str]) -> str | None:
    """The indentation of the indented block a compound statement ends in (`else:`'s for an if that
    has one); None for a simple statement or one whose last block sits on its header's line."""
    block: list[ast.stmt] | None = None
    if isinstance(statement, ast.If):
        if statement.orelse and text_lines[statement.orelse[0].lineno - 1].lstrip().startswith("elif"):
            return _last_block_indent(statement.orelse[0], text_lines)
        block = statement.orelse or statement.body
    elif isinstance(statement, (ast.For, ast.AsyncFor, ast.While)):
        block = statement.orelse or statement.body
    elif isinstance(statement, _TRY):
        block = statement.finalbody or statement.orelse or (statement.handlers[-1].body if statement.handlers else statement.body)
    elif isinstance(statement, ast.Match):  # its block is that of the `case` lines
        return _indent(text_lines[statement.cases[0].pattern.lineno - 1])
    elif isinstance(statement, (ast.With, ast.AsyncWith, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        block = statement.body
    if not block or _shares_line(block[0], text_lines):
        return None
    return _indent(text_lines[block[0].lineno - 1])


def _parameter_names(arguments: ast.arguments) -> Iterable[str]:
    for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg):
        if argument is not None:
            yield argument.arg


def _own_group(body: Sequence[ast.stmt]) -> str | None:
    """The local a function binds to a process group it builds itself (`g = dist.new_group(...)`):
    the repair traffic of that adaptor goes over it, whatever the profile's group getter says."""
    rows = Counter(statement.lineno for statement in body)
    names = []
    for statement in body:
        if (
            isinstance(statement, ast.Assign)
            and rows[statement.lineno] == 1
            and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name)
            and isinstance(statement.value, ast.Call)
            and callee_name(statement.value.func) == "new_group"
        ):
            names.append(statement.targets[0].id)
    return names[-1] if names else None


@dataclass(frozen=True)
class BlockSpan:
    key: str
    begin: int  # 0-based index of the begin marker's line
    end: int  # 0-based index of the end marker's line


def block_spans(source: AdaptorSource) -> list[BlockSpan]:
    """The blocks between their markers, top to bottom; refuses a file where any marker is out of place.

    A begin must be followed by its own end before any other marker: a lost end (a hand edit, a
    merge) must not pair a begin with the next block's end, which would take the user's code in
    between out with the blocks."""
    spans: list[BlockSpan] = []
    open_key: str | None = None
    opened = 0
    for marker in markers(source.data.decode(source.encoding)):
        where = f"{source.shown}:{marker.line + 1}"
        if marker.begins:
            if open_key is not None:
                raise UsageError(
                    f"{where}: a begin marker inside block {open_key} (line {opened + 1}), whose end is missing: "
                    "mend the markers by hand"
                )
            open_key, opened = marker.key, marker.line
        else:
            if open_key is None:
                raise UsageError(f"{where}: end marker of block {marker.key} without its begin: mend the markers by hand")
            if marker.key != open_key:
                raise UsageError(
                    f"{where}: end marker of block {marker.key} inside block {open_key} (line {opened + 1}): "
                    "mend the markers by hand"
                )
            _check_inside_one_function(source, marker.key, opened, marker.line)
            spans.append(BlockSpan(marker.key, opened, marker.line))
            open_key = None
    if open_key is not None:
        raise UsageError(
            f"{source.shown}:{opened + 1}: block {open_key} has no end marker ({MARKER_END}{open_key}): mend the markers by hand"
        )
    return spans


def _check_inside_one_function(source: AdaptorSource, key: str, begin: int, end: int) -> None:
    """Refuses a begin and an end marker that pair up across a `def` or `class` line: a block is
    written inside one function's body, and markers lost on both sides of a boundary (the send
    block's end, the receive block's begin of the same key) must not take the code between out."""
    where = f"{source.shown}:{begin + 1}: block {key} (lines {begin + 1}-{end + 1})"
    holder = enclosing_function(source, begin + 1)
    if holder is None:
        raise UsageError(f"{where} is outside any function: mend the markers by hand")
    if _innermost(source, end + 1) != holder:
        starts = [scope for scope in source.scopes if begin + 1 < scope.first_line <= end + 1]
        # a def or class that starts between, else the one that ends there
        crossed = min(starts, key=lambda scope: scope.first_line, default=holder)
        kind = f"{crossed.name}()" if isinstance(crossed, AdaptorFunction) else f"class {crossed.name}"
        raise UsageError(
            f"{where} runs across the boundary of {kind} (line {crossed.first_line}): its markers belong "
            "to different blocks; mend the markers by hand"
        )


def without_blocks(
    source: AdaptorSource, removes: Callable[[str], bool] = lambda key: True
) -> tuple[bytes, tuple[str, ...]] | None:
    """The file with every block whose key `removes` accepts taken out, and a line per block; None
    when it holds none of them."""
    spans = [span for span in block_spans(source) if removes(span.key)]
    if not spans:
        return None
    lines = list(source.lines)
    newline = source.encode(source.newline)
    for span in reversed(spans):  # bottom to top, so earlier indices stay valid
        if span.end == len(lines) - 1 and not lines[span.end].endswith((b"\n", b"\r")) and span.begin > 0:
            lines[span.begin - 1] = lines[span.begin - 1][: -len(newline)]  # the file ended without a line ending
        del lines[span.begin : span.end + 1]
    changes = (f"{source.shown}:{span.begin + 1}: remove {span.key} (lines {span.begin + 1}-{span.end + 1})" for span in spans)
    return b"".join(lines), tuple(changes)


# --- reading blocks back (for verify) --------------------------------------------------------------


@dataclass(frozen=True)
class MarkedBlock:
    key: str
    path: Path
    line: int  # 1-based line of the begin marker
    function: str  # the adaptor function that holds it
    parameters: frozenset[str]  # that function's parameters
    own_group: str | None  # the local that function binds to a group it builds itself
    code: str  # the block's lines, markers included, dedented to column 0


@dataclass(frozen=True)
class AdaptorFile:
    path: Path
    patched: str  # as on disk, less the sentinel's blocks
    unpatched: str  # with every unsafe-doctor block taken out
    blocks: tuple[MarkedBlock, ...]  # the fix blocks (not the sentinel's)
    functions: frozenset[str]
    as_written: str  # as on disk, the sentinel's blocks too (verify --as-is)
    sentinel_blocks: tuple[MarkedBlock, ...] = ()  # the sentinel's: its check, and mode heal's in the repair


def read_adaptor(environment: Environment) -> tuple[AdaptorFile, ...]:
    """The adaptor's files with their fix blocks, and as they were before any fix.

    The sentinel's blocks are no fix: a replay proves the fixes without them (they would import the
    sentinel into every rank and, in mode raise, stop the recovery on what the replay leaves); a
    replay of the adaptor as it stands (`verify --as-is`) runs them."""
    files = []
    for path in adaptor_files(environment):
        source = read_adaptor_file(path)
        removed = without_blocks(source)
        unpatched = removed[0] if removed is not None else source.data
        sentinel = without_blocks(source, lambda key: key in SENTINEL_KEYS)
        patched = sentinel[0] if sentinel is not None else source.data
        files.append(
            AdaptorFile(
                path,
                patched.decode(source.encoding),
                unpatched.decode(source.encoding),
                tuple(_marked_blocks(source, lambda key: key not in SENTINEL_KEYS)),
                frozenset(function.name for function in source.functions),
                source.data.decode(source.encoding),
                tuple(_marked_blocks(source, lambda key: key in SENTINEL_KEYS)),
            )
        )
    return tuple(files)


def enclosing_function(source: AdaptorSource, line: int) -> AdaptorFunction | None:
    """The innermost function whose lines hold `line` (1-based); None outside every function, or in
    the body of a class that is innermost there."""
    holder = _innermost(source, line)
    return holder if isinstance(holder, AdaptorFunction) else None


def _innermost(source: AdaptorSource, line: int) -> AdaptorFunction | AdaptorClass | None:
    """The innermost def or class whose lines hold `line` (1-based)."""
    holders = [scope for scope in source.scopes if scope.first_line <= line <= scope.last_line]
    return max(holders, key=lambda scope: scope.first_line, default=None)


def _marked_blocks(source: AdaptorSource, wanted: Callable[[str], bool]) -> Iterable[MarkedBlock]:
    """The blocks whose key is `wanted`, each with the function that holds it."""
    texts = [line.decode(source.encoding).rstrip("\r\n") for line in source.lines]
    for span in block_spans(source):
        if not wanted(span.key):
            continue
        function = enclosing_function(source, span.begin + 1)
        if function is None:
            raise UsageError(f"{source.shown}:{span.begin + 1}: block {span.key} is outside any function")
        text = texts[span.begin]
        indent = text[: len(text) - len(text.lstrip())]
        lines = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in texts[span.begin : span.end + 1]]
        code = "\n".join(lines) + "\n"
        yield MarkedBlock(span.key, source.path, span.begin + 1, function.name, function.parameters, function.own_group, code)
