"""Unsafe-data tracebacks -> findings (culprit frame, global tensor), folded across ranks.

The rules, in the order they apply:

* **Unsafe link**: of a traceback's chain, the link whose message is the unsafe-data error; when
  several are, the innermost cause (printed first), which holds the frames that touched the tensor.
* **Culprit frame**: the innermost frame outside torch, torch_npu and the Python standard library
  (`is_internal_file`) whose statement reads a tensor-ish operand. A frame whose source is unknown
  counts as touching one. A frame that only forwards (`return func(*args, **kwargs)`) does not: the
  callee name and `*args` / `**kwargs` are not operands. When no frame qualifies, the innermost
  non-internal frame; when every frame is internal, no culprit. A comprehension's frame
  (`<genexpr>`, `<listcomp>`, ...) is shown as the frame of the function it runs in (the one
  before it, at the same file and line), as from Python 3.12 a list comprehension runs inline.
  A `<lambda>` frame reads the bodies of the lambdas on its line.
* **Position markers** (Python 3.11+): when the frame's `~~~^~~~` / `^^^^` line fits the parsed
  statement (`unsafe_doctor.source.printed`), only the operands that overlap the marked part
  are candidates, those under its `^` part first (a call's `^` part is the whole call, as 3.11
  marks it, also where 3.13 marks its callee `~`; a marker to the end of the printed line covers
  the rest of a statement over several lines); a lambda's parameter or a comprehension's key
  outside it is not what raised. When no operand overlaps, or the markers fit no expression, or
  the log has none, every operand is a candidate.
* **Statement**: the whole statement around the frame's line when the file is available locally
  (so a multi-line call is read in full), else the printed line, made parseable
  (`unsafe_doctor.source.printed`). A local file not at the printed
  path may be another version: the printed line is looked up there (nearest match) and notes say so;
  when the log printed no source line, the culprit gets the local one.
* **Operands**: the reference chains the statement reads: names, attribute and subscript chains, the
  receiver of a method call (`_X[name]` in `_X[name].zero_()`), call arguments, the target of an
  augmented assignment and the container of a subscript assignment; a call's result (`mask(n)`,
  `self.rope(n)`) only when it is what an lru cache keeps or a global the function returns. Not
  operands: callees, names only rebound (`x = ...`), builtins, bare `self` / modules / classes /
  functions, library modules (torch, numpy, the standard library) and constant-valued module flags.
* **Bindings**: a local is what the function bound before the frame's statement (`x = f(x)` reads
  the earlier `x`; `cos, sin = cos_sin(n)` makes each an element of what the chain holds). A
  comprehension's loop variable stands for an element of its iterable, which is resolved instead
  (`t[0]` in `sum(t[0] for t in xs)` is `xs`); a comprehension's frame reads only its
  comprehensions, and its function's parameters are followed to that function's caller. Calling what
  a global holds (`_fused_op(t)` under `global _fused_op`) gives the call's result, not that global.
* **Choice**: the operand most likely to be a global tensor, by tier: resolved to a global (module
  global, module attribute, `from m import X`, `global X`, class attribute, singleton field, the
  result of an lru-cached call: a `functools.lru_cache` / `cache` function, or `self.attr(...)` where
  the class set `self.attr = Cls(...)` and `Cls.forward` / `Cls.__call__` is cached, or a local alias
  of one of those) > looks global without source (`_UPPER`, `mod._UPPER`, `ClassName.attr`) >
  `self.attr` > unknown > parameter > plain local; ties go to the leftmost. A parameter is followed
  into the caller frame's call, to the argument at its position or keyword, when that frame is
  framework code; a wrapper's call of the function it was handed (`return fn(self, query, ...)`)
  counts as that call. A call's result counts when the function returns a global
  (`get_rotation_matrix(x)`). The run's argument globals (`_GLOBAL_ARGS`: `args.pre_tockens`) are
  never chosen: they hold flags and numbers.
* **Paths** (`branches`): a local, a rebound parameter or `self.attr` that the function binds on
  several paths before the line is each value in turn; the arguments dump drops the paths its
  switches rule out (`if sequence_parallel:`); when two globals remain the local itself is kept
  (rules of its frame may know it) and the notes name both. A statement printed in part (open
  brackets, 3.13's `...<N lines>...`) may read any parameter of its function: each is followed.
* **Expression**: the chain up to the name that identifies the global (the *anchor*: `_X`,
  `mod._X`, `Cls.attr`, `Cls.instance.field`, `get_instance().field`, `self.attr`, the cached call
  `mask(n)`, or the local alias' own name), plus at most one subscript right after it, as printed:
  `parallel_state._X[name][i] += v` -> `parallel_state._X[name]`.
* **Files** are found, read (never imported) and named as `unsafe_doctor.source.workspace` says: by path as
  printed, else under a `--source-root` or a `sys.path` directory. Bindings and tiers are resolved by
  `unsafe_doctor.source.resolve`, the one resolver; this module picks frames, operands and the winner.
* **Folding**: identical (culprit file, line, function, tensor) on several ranks make one finding
  with the sorted ranks (the log's rank, else torch_npu's RankID; -1 is no rank); findings keep the
  input order of their first traceback, which is the one they carry.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

from unsafe_doctor.diagnose.branches import Route, decided, earlier_values, paths_to
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.subject import Subject, TensorRef
from unsafe_doctor.log.tracebacks import Frame, Traceback
from unsafe_doctor.npu.messages import UNSAFE_DATA
from unsafe_doctor.source.files import is_internal_file, why_not_read
from unsafe_doctor.source.printed import MarkedSpan, first_line, is_partial, parse_printed_line
from unsafe_doctor.source.resolve import MAX_DEPTH, Resolved, Scope, Tier, resolve_written
from unsafe_doctor.source.syntax import (
    COMPREHENSION_FRAMES,
    SCOPES,
    Function,
    callee_name,
    child_statements,
    compound_header,
    comprehension_body,
    comprehension_element,
    flatten,
    one_line,
    parameter_names,
    source_segment,
)
from unsafe_doctor.source.workspace import Origin, SourceFile, Workspace


@dataclass(frozen=True)
class SentinelSeen:
    """What the sentinel's log lines said of one global, every rank's lines together
    (`sentinel_findings`): the training process itself named it, after the recovery."""

    ranks: tuple[int, ...]  # sorted: the ranks whose lines named it
    backends: tuple[str, ...]  # the backends that checked: "npu" (torch_npu's own check) or "emulated"
    tensors: int  # the most unsafe tensors one rank found behind it; 0 for a cache
    paths: tuple[str, ...]  # readable paths of some of them, as a line gave them (untrusted text)
    healed_ranks: tuple[int, ...]  # ranks whose heal mode ran the rule's fix in process and checked it safe
    healed_everywhere: bool  # every line naming it said healed
    healed_from: tuple[int, ...] = ()  # the replicas heal mode copied it from in the repair (scenario 2)


@dataclass(frozen=True)
class Alternative:
    """Another global the culprit line may have read, which the log cannot rule out."""

    variable: str
    module: str | None
    how: str  # "another operand of the line", or the path it was bound on: "when not (sequence_parallel)"


@dataclass(frozen=True)
class Finding:
    ranks: tuple[int, ...]  # sorted
    traceback: Traceback | None  # first occurrence in log order (the whole chain); None: only the sentinel saw it
    unsafe: Traceback | None  # the link of that chain whose message is the unsafe-data error
    culprit: Frame | None
    tensor: TensorRef | None
    source_file: str | None  # the local file read for context, if any
    notes: tuple[str, ...]  # e.g. "read megatron/core/... from site-packages; version may differ"
    source_differs: bool = False  # the culprit's local file is not the one that ran: its lines differ from the log's
    origin: Origin = Origin.LOG  # where the source the tensor was read from came from; LOG: a guess from the printed line
    release: str | None = None  # for INDEX: the releases the frames fit (`ReleaseMatch.describe`)
    sentinel: SentinelSeen | None = None  # what the sentinel's lines said of this global, when they named it
    alternatives: tuple[Alternative, ...] = ()  # other globals the line may have read, most likely first

    @property
    def subject(self) -> Subject:
        """What classify, the heuristics and the fixer read of this finding."""
        return Subject(self.tensor, self.culprit, self.source_file, self.source_differs)


def is_unsafe_error(traceback: Traceback) -> bool:
    return UNSAFE_DATA.rstrip(".") in traceback.message


def locate(tracebacks: Sequence[Traceback], workspace: Workspace, switches: Mapping[str, str] | None = None) -> list[Finding]:
    """Findings for every traceback whose chain holds the unsafe-data error, folded across ranks.

    `workspace`: the command's, over the source roots (`context.Groundwork`); the frames of the
    unsafe links fingerprint its framework releases first (`Workspace.fingerprint`). `switches`:
    the run's arguments as its dump printed them, which pick the branch a value was bound on."""
    for root in workspace.source_roots:
        if not root.is_dir():
            raise UsageError(f"source root {root} is not a directory")
    links = [link for link in map(_unsafe_link, tracebacks) if link is not None]
    workspace.fingerprint([frame for link in links for frame in link.frames])
    views = _FrameViews(workspace, switches or {})
    analyses: dict[tuple[Frame, ...], _Analysis] = {}
    groups: dict[tuple, list[tuple[Traceback, Traceback, _Analysis]]] = {}
    for traceback in tracebacks:
        unsafe = _unsafe_link(traceback)
        if unsafe is None:
            continue
        if unsafe.frames not in analyses:
            analyses[unsafe.frames] = _guarded_analysis(unsafe.frames, views)
        analysis = analyses[unsafe.frames]
        groups.setdefault(analysis.key(), []).append((traceback, unsafe, analysis))
    return [_fold(members) for members in groups.values()]


