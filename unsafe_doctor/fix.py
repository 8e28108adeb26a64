"""Stage 7: write each finding's fix into the user's recovery adaptor, and take it out again.

A fix becomes one block at the end of an adaptor function, before a trailing `return`: the rollback
function for scenario 1; for scenario 2 the send function (replica side) and the receive function
(faulty side), planned together so that their transfers pair up in the same order. A block reads

    # unsafe-doctor: begin <key>
    # <what it does>
    def _unsafe_doctor_fix(<the names it needs>):
        <the fix's imports>
        <the rule's code; for scenario 2 inside a loop over the (source, destination) rank pairs>
    _unsafe_doctor_fix(<the adaptor function's own parameters>)
    # unsafe-doctor: end <key>

The helper function keeps the block's imports and names to itself: an `import torch` in the body of
the adaptor function would make `torch` local to the whole function, and its earlier uses would
fail. `<key>` is the rule id, or `<rule id>:<module>.<variable>` when the rule is not about one
named variable (the generic rules that heuristic verdicts use). A function that already holds a
block with the same key is left alone; a revert removes exactly the marked lines.

Edits are spliced into the original bytes at line boundaries, so every other byte stays as it was
(line endings, tabs, encoding); the result is parsed again and compiled before it may be written,
and a file that changed since it was read is never overwritten. Nothing here prints or exits:
refusals raise UsageError.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import io
import keyword
import os
import stat
import tempfile
import tokenize
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from unsafe_doctor.classify import Classified, generic_rule_id
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge import AdaptorProfile, KnowledgeBase, is_safe_dotted
from unsafe_doctor.subject import Subject
from unsafe_doctor.versions import Environment, profile_files

Role = Literal["rollback", "send", "recv"]
ROLES: tuple[Role, ...] = ("rollback", "send", "recv")
MARKER_BEGIN = "# unsafe-doctor: begin "
MARKER_END = "# unsafe-doctor: end "
HELPER = "_unsafe_doctor_fix"
GROUP_NAME = "repair_group"  # the helper's name for a repair group the adaptor function built itself
BACKUP_SUFFIX = ".unsafe-doctor.bak"
# Profile roles a rule's code may read by name (`train_args[1]`): passed in from the adaptor's parameters.
TEMPLATE_ROLES = ("src_ranks", "dest_ranks", "optim_idxs", "rank_list", "train_args", "need_rebuild")
INDENT = "    "  # the indentation unit of the rule templates


@dataclass(frozen=True)
class FileEdit:
    path: Path  # as shown to the user
    original: bytes
    updated: bytes
    encoding: str
    digest: str  # sha256 of `original`: the file must still hold it when the edit is written
    changes: tuple[str, ...]  # one line per block inserted or removed

    def diff(self) -> str:
        """Unified diff of this file, lines ending as in the file."""
        before = [line.decode(self.encoding, errors="replace") for line in self.original.splitlines(keepends=True)]
        after = [line.decode(self.encoding, errors="replace") for line in self.updated.splitlines(keepends=True)]
        lines = difflib.unified_diff(before, after, fromfile=str(self.path), tofile=str(self.path))
        return "".join(line if line.endswith(("\n", "\r")) else line + "\n\\ No newline at end of file\n" for line in lines)


@dataclass(frozen=True)
class Plan:
    edits: tuple[FileEdit, ...]  # files that change, each with every change for it
    present: tuple[str, ...]  # blocks the adaptor already holds
    skipped: tuple[str, ...]  # findings with no fix to write, and why
    notes: tuple[str, ...]

    def diff(self) -> str:
        return "".join(edit.diff() for edit in self.edits)


@dataclass(frozen=True)
class Written:
    path: Path
    backup: Path  # the file as it was before this write


# --- planning a fix ------------------------------------------------------------------------------


def plan_fix(
    findings: Sequence[Classified],
    environment: Environment,
    knowledge: KnowledgeBase,
    functions: Mapping[Role, str] | None = None,
) -> Plan:
    """The edits that write the fix of each finding into the adaptor; reads files, writes nothing.

    `functions` names the adaptor functions per role where they differ from the profile's names.
    """
    for item in findings:
        _check_log_names(item.subject)
    requests: list[_Request] = []
    skipped: list[str] = []
    notes: list[str] = []
    for number, item in enumerate(findings, 1):
        if item.classification.fix is None:
            skipped.append(f"finding {number}: {_why_no_fix(item)}")
        else:
            requests.extend(_requests(item, knowledge, environment.profile, dict(functions or {})))
            notes.extend(f"finding {number}: {note}" for note in item.classification.notes)
    if not requests:
        return Plan((), (), tuple(skipped), ())
    adaptor = _Adaptor(_adaptor_files(environment))
    insertions: dict[Path, list[tuple[_Function, list[str], str]]] = {}
    present: list[str] = []
    seen: set[tuple[Path, str, str]] = set()
    for request in requests:
        function = adaptor.function(request.function, request.role)
        place = (function.path, function.name, request.key)
        if place in seen:
            continue
        seen.add(place)
        source = adaptor.source(function.path)
        if _has_block(source, function, request.key):
            present.append(f"{source.shown}: {request.key} already in {function.name}()")
            continue
        lines = _block_lines(request, function, environment.profile, notes)
        insertions.setdefault(function.path, []).append((function, lines, request.key))
        notes.extend(_early_return_notes(source, function))
    edits = tuple(_insert(adaptor.source(path), items) for path, items in insertions.items())
    return Plan(edits, tuple(present), tuple(skipped), tuple(dict.fromkeys(notes)))


def function_overrides(specs: Iterable[str]) -> dict[Role, str]:
    """`role=name` items (comma-separated or repeated) -> {role: function name}."""
    overrides: dict[Role, str] = {}
    for spec in specs:
        for item in filter(None, (part.strip() for part in spec.split(","))):
            role, equals, name = (part.strip() for part in item.partition("="))
            if not equals or role not in ROLES:
                raise UsageError(f"--function {item!r}: write role=name, role one of {', '.join(ROLES)}")
            if not name.isidentifier() or keyword.iskeyword(name):
                raise UsageError(f"--function {item!r}: {name!r} is not a Python function name")
            if overrides.get(role, name) != name:
                raise UsageError(f"--function names two functions for {role}: {overrides[role]} and {name}")
            overrides[role] = name
    return overrides


@dataclass(frozen=True)
class _Request:
    key: str  # marker key
    role: Role
    function: str
    comment: str
    imports: tuple[str, ...]
    code: str
    scenario: int


def _check_log_names(subject: Subject) -> None:
    """Names from a log reach generated code and markers: each must be a plain dotted Python name."""
    tensor = subject.tensor
    if tensor is None:
        return
    for label, name in (("variable", tensor.variable), ("module", tensor.module), ("owner", tensor.owner)):
        if name is not None and not is_safe_dotted(name):
            shown = name if len(name) <= 60 else name[:57] + "..."
            raise UsageError(f"the log gives {label} {shown!r} where a Python name belongs: refusing to write it into code")


def _why_no_fix(item: Classified) -> str:
    classification = item.classification
    if classification.scenario is None:
        return "unclassified: scenario 1 or 2 is not known, so there is no fix to write"
    reasons = [note for note in classification.notes if note.startswith("no fix rendered")]
    return reasons[0] if reasons else "its rule has no fix for this adaptor"


def _requests(
    item: Classified, knowledge: KnowledgeBase, profile: AdaptorProfile, functions: dict[Role, str]
) -> list[_Request]:
    """One request per function the finding's fix goes into: rollback, or receive and send."""
    fix = item.classification.fix
    key = marker_key(item, knowledge)
    what = _tensor_name(item.subject) or key
    if fix.phase == "rollback":
        return [
            _Request(key, "rollback", functions.get("rollback", fix.function),
                     f"scenario 1: re-initialise {what} after the rollback", fix.imports, fix.code, 1)
        ]
    return [
        _Request(key, "recv", functions.get("recv", fix.function),
                 f"scenario 2, faulty rank: receive {what} from the replica rank", fix.imports, fix.code, 2),
        _Request(key, "send", functions.get("send", fix.peer_function),
                 f"scenario 2, replica rank: send {what} to the faulty rank", fix.imports, fix.peer_code, 2),
    ]


def marker_key(item: Classified, knowledge: KnowledgeBase) -> str:
    classification = item.classification
    rule_id = classification.rule or generic_rule_id(classification.scenario, item.subject)
    rule = knowledge.rule(rule_id)
    if rule is not None and rule.match.variable is not None:
        return rule_id
    name = _tensor_name(item.subject)
    return f"{rule_id}:{name}" if name else rule_id


def _tensor_name(subject: Subject) -> str | None:
    return subject.tensor.dotted if subject.tensor else None


# --- the adaptor's files and functions ------------------------------------------------------------


def _adaptor_files(environment: Environment) -> list[Path]:
    adaptor = environment.adaptor
    if adaptor is None:
        globs = ", ".join(environment.profile.files)
        raise UsageError(f"no adaptor file found ({globs} under the source roots): give --adaptor FILE or --source-root DIR")
    siblings = [path for path in profile_files(environment.profile, adaptor) if path != adaptor.resolve()]
    return [adaptor, *(_shown_path(path) for path in siblings)]


def _shown_path(path: Path) -> Path:
    """Relative to the working folder when inside it, as the user typed the adaptor's path."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


@dataclass(frozen=True)
class _Function:
    name: str
    path: Path
    first_line: int  # 1-based, the `def` line
    last_line: int
    parameters: frozenset[str]
    indent: str  # the body's indentation
    unit: str  # one indentation level of this function
    insert_at: int | None  # 0-based index of the line a block goes before; None for a one-line body
    early_returns: tuple[int, ...]  # lines of returns other than a trailing one
    own_group: str | None  # local name of a process group the function builds with new_group()


@dataclass(frozen=True)
class _Source:
    path: Path
    shown: str
    data: bytes
    encoding: str  # as Python reads the file: PEP 263 coding line, BOM (utf-8-sig), else utf-8
    newline: str
    lines: tuple[bytes, ...]  # with their line endings
    functions: tuple[_Function, ...]

    def text_line(self, index: int) -> str:
        return self.lines[index].decode(self.encoding)

    def encode(self, text: str) -> bytes:
        """Text for the middle of the file: a BOM belongs only at its start."""
        return text.encode("utf-8" if self.encoding == "utf-8-sig" else self.encoding)


class _Adaptor:
    """The adaptor's files, each read and parsed once."""

    def __init__(self, paths: list[Path]):
        self.paths = paths
        self._sources: dict[Path, _Source] = {}

    def source(self, path: Path) -> _Source:
        if path not in self._sources:
            self._sources[path] = _read_source(path)
        return self._sources[path]

    def function(self, name: str, role: Role) -> _Function:
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