# --- one frame: its source, statement and scope ----------------------------------------------------


class _FrameViews:
    """Each frame's view, made once: following a parameter views the caller again."""

    def __init__(self, workspace: Workspace, switches: Mapping[str, str]):
        self.workspace = workspace
        self.switches = switches
        self._views: dict[Frame, _FrameView] = {}

    def view(self, frame: Frame) -> _FrameView:
        if frame not in self._views:
            self._views[frame] = _frame_view(frame, self.workspace)
        return self._views[frame]


@dataclass(frozen=True)
class _FrameView:
    frame: Frame
    scope: Scope
    statement: ast.stmt | None  # None: the source is unknown or unparseable
    text: str | None  # the text statement's offsets refer to
    source_line: str | None  # the frame's line as read locally, when the log printed none
    notes: tuple[str, ...]
    differs: bool = False  # the local file read is not the one that ran (the log's line is elsewhere in it)
    marked: MarkedSpan | None = None  # the frame's position markers, when they fit the statement
    origin: Origin = Origin.LOG  # where `scope.source` came from (LOG: none read)
    release: str | None = None  # for INDEX: the releases the frames fit
    partial: bool = False  # the statement is the printed part of a longer one: it may read more


def _frame_view(frame: Frame, workspace: Workspace) -> _FrameView:
    found = workspace.find(frame.file)
    notes: list[str] = []
    source = workspace.source(found.local, found.module) if found.local else None
    if found.origin is Origin.INDEX and not workspace.index_agrees(frame):
        source = None  # a file of the framework, but not as the release the other frames fit: patched, or newer
    if found.local is not None and source is None and found.origin is not Origin.INDEX:
        notes.append(f"{found.local} {workspace.sources.why_not_parsed(found.local) or why_not_read(found.local)}")
    if source is not None and found.origin is Origin.INDEX:
        return _indexed_view(frame, found.module, source, workspace.release_of(frame.file))
    line = _matching_line(frame, source) if source else None
    installed_differs = found.origin is Origin.INSTALLED and first_line(frame.source) is not None and line != frame.line
    if installed_differs:
        source = line = None  # another release is installed here: its file is not what ran
    statement = text = source_line = None
    stack: tuple[ast.AST, ...] = ()
    visible = marked_line = line
    if source is not None and line is not None:
        statement, stack = _statement_at(source.tree, line)
        text = source.text
        if statement is not None:
            visible = statement.lineno - 1  # `x = f(x)` reads the x bound before it
        if first_line(frame.source) is None:
            source_line = source.text.splitlines()[line - 1].strip()
    elif source is not None:
        stack = _def_named(source.tree.body, frame.function, ()) or ()
    partial = False
    if statement is None and frame.source and first_line(frame.source):
        parsed = parse_printed_line(frame.source)
        if parsed is not None:
            statement, text = parsed
            marked_line = 1
            partial = is_partial(frame.source)
    functions = tuple(node for node in stack if isinstance(node, Function))
    scope = Scope(found.module, source, functions, _class_of_self(stack), visible)
    differs = installed_differs or (
        source is not None and frame.line is not None and first_line(frame.source) is not None and line != frame.line
    )
    marked = _marked_span(frame, statement, text, marked_line)
    origin = found.origin if source is not None else Origin.LOG
    return _FrameView(
        frame=frame,
        scope=scope,
        statement=statement,
        text=text,
        source_line=source_line,
        notes=tuple(notes),
        differs=differs,
        marked=marked,
        origin=origin,
        partial=partial,
    )