def _read_source(path: Path) -> _Source:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise UsageError(f"cannot read adaptor {path}: {error.strerror or error}") from None
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        text = data.decode(encoding)
        wrapper = MetadataWrapper(cst.parse_module(text))
    except (SyntaxError, UnicodeDecodeError, LookupError, cst.ParserSyntaxError) as error:
        raise UsageError(f"adaptor {path} is not valid Python: {str(error).splitlines()[0]}") from None
    lines = tuple(data.splitlines(keepends=True))
    positions = wrapper.resolve(PositionProvider)
    collector = _FunctionCollector()
    wrapper.module.visit(collector)
    text_lines = [line.decode(encoding) for line in lines]
    functions = tuple(_describe(node, positions, text_lines, path) for node in collector.found)
    return _Source(path, str(path), data, encoding, _newline(lines), lines, functions)


def _newline(lines: Sequence[bytes]) -> str:
    for line in lines:
        for ending in ("\r\n", "\n", "\r"):
            if line.endswith(ending.encode()):
                return ending
    return "\n"


class _FunctionCollector(cst.CSTVisitor):
    def __init__(self) -> None:
        self.found: list[cst.FunctionDef] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.found.append(node)


class _ReturnCollector(cst.CSTVisitor):
    """Returns of one function, not those of the functions and classes it defines."""

    def __init__(self) -> None:
        self.found: list[cst.Return] = []

    def visit_Return(self, node: cst.Return) -> None:
        self.found.append(node)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False


def _describe(node: cst.FunctionDef, positions: Mapping[cst.CSTNode, CodeRange], text_lines: list[str], path: Path) -> _Function:
    """Where a block goes in this function, how it is indented, what the function takes."""
    start, end = positions[node].start, positions[node].end
    parameters = frozenset(_parameter_names(node.params))
    if not isinstance(node.body, cst.IndentedBlock):
        return _Function(node.name.value, path, start.line, end.line, parameters, "", INDENT, None, (), None)
    body = node.body.body
    first = positions[body[0]].start
    indent = text_lines[first.line - 1][: first.column]
    def_indent = text_lines[start.line - 1][: start.column]
    unit = indent[len(def_indent):] if indent.startswith(def_indent) and len(indent) > len(def_indent) else INDENT
    last = body[-1]
    trailing_return = _is_return(last)
    if trailing_return:
        insert_at = positions[last].start.line - 1 - len(last.leading_lines)
    else:
        insert_at = positions[last].end.line
    returns = _ReturnCollector()
    node.body.visit(returns)
    trailing = set(last.body) if trailing_return else set()
    early = tuple(positions[ret].start.line for ret in returns.found if ret not in trailing)
    return _Function(node.name.value, path, start.line, end.line, parameters, indent, unit, insert_at, early, _own_group(body))


def _parameter_names(params: cst.Parameters) -> Iterable[str]:
    for param in (*params.posonly_params, *params.params, *params.kwonly_params):
        yield param.name.value
    for star in (params.star_arg, params.star_kwarg):
        if isinstance(star, cst.Param):
            yield star.name.value


def _is_return(statement: cst.BaseStatement) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and any(isinstance(small, cst.Return) for small in statement.body)


def _own_group(body: Sequence[cst.BaseStatement]) -> str | None:
    """The local a function binds to a process group it builds itself (`g = dist.new_group(...)`):
    the repair traffic of that adaptor goes over it, whatever the profile's group getter says."""
    names = []
    for statement in body:
        if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
            continue
        assign = statement.body[0]
        if (
            isinstance(assign, cst.Assign)
            and len(assign.targets) == 1
            and isinstance(assign.targets[0].target, cst.Name)
            and isinstance(assign.value, cst.Call)
            and _callee_name(assign.value.func) == "new_group"
        ):
            names.append(assign.targets[0].target.value)
    return names[-1] if names else None


def _callee_name(callee: cst.BaseExpression) -> str | None:
    if isinstance(callee, cst.Name):
        return callee.value
    return callee.attr.value if isinstance(callee, cst.Attribute) else None


# --- rendering a block ----------------------------------------------------------------------------