def _indexed_view(frame: Frame, module: str | None, skeleton: SourceFile, release: str | None) -> _FrameView:
    """A frame of a release the index holds: the functions around its line and the bindings before
    it come from the skeleton; the statement is the printed line, unless the skeleton kept a call
    written over several lines there (its arguments, which the log does not print)."""
    assert frame.line is not None  # the release agrees with the frame's line
    statement, _ = _statement_at(skeleton.tree, frame.line)
    stack = _scopes_at(skeleton.tree.body, frame.line)
    functions = tuple(node for node in stack if isinstance(node, Function))
    scope = Scope(module, skeleton, functions, _class_of_self(stack), frame.line - 1)
    spread = statement is not None and statement.lineno == frame.line and (statement.end_lineno or 0) > frame.line
    if statement is not None and spread:
        return _FrameView(
            frame=frame,
            scope=scope,
            statement=statement,
            text=skeleton.text,
            source_line=None,
            notes=(),
            origin=Origin.INDEX,
            release=release,
        )
    parsed = parse_printed_line(frame.source or "")
    printed, text = parsed if parsed is not None else (None, None)
    marked = _marked_span(frame, printed, text, 1)
    partial = is_partial(frame.source or "")
    return _FrameView(
        frame=frame,
        scope=scope,
        statement=printed,
        text=text,
        source_line=None,
        notes=(),
        marked=marked,
        origin=Origin.INDEX,
        release=release,
        partial=partial,
    )


def _marked_span(frame: Frame, statement: ast.stmt | None, text: str | None, line: int | None) -> MarkedSpan | None:
    """The frame's position markers on its statement (parsed from `text`, the printed line being
    its line `line`), when they fit it."""
    marker, printed = frame.marker, first_line(frame.source)
    if marker is None or printed is None or statement is None or text is None or line is None:
        return None
    lines = text.splitlines()
    if not 1 <= line <= len(lines):
        return None
    return MarkedSpan.place((marker.start, marker.end), marker.primary, printed, lines[line - 1], line, root=statement)


def _matching_line(frame: Frame, source: SourceFile) -> int | None:
    """The frame's line in the local file: as numbered when it holds the printed source, else the
    nearest line that does; None when the printed source is nowhere in the file."""
    lines = source.text.splitlines()
    in_range = frame.line is not None and 1 <= frame.line <= len(lines)
    printed = first_line(frame.source)
    if printed is None:
        return frame.line if in_range else None
    if in_range and frame.line is not None and lines[frame.line - 1].strip() == printed:
        return frame.line
    matches = [number for number, text in enumerate(lines, 1) if text.strip() == printed]
    if not matches:
        return None
    return min(matches, key=lambda number: abs(number - (frame.line or 0)))