def _block_lines(request: _Request, function: _Function, profile: AdaptorProfile, notes: list[str]) -> list[str]:
    """The block's lines, without line endings, indented for the function's body."""
    code, imports = request.code, request.imports
    try:
        read = _names_read("\n".join([*imports, code]))
    except SyntaxError as error:
        raise UsageError(
            f"the fix {request.key} for {request.function}() is not valid Python ({error.msg}, line {error.lineno})"
        ) from None
    pairs: list[tuple[str, str]] = []  # (helper parameter, what the adaptor function passes)
    if request.scenario == 2 and function.own_group is not None:
        renamed = _rename_expression(code, profile.repair_group, GROUP_NAME)
        if renamed != code:
            code = renamed
            imports = tuple(line for line in imports if line not in profile.repair_group_imports)
            pairs.append((GROUP_NAME, function.own_group))
            notes.append(
                f"{function.name}() builds its own repair group ({function.own_group}): the block uses it, "
                f"not {profile.repair_group}"
            )
    body = code.rstrip("\n").split("\n")
    if request.scenario == 2:
        body, rank_pairs = _rank_loop(body, profile)
        pairs = rank_pairs + pairs
    passed = dict(pairs)
    pairs += [(role, _role_parameter(profile, role, request)) for role in TEMPLATE_ROLES if role in read and role not in passed]
    _check_parameters(function, pairs, profile, request)
    helper = [f"def {HELPER}({', '.join(name for name, _ in pairs)}):"]
    helper += [INDENT + line for line in imports]
    helper += [INDENT + line if line.strip() else "" for line in body]
    lines = [
        MARKER_BEGIN + request.key,
        f"# {request.comment}",
        *helper,
        f"{HELPER}({', '.join(value for _, value in pairs)})",
        MARKER_END + request.key,
    ]
    return [_reindent(line, function) for line in lines]


def _rank_loop(body: list[str], profile: AdaptorProfile) -> tuple[list[str], list[tuple[str, str]]]:
    """Bind the templates' `src_rank` / `dest_rank` from the function's rank parameters.

    List-valued parameters hold one entry per (source, destination, optimizer index): the same pair
    repeats once per optimizer, so each pair is visited once, in first-seen order (the same order on
    both sides, since both receive the same lists)."""
    source, destination = _role_parameter(profile, "src_ranks"), _role_parameter(profile, "dest_ranks")
    if not profile.ranks_are_lists:
        return body, [("src_rank", source), ("dest_rank", destination)]
    loop = [
        "# each (source, destination) pair once: the lists repeat it per optimizer index",
        "for src_rank, dest_rank in dict.fromkeys(zip(src_ranks, dest_ranks)):",
    ]
    return loop + [INDENT + line if line.strip() else "" for line in body], [("src_ranks", source), ("dest_ranks", destination)]


def _role_parameter(profile: AdaptorProfile, role: str, request: _Request | None = None) -> str:
    if role not in profile.parameters:
        needed_by = f" ({request.key} reads {role})" if request else ""
        raise UsageError(f"adaptor profile {profile.id} does not say which parameter holds {role}{needed_by}")
    return profile.parameters[role]


def _check_parameters(function: _Function, pairs: list[tuple[str, str]], profile: AdaptorProfile, request: _Request) -> None:
    missing = [
        value for name, value in pairs if name != GROUP_NAME and value.split(".")[0] not in function.parameters
    ]
    if missing:
        has = ", ".join(sorted(function.parameters)) or "no parameters"
        raise UsageError(
            f"{function.path}:{function.first_line}: {function.name}() lacks parameter(s) {', '.join(missing)} "
            f"that {request.key} needs (adaptor profile {profile.id}); it has {has}"
        )