def _statement_at(tree: ast.Module, line: int) -> tuple[ast.stmt | None, tuple[ast.AST, ...]]:
    """The innermost statement whose own text covers `line` (a compound statement's header only),
    and the functions and classes around it, outermost first."""
    stack: list[ast.AST] = []
    body: list[ast.stmt] = tree.body
    while True:
        covering = [statement for statement in body if statement.lineno <= line <= (statement.end_lineno or 0)]
        if not covering:
            return None, tuple(stack)
        statement = covering[0]
        children = child_statements(statement)
        if not children or line == statement.lineno or line < children[0].lineno:
            return statement, tuple(stack)
        if isinstance(statement, SCOPES):
            stack.append(statement)
        body = children


def _scopes_at(body: Sequence[ast.stmt], line: int) -> tuple[ast.AST, ...]:
    """The functions and classes whose span covers `line`, outermost first (a skeleton keeps no
    statement at most lines, so the spans alone say where a line is)."""
    for statement in body:
        if isinstance(statement, SCOPES) and statement.lineno <= line <= (statement.end_lineno or 0):
            return (statement, *_scopes_at(statement.body, line))
        if not isinstance(statement, SCOPES) and statement.lineno <= line <= (statement.end_lineno or 0):
            return _scopes_at(child_statements(statement), line)
    return ()


def _def_named(body: Sequence[ast.stmt], name: str, stack: tuple[ast.AST, ...]) -> tuple[ast.AST, ...] | None:
    """The stack down to the first function called `name` (used when the log's line is not in the file)."""
    for statement in body:
        if isinstance(statement, Function) and statement.name == name:
            return (*stack, statement)
        inner = (*stack, statement) if isinstance(statement, SCOPES) else stack
        found = _def_named(child_statements(statement), name, inner)
        if found:
            return found
    return None


def _class_of_self(stack: Sequence[ast.AST]) -> ast.ClassDef | None:
    owner = None
    for outer, inner in pairwise(stack):
        if isinstance(outer, ast.ClassDef) and isinstance(inner, Function):
            owner = outer
    return owner


# --- operands of a statement -----------------------------------------------------------------------


def _reads(statement: ast.stmt) -> Sequence[ast.AST]:
    """The parts of a statement evaluated when its line runs (a compound statement's header only)."""
    if isinstance(statement, ast.Assign):
        return [*_container_reads(statement.targets), statement.value]
    if isinstance(statement, ast.AugAssign):
        return [statement.target, statement.value]
    if isinstance(statement, ast.AnnAssign):
        return [*_container_reads([statement.target]), *([statement.value] if statement.value else [])]
    header = compound_header(statement)
    if header is not None:
        return header
    if isinstance(statement, (ast.Return, ast.Expr, ast.Raise, ast.Assert)):
        return [statement]
    return []


def _frame_reads(view: _FrameView) -> Sequence[ast.AST]:
    """What the frame's line evaluates: a comprehension's frame runs only the comprehensions of its
    kind on that line, a lambda's frame only the lambdas' bodies, not the rest of the statement."""
    statement = view.statement
    if statement is None:
        return []
    reads = _reads(statement)
    if view.frame.function == "<lambda>":
        return [node.body for node in ast.walk(statement) if isinstance(node, ast.Lambda)] or reads
    kind = COMPREHENSION_FRAMES.get(view.frame.function)
    if kind is None:
        return reads
    comprehensions = [node for read in reads for node in ast.walk(read) if isinstance(node, kind)]
    return [part for comprehension in comprehensions for part in comprehension_body(comprehension)] or reads


def _container_reads(targets: Sequence[ast.expr]) -> Iterator[ast.expr]:
    """`buf[i] = v` reads `buf` (and `i`); `x = v` and `obj.x = v` read no tensor."""
    for target in targets:
        if isinstance(target, ast.Subscript):
            yield target.value
            yield target.slice
        elif isinstance(target, (ast.Tuple, ast.List)):
            yield from _container_reads(target.elts)
        elif isinstance(target, ast.Starred):
            yield from _container_reads([target.value])


# torch_npu checks only the source of a copy: its destination is written, never read.
_WRITES_ONLY_ITS_RECEIVER = frozenset({"copy_"})


# An operand: a reference chain, and whether it is a call's result (`f(n)`, `self.rope(n)`), which
# counts only when the call hands back what a cache keeps.
_Operand = tuple[list[ast.expr], bool]


def _operands(node: ast.AST) -> Iterator[_Operand]:
    """Reference chains an expression reads, in source order (see the module docstring)."""
    if isinstance(node, (ast.Starred, ast.Lambda)):
        return  # `*args` forwarding; a lambda's body does not run here
    if isinstance(node, ast.Call):
        yield from _call_operands(node)
        return
    if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)):
        parts = flatten(node)
        if parts is not None:
            yield parts, False
            for part in parts[1:]:
                if isinstance(part, ast.Subscript):
                    yield from _operands(part.slice)
                elif isinstance(part, ast.Call):
                    yield from _call_arguments(part)
            return
    for child in ast.iter_child_nodes(node):
        yield from _operands(child)


def _call_operands(call: ast.Call) -> Iterator[_Operand]:
    """A call's result, the object a method is called on (unless the method only writes it), the
    callee when it is computed, and the arguments."""
    result = flatten(call)
    if result is not None:
        yield result, True
    if isinstance(call.func, ast.Attribute):
        if call.func.attr not in _WRITES_ONLY_ITS_RECEIVER:
            yield from _receiver(call.func.value)
    elif not isinstance(call.func, ast.Name):
        yield from _operands(call.func)
    yield from _call_arguments(call)


def _receiver(node: ast.expr) -> Iterator[_Operand]:
    """The object a method is called on; a call there is a chain too: `get_tracker().clear()`."""
    parts = flatten(node) if isinstance(node, ast.Call) else None
    if parts is None:
        yield from _operands(node)
        return
    yield parts, False
    for part in parts:
        if isinstance(part, ast.Call):
            yield from _call_arguments(part)
        elif isinstance(part, ast.Subscript):
            yield from _operands(part.slice)


def _call_arguments(call: ast.Call) -> Iterator[_Operand]:
    for argument in call.args:
        yield from _operands(argument)
    for keyword in call.keywords:
        if keyword.arg is not None:  # `**kwargs` forwards
            yield from _operands(keyword.value)


# --- one traceback: culprit and tensor -------------------------------------------------------------


@dataclass(frozen=True)
class _Analysis:
    culprit: Frame | None
    tensor: TensorRef | None
    source_file: str | None
    notes: tuple[str, ...]
    source_differs: bool = False
    origin: Origin = Origin.LOG
    release: str | None = None
    alternatives: tuple[Alternative, ...] = ()

    def key(self) -> tuple:
        where = (self.culprit.file, self.culprit.line, self.culprit.function) if self.culprit else None
        return where, self.tensor


def _unsafe_link(traceback: Traceback) -> Traceback | None:
    """The innermost link of the chain that carries the unsafe-data error."""
    links = [link for link in traceback.chain() if is_unsafe_error(link)]
    return links[-1] if links else None


_Candidate = tuple[list[ast.expr], Resolved]


def _candidates(view: _FrameView, workspace: Workspace) -> list[_Candidate]:
    """The statement's tensor-ish operands with their resolution, in source order; with position
    markers, those the marked part reads (its `^` part first)."""
    if view.statement is None:
        return []
    operands = [operand for node in _frame_reads(view) for operand in _operands(node)]
    if view.marked is not None:
        operands = view.marked.narrow(operands, lambda operand: operand[0][-1])
    if view.partial and view.scope.functions:  # the unprinted rest of the statement may read any parameter
        operands += [([ast.Name(name, ast.Load())], False) for name in _parameters(view.scope.functions[-1])]
    arithmetic = _arithmetic_operands(view.statement)
    found = []
    for parts, call_result in operands:
        written = resolve_written(parts, view.statement, view.scope, workspace)
        if written is None or (call_result and not _hands_back_a_global(written[1])):
            continue
        if _guessed_constant(parts, written[1], arithmetic) or _holds_no_tensor(written[1]):
            continue
        found.append(written)
    return found


def _parameters(function: Function) -> list[str]:
    return [name for name in parameter_names(function) if name not in ("self", "cls")]


def _hands_back_a_global(resolved: Resolved) -> bool:
    """A call's result counts when it is what a global keeps: an lru cache's, or a global the
    function returns (`get_rotation_matrix(x)` returning `_ROTATION_MATRIX`)."""
    return resolved.cached or (resolved.tier == Tier.GLOBAL and resolved.name.variable is not None)


# Globals of Megatron's and MindSpeed's that hold the run's arguments, tokenizer, timers and writers:
# `args.shape_order` and `get_args().pre_tockens` read flags and numbers, never the unsafe tensor.
_NO_TENSOR_GLOBALS = frozenset(
    {
        "_GLOBAL_ARGS",
        "_GLOBAL_MINDSPEED_ARGS",
        "_MINDSPEED_ARGS",
        "_GLOBAL_TOKENIZER",
        "_GLOBAL_TIMERS",
        "_GLOBAL_TENSORBOARD_WRITER",
        "_GLOBAL_WANDB_WRITER",
        "_GLOBAL_ONE_LOGGER",
        "_GLOBAL_ADLR_AUTORESUME",
        "_GLOBAL_SIGNAL_HANDLER",
        "_GLOBAL_ENERGY_MONITOR",
        "_GLOBAL_NUM_MICROBATCHES_CALCULATOR",
    }
)


def _holds_no_tensor(resolved: Resolved) -> bool:
    return resolved.tier >= Tier.GUESS and resolved.name.variable in _NO_TENSOR_GLOBALS


def _guessed_constant(parts: list[ast.expr], resolved: Resolved, arithmetic: set[int]) -> bool:
    """Without source, `y * CLIP_FACTOR`: a public ALL_CAPS name that is a plain operand of arithmetic
    is a constant by convention (PEP 8), never guessed a tensor. A module-private one (`x * _EMA`)
    and any name subscripted, called or written (`_TRACKER[name]`, `BUF += x`) is still guessed. With
    source, a name bound to a literal is never a tensor (`resolve`'s constant flags)."""
    variable = resolved.name.variable or ""
    return resolved.tier == Tier.GUESS and id(parts[-1]) in arithmetic and not variable.startswith("_")


def _arithmetic_operands(statement: ast.stmt) -> set[int]:
    """Ids of the bare names and attributes (`SCALE`, `mod.SCALE`) that are direct operands of arithmetic."""
    found: set[int] = set()
    for node in ast.walk(statement):
        operands: tuple[ast.expr, ...] = ()
        if isinstance(node, ast.BinOp):
            operands = (node.left, node.right)
        elif isinstance(node, ast.UnaryOp):
            operands = (node.operand,)
        found.update(id(operand) for operand in operands if isinstance(operand, (ast.Name, ast.Attribute)))
    return found