def _names_read(code: str) -> set[str]:
    return {node.id for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


def _rename_expression(code: str, expression: str, name: str) -> str:
    """`code` with every occurrence of `expression` replaced by the name `name`."""
    wanted = cst.parse_expression(expression)

    class Renamer(cst.CSTTransformer):
        def on_leave(self, original_node, updated_node):
            if isinstance(original_node, cst.BaseExpression) and original_node.deep_equals(wanted):
                return cst.Name(name)
            return updated_node

    return cst.parse_module(code).visit(Renamer()).code


def _reindent(line: str, function: _Function) -> str:
    """Template indentation (four spaces a level) -> the function's own (tabs, two spaces, ...)."""
    if not line:
        return ""
    stripped = line.lstrip(" ")
    levels, rest = divmod(len(line) - len(stripped), len(INDENT))
    return function.indent + function.unit * levels + " " * rest + stripped


# --- splicing and checking ------------------------------------------------------------------------


def _has_block(source: _Source, function: _Function, key: str) -> bool:
    marker = MARKER_BEGIN + key
    return any(
        source.text_line(index).strip() == marker for index in range(function.first_line - 1, function.last_line)
    )


def _early_return_notes(source: _Source, function: _Function) -> list[str]:
    if not function.early_returns:
        return []
    lines = ", ".join(map(str, function.early_returns))
    return [
        f"{source.shown}: {function.name}() returns before its end (line {lines}): "
        "the block runs only on paths that reach the end"
    ]


def _insert(source: _Source, items: list[tuple[_Function, list[str], str]]) -> FileEdit:
    """Every block for one file spliced in at once (one combined diff); blocks for one place keep
    their planned order, so the send and receive sides of several fixes pair up."""
    lines = list(source.lines)
    newline = source.encode(source.newline)
    changes = []
    # Bottom to top, so earlier positions stay valid; at one position, the last planned block first.
    for _, (function, block, key) in sorted(enumerate(items), key=lambda item: (item[1][0].insert_at, item[0]), reverse=True):
        encoded = [source.encode(line) + newline for line in block]
        at = function.insert_at
        if at == len(lines) and lines and not lines[-1].endswith((b"\n", b"\r")):
            lines[-1] += newline  # the file ended without a line ending after the function:
            encoded[-1] = encoded[-1][: -len(newline)]  # it still does, after the block
        lines[at:at] = encoded
        changes.append(f"{source.shown}:{at + 1}: insert {key} at the end of {function.name}()")
    changes.reverse()
    return _checked_edit(source, b"".join(lines), tuple(changes))


def _checked_edit(source: _Source, updated: bytes, changes: tuple[str, ...]) -> FileEdit:
    """The edit, once the new content parses and compiles."""
    try:
        cst.parse_module(updated.decode(source.encoding))
        compile(updated, str(source.path), "exec", dont_inherit=True)
    except (SyntaxError, ValueError, cst.ParserSyntaxError) as error:
        reason = f"{error.msg}, line {error.lineno}" if isinstance(error, SyntaxError) else str(error).splitlines()[0]
        raise UsageError(f"{source.shown}: the edited file would not compile ({reason}): nothing written") from None
    digest = hashlib.sha256(source.data).hexdigest()
    return FileEdit(source.path, source.data, updated, source.encoding, digest, changes)


# --- revert ---------------------------------------------------------------------------------------


def plan_revert(environment: Environment) -> Plan:
    """The edits that remove every unsafe-doctor block from the adaptor's files."""
    edits = []
    notes = []
    for path in _adaptor_files(environment):
        source = _read_source(path)
        removed = _without_blocks(source)
        if removed is None:
            notes.append(f"{source.shown}: no unsafe-doctor blocks")
        else:
            edits.append(_checked_edit(source, *removed))
    return Plan(tuple(edits), (), (), tuple(notes))


def _without_blocks(source: _Source) -> tuple[bytes, tuple[str, ...]] | None:
    lines = list(source.lines)
    newline = source.encode(source.newline)
    changes = []
    index = 0
    removed = 0  # lines removed above `index`, to report the original line numbers
    while index < len(lines):
        text = lines[index].decode(source.encoding).strip()
        if not text.startswith(MARKER_BEGIN):
            index += 1
            continue
        key = text[len(MARKER_BEGIN):]
        ends = (later for later in range(index + 1, len(lines)) if lines[later].decode(source.encoding).strip() == MARKER_END + key)
        end = next(ends, None)
        first = index + 1 + removed
        if end is None:
            raise UsageError(f"{source.shown}:{first}: block {key} has no end marker ({MARKER_END}{key}): remove it by hand")
        changes.append(f"{source.shown}:{first}: remove {key} (lines {first}-{end + 1 + removed})")
        if end == len(lines) - 1 and not lines[end].endswith((b"\n", b"\r")) and index > 0:
            lines[index - 1] = lines[index - 1][: -len(newline)]  # the file ended without a line ending
        del lines[index : end + 1]
        removed += end + 1 - index
    if not changes:
        return None
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
    text: str  # as on disk
    unpatched: str  # with every unsafe-doctor block taken out
    blocks: tuple[MarkedBlock, ...]
    functions: frozenset[str]


def read_adaptor(environment: Environment) -> tuple[AdaptorFile, ...]:
    """The adaptor's files as written, with their marked blocks, and as they were before any fix."""
    files = []
    for path in _adaptor_files(environment):
        source = _read_source(path)
        removed = _without_blocks(source)
        unpatched = removed[0] if removed is not None else source.data
        files.append(
            AdaptorFile(
                path,
                source.data.decode(source.encoding),
                unpatched.decode(source.encoding),
                tuple(_marked_blocks(source)),
                frozenset(function.name for function in source.functions),
            )
        )
    return tuple(files)


def _marked_blocks(source: _Source) -> Iterable[MarkedBlock]:
    texts = [line.decode(source.encoding).rstrip("\r\n") for line in source.lines]
    for index, text in enumerate(texts):
        stripped = text.strip()
        if not stripped.startswith(MARKER_BEGIN):
            continue
        key = stripped[len(MARKER_BEGIN):]
        end = next((later for later in range(index + 1, len(texts)) if texts[later].strip() == MARKER_END + key), None)
        if end is None:
            raise UsageError(f"{source.shown}:{index + 1}: block {key} has no end marker ({MARKER_END}{key})")
        holders = [function for function in source.functions if function.first_line <= index + 1 <= function.last_line]
        if not holders:
            raise UsageError(f"{source.shown}:{index + 1}: block {key} is outside any function")
        function = max(holders, key=lambda function: function.first_line)  # the innermost
        indent = text[: len(text) - len(text.lstrip())]
        lines = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in texts[index : end + 1]]
        yield MarkedBlock(key, source.path, index + 1, function.name, function.parameters, function.own_group, "\n".join(lines) + "\n")