def _choose_culprit(frames: Sequence[Frame], views: _FrameViews) -> tuple[int, _FrameView, list[_Candidate]] | None:
    """Innermost non-internal frame whose statement touches a tensor-ish operand (or whose source is
    unknown); else the innermost non-internal frame; None when every frame is internal."""
    fallback = None
    for index in range(len(frames) - 1, -1, -1):
        if is_internal_file(frames[index].file):
            continue
        view = views.view(frames[index])
        candidates = _candidates(view, views.workspace)
        if view.statement is None or candidates:
            return index, view, candidates
        fallback = fallback or (index, view, candidates)
    return fallback


def _guarded_analysis(frames: tuple[Frame, ...], views: _FrameViews) -> _Analysis:
    """A statement nested deeper than Python's recursion limit (generated code, an attack) leaves
    the culprit unnamed, with a note, instead of ending the run."""
    try:
        return _analyse(frames, views)
    except RecursionError:
        culprit = next((frame for frame in reversed(frames) if not is_internal_file(frame.file)), None)
        where = f"{culprit.file}:{culprit.line}" if culprit else "the culprit line"
        return _Analysis(culprit, None, None, (f"{where} is nested too deeply to analyse: the tensor cannot be named",))


def _analyse(frames: tuple[Frame, ...], views: _FrameViews) -> _Analysis:
    chosen = _choose_culprit(frames, views)
    if chosen is None:
        reason = "every frame is inside torch or the Python standard library"
        return _Analysis(None, None, None, (reason if frames else "the traceback has no frames",))
    index, view, candidates = chosen
    enclosing = _enclosing_index(frames, index)
    shown = view if enclosing is None else views.view(frames[enclosing])  # the function a comprehension runs in
    culprit = replace(shown.frame, source=shown.source_line) if shown.source_line else shown.frame
    source_file = str(view.scope.source.path) if view.scope.source else None
    notes = list(view.notes)
    if not candidates:
        if view.statement is None:
            notes.append("no source for the culprit line: the tensor cannot be named")
        return _Analysis(culprit, None, source_file, _unique(notes), view.differs, view.origin, view.release)
    option, others = _choose_tensor(_Site(frames=frames, index=index, view=view, views=views), candidates)
    parts, resolved, caller = option.parts, option.resolved, option.caller
    text = view.text
    if caller is not None:
        text = caller.text
        notes.extend(caller.notes)
        where = f"{caller.frame.file}:{caller.frame.line} ({caller.frame.function})"
        notes.append(f"{culprit.function}() got the tensor as a parameter: followed to {where}")
    elif resolved.parameter:
        where = f"{culprit.function}()"
        notes.append(f"{resolved.parameter} is a parameter of {where}: its caller could not be followed")
    notes.extend(resolved.notes)
    notes.extend(_path_notes(option, others, skeleton=view.origin is Origin.INDEX))
    assumed = views.workspace.assumed_releases.get(resolved.name.module or "")
    if assumed:
        notes.append(
            f"{resolved.name.module} was read from the index of {assumed}: no frame of the log is of that "
            "framework, so its newest release there stands in"
        )
    expression = _expression_text(parts, resolved.anchor, text)
    entry = frames[0]  # the outermost frame: `<module>` of the script the job ran, as `__main__`
    runs_as_main = (
        entry.function == "<module>"
        and resolved.name.module is not None
        and views.view(entry).scope.module == resolved.name.module
    )
    tensor = TensorRef(expression, resolved.name, resolved.cached, runs_as_main)
    read = caller or view
    alternatives = tuple({(each.variable, each.module): each for each in _alternatives(option, others)}.values())
    return _Analysis(culprit, tensor, source_file, _unique(notes), view.differs, read.origin, read.release, alternatives)


def _alternatives(chosen: _Option, others: list[_Option]) -> list[Alternative]:
    found = [
        Alternative(
            each.resolved.name.variable or "",
            each.resolved.name.module,
            each.path.describe().removeprefix("on ")
            if each.path is not None and each.path.test is not None
            else "on another path",
        )
        for each in chosen.undecided
    ]
    found += [
        Alternative(each.resolved.name.variable or "", each.resolved.name.module, "another operand of the line")
        for each in others
    ]
    return found


@dataclass(frozen=True)
class _Site:
    """Where the culprit line's operands are read: frame `index` of the unsafe link's `frames`, as
    `view` shows it; `views` shows the frames that called it, where a parameter is followed."""

    frames: Sequence[Frame]
    index: int
    view: _FrameView
    views: _FrameViews

    def caller(self) -> _Site | None:
        """The frame that called this one's function, when it is framework code (not internal)."""
        calling = _caller_index(self.frames, self.index)
        if calling is None or is_internal_file(self.frames[calling].file):
            return None
        return replace(self, index=calling, view=self.views.view(self.frames[calling]))


@dataclass(frozen=True)
class _Option:
    """What one operand of the culprit line may be: the chain that names it, in the frame it was
    resolved in (`caller`: a frame up, for a parameter), and the path it was bound on."""

    parts: list[ast.expr]
    resolved: Resolved
    caller: _FrameView | None
    path: Route | None = None
    because: str | None = None  # what chose the path: the arguments dump
    undecided: tuple[_Option, ...] = ()  # the paths' globals the log cannot choose between
    operand: str | None = None  # for an option of a path: the operand as the line reads it
    others: tuple[str, ...] = ()  # the values of the operand's other paths, which reach no global

    def names(self) -> tuple[str | None, str | None]:
        return self.resolved.name.module, self.resolved.name.variable


def _choose_tensor(site: _Site, candidates: list[_Candidate]) -> tuple[_Option, list[_Option]]:
    """The best-tiered option of every operand, leftmost on ties; parameters count as what the
    caller passed, a local bound on several paths as each value (the dump picks among them).
    Returns the choice and the other options that name a global too."""
    options: list[_Option] = []
    for parts, resolved in candidates:
        options.extend(_options(site, parts, resolved))
    options = [option for option in options if not _holds_no_tensor(option.resolved)] or options
    best = max(options, key=lambda option: option.resolved.tier)
    others = [
        option
        for option in options
        if option.resolved.tier >= Tier.GUESS and option.resolved.name.variable and option.names() != best.names()
    ]
    return best, list({option.names(): option for option in others}.values())


def _options(site: _Site, parts: list[ast.expr], resolved: Resolved) -> list[_Option]:
    """One operand's options: as resolved, or, when a path it was bound on reaches a global, each path."""
    direct = _followed(site, parts, resolved)
    paths = _paths(site.view, parts, resolved)
    if not paths:
        return [direct]
    kept, because = decided(paths, site.views.switches)
    options = []
    for path in kept:
        if path.value is None:
            option = (
                _followed(site, parts, resolved)
                if resolved.parameter
                else _Option(parts, replace(resolved, tier=min(resolved.tier, Tier.SELF)), None)
            )
            options.append(replace(option, path=path, because=because))
            continue
        bound = _bound(site, path.value) or [_Option(parts, _unresolved_local(resolved), None)]
        options.extend(replace(option, path=path, because=because) for option in bound)
    named = {option.names(): option for option in options if option.resolved.tier >= Tier.GUESS and option.resolved.name.variable}
    if not named or (len(named) == 1 and direct.names() in named):
        return [direct]  # the paths name no global, or the one the operand's own reading names
    operand = ast.unparse(parts[-1] if parts[0] is not parts[-1] and _is_self(parts) else parts[0])
    if len(named) < 2:
        [found] = named.values()
        others = tuple(_shown(option.path) for option in options if option.names() != found.names())
        return [replace(found, operand=operand, others=others)]
    # the local itself, which the rules of its frame may know (a consumer that pops a queue)
    return [_Option(parts, resolved, None, undecided=tuple(named.values()), operand=operand)]


def _is_self(parts: list[ast.expr]) -> bool:
    return isinstance(parts[0], ast.Name) and parts[0].id in ("self", "cls") and len(parts) > 1


def _shown(path: Route | None) -> str:
    if path is None or path.value is None:
        return "the value passed in"
    return f"`{one_line(ast.unparse(path.value))}`{_when(path)}"


def _when(path: Route | None) -> str:
    return f" ({path.describe()})" if path is not None and path.test is not None else ""


def _paths(view: _FrameView, parts: list[ast.expr], resolved: Resolved) -> list[Route]:
    """The paths a local, parameter or `self.attr` was bound on before the line, when several."""
    functions = view.scope.functions
    if not functions or view.scope.line is None or view.statement is None:
        return []
    root = parts[0]
    if not isinstance(root, ast.Name):
        return []
    if root.id in ("self", "cls"):
        if len(parts) < 2 or not isinstance(parts[1], ast.Attribute) or resolved.tier != Tier.SELF:
            return []
        target: ast.expr = parts[1]
    elif resolved.tier in (Tier.LOCAL, Tier.PARAMETER, Tier.GLOBAL) and resolved.anchor == 0:
        target = root
    else:
        return []
    skeleton = view.origin is Origin.INDEX
    return paths_to(functions[-1], target, view.statement.lineno if not skeleton else view.scope.line + 1, skeleton=skeleton)


def _unresolved_local(resolved: Resolved) -> Resolved:
    return replace(resolved, tier=Tier.LOCAL, name=replace(resolved.name, variable=None), parameter=None, cached=False)


def _bound(site: _Site, value: ast.expr, depth: int = 0) -> list[_Option]:
    """The options a bound value gives: the chain it reads, resolved before its own line; a local
    that names nothing is followed to the values it was bound to before (`total_input =
    ag_inputs`, `ag_inputs = AG_INPUTS.pop(0)`)."""
    value_parts = flatten(comprehension_element(value))
    if value_parts is None:
        return []
    earlier = replace(site.view.scope, line=value.lineno - 1)
    written = resolve_written(value_parts, value, earlier, site.views.workspace)
    if written is None:
        return []
    parts, resolved = written
    if resolved.parameter:
        return [_followed(site, parts, resolved)]
    functions = site.view.scope.functions
    if resolved.tier >= Tier.GUESS or not isinstance(value, ast.Name) or depth >= 2 or not functions:
        return [_Option(parts, resolved, None)]
    before = earlier_values(functions[-1], value.id, value.lineno)
    deeper = [option for each in before for option in _bound(site, each, depth + 1)]
    return deeper or [_Option(parts, resolved, None)]


def _followed(site: _Site, parts: list[ast.expr], resolved: Resolved) -> _Option:
    followed = _follow_parameter(site, resolved.parameter) if resolved.parameter else None
    return _Option(*followed) if followed else _Option(parts, resolved, None)