# --- writing --------------------------------------------------------------------------------------


def apply(plan: Plan) -> tuple[Written, ...]:
    """Write every edit: atomic replace, a backup beside each file, the file's mode kept.

    Refuses (before writing anything) a read-only file, and refuses any file whose content is no
    longer what was read when the plan was made."""
    for edit in plan.edits:
        _check_unchanged(edit)
        _check_writable(edit)
    return tuple(_write(edit) for edit in plan.edits)


def _check_writable(edit: FileEdit) -> None:
    target = edit.path.resolve()
    if not target.stat().st_mode & stat.S_IWUSR or not os.access(target, os.W_OK):
        raise UsageError(f"{edit.path} is read-only: nothing written")
    if not os.access(target.parent, os.W_OK):
        raise UsageError(f"{target.parent} is not writable (the edit is written beside the file): nothing written")


def _check_unchanged(edit: FileEdit) -> None:
    try:
        current = edit.path.resolve().read_bytes()
    except OSError as error:
        raise UsageError(f"cannot read {edit.path} again: {error.strerror or error}") from None
    if hashlib.sha256(current).hexdigest() != edit.digest:
        raise UsageError(f"{edit.path} changed since it was read: nothing written; run the command again")


def _write(edit: FileEdit) -> Written:
    target = edit.path.resolve()
    mode = target.stat().st_mode & 0o7777
    backup = target.with_name(target.name + BACKUP_SUFFIX)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(edit.updated)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, mode)
        _check_unchanged(edit)  # last look, right before the replace
        backup.write_bytes(edit.original)
        os.chmod(backup, mode)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return Written(edit.path, _shown_path(backup))