def _follow_parameter(site: _Site, name: str, depth: int = 0) -> tuple[list[ast.expr], Resolved, _FrameView] | None:
    """The argument the caller frame passed for parameter `name`, resolved in the caller (repeatedly
    while it is again a parameter); None unless that names something (a global, `self.x`, ...)."""
    functions = site.view.scope.functions
    caller = site.caller() if depth <= MAX_DEPTH and functions else None
    if caller is None:
        return None
    statement = caller.view.statement
    argument = _argument_for(caller.view, functions[-1], name) if statement else None
    parts = flatten(argument) if argument is not None else None
    written = resolve_written(parts, statement, caller.view.scope, site.views.workspace) if parts and statement else None
    if written is None:
        return None
    parts, resolved = written
    if resolved.parameter:
        return _follow_parameter(caller, resolved.parameter, depth + 1)
    return (parts, resolved, caller.view) if resolved.tier > Tier.PARAMETER else None


def _path_notes(chosen: _Option, others: list[_Option], *, skeleton: bool) -> list[str]:
    """Which path the value was bound on, and the other globals the line may have read."""
    notes = []
    if chosen.undecided:
        notes.append(
            f"{chosen.operand} is bound on several paths the log does not choose between: "
            + "; ".join(
                f"{each.resolved.name.variable} of {each.resolved.name.module}{_when(each.path)}" for each in chosen.undecided
            )
        )
    elif chosen.path is not None:
        if chosen.because:
            why = f"{chosen.because}, so the value read is {_shown(chosen.path)}"
        elif skeleton:
            why = f"the release's index keeps no branches: taken as {_shown(chosen.path)}, the path that reaches a global"
        else:
            why = f"taken as {_shown(chosen.path)}, the path that reaches a global"
        rest = f"; otherwise {', or '.join(chosen.others)}" if chosen.others else ""
        notes.append(f"{chosen.operand} is bound on several paths: {why}{rest}")
    for other in others:
        notes.append(
            f"the line may also have read {other.resolved.name.variable} of {other.resolved.name.module}: "
            "two globals remain, the sentinel names the one that was unsafe"
        )
    return notes


def _enclosing_index(frames: Sequence[Frame], index: int) -> int | None:
    """For a comprehension's frame, the frame of the function it runs in: the one before it, at the
    same file and line; None for any other frame (or a generator consumed elsewhere)."""
    frame = frames[index]
    if frame.function not in COMPREHENSION_FRAMES or index == 0:
        return None
    before = frames[index - 1]
    return index - 1 if (before.file, before.line) == (frame.file, frame.line) else None


def _caller_index(frames: Sequence[Frame], index: int) -> int | None:
    """The frame that called the function of frames[index]: the one before it, or before the
    function's own frame when frames[index] is a comprehension's."""
    enclosing = _enclosing_index(frames, index)
    calling = (index if enclosing is None else enclosing) - 1
    return calling if calling >= 0 else None


def _argument_for(caller: _FrameView, function: Function, name: str) -> ast.expr | None:
    """The argument the caller's statement passes for parameter `name` of `function`: in a call
    of `function` by name, else, in a wrapper (MindSpeed's adaptors: `return fn(self, query, ...)`),
    in its one call of a function it was handed (a parameter or closure variable)."""
    assert caller.statement is not None
    positional = [argument.arg for argument in (*function.args.posonlyargs, *function.args.args)]
    calls = [node for node in ast.walk(caller.statement) if isinstance(node, ast.Call)]
    named = [node for node in calls if callee_name(node.func) == function.name]
    handed = {each for outer in caller.scope.functions for each in parameter_names(outer)}
    wrapped = [node for node in calls if isinstance(node.func, ast.Name) and node.func.id in handed]
    for node in named or (wrapped if len(wrapped) == 1 else []):
        for keyword in node.keywords:
            if keyword.arg == name:
                return keyword.value
        if name in positional:
            position = positional.index(name)
            if isinstance(node.func, ast.Attribute) and positional[0] in ("self", "cls"):
                position -= 1  # bound method: self is not in the call's arguments
            before = node.args[: position + 1]
            if 0 <= position < len(node.args) and not any(isinstance(argument, ast.Starred) for argument in before):
                return node.args[position]
    return None


def _expression_text(parts: list[ast.expr], anchor: int, text: str | None) -> str:
    """The chain up to the anchor, plus the subscript right after it, as written in the source."""
    end = anchor + 1 if anchor + 1 < len(parts) and isinstance(parts[anchor + 1], ast.Subscript) else anchor
    node = parts[end]
    segment = source_segment(text, node) if text else None
    return one_line(segment or ast.unparse(node))


def _unique(notes: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(notes))


# --- folding ---------------------------------------------------------------------------------------


def _rank_of(traceback: Traceback, unsafe: Traceback) -> int | None:
    """The log's rank prefix, else torch_npu's RankID (-1 means RANK was unset)."""
    for rank in (traceback.rank, unsafe.rank, unsafe.npu_rank, traceback.npu_rank):
        if rank is not None and rank >= 0:
            return rank
    return None


def _fold(members: Sequence[tuple[Traceback, Traceback, _Analysis]]) -> Finding:
    first, unsafe, analysis = members[0]
    ranks = sorted({rank for rank in (_rank_of(tb, link) for tb, link, _ in members) if rank is not None})
    return Finding(
        ranks=tuple(ranks),
        traceback=first,
        unsafe=unsafe,
        culprit=analysis.culprit,
        tensor=analysis.tensor,
        source_file=analysis.source_file,
        notes=analysis.notes,
        source_differs=analysis.source_differs,
        origin=analysis.origin,
        release=analysis.release,
        alternatives=analysis.alternatives,
    )
