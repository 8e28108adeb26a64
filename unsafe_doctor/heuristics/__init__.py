"""Scenario evidence from source code, for globals no rule knows.

Scenario 1: the tensor is reset every iteration (zeroed, cleared or rebound by a function the
training step calls). Scenario 2: it carries state into the next iteration (updated from its own
previous value, read to compute parameters, losses or the next step's inputs, a registered buffer
that nothing resets). Each piece of evidence is reported as (file, line, what was seen).

Where the evidence comes from: the module defining the global, the culprit's file, and the Python
files under the module's top-level package and the source roots (at most `MAX_FILES`, skipping
virtual environments and tests) that name the variable or one of its accessors (module functions
that `return` it). Files are parsed with `ast`, never imported. The tensor is followed through
local aliases (`tracker = get_tracker()`, `for t in tracker.values()`, `lst.append(module.x)`) and
values computed from it (`y = f(x)`, any call taking it; not through `group=` / `stream=`
handles), one function at a time.

Rules of evidence, per statement that touches the tensor (or an element of it):

* **reset** (1): `.zero_()`, `.fill_(const)`, `.clear()`, `.cache_clear()`, `del X[k]`,
  `.copy_(zeros)`, rebinding to `{}` / `[]` / `None` / `torch.zeros(...)`; not at module level nor
  in set-up functions (`__init__`, `init_*`, `setup*`, `build*`). It runs *every iteration* when
  its function is named like a training or logging step (`train_step`, `training_log`,
  `forward_backward_*`, `track_*_metrics`; not a helper named for what it does, `reset_loss_log`),
  sits in a loop of a train-like function, or is called from such a function (up to three calls
  up, matched by name); that call site is a further piece (**per-step**). A reset reached only
  from logging functions is *for logging*.
* **accumulate**: `+=` / `.add_()`; scenario 1 when the value is detached (`.detach()`, under
  `torch.no_grad()`) or the tensor is reset somewhere, else a running total carried on (2).
* **log-read** (1): passed to a logging call (`print`, `writer.add_scalar`, `logger.*`, `wandb`);
  dropped when a training read exists.
* **overwrite** (1): `.copy_(v)` / rebinding from values that do not involve itself. Inside
  `if X is None:` / `if k not in X:` a store builds what is missing and says nothing.
* **cache** (1): an `lru_cache` function; a dict filled under keys built from shapes or dtypes.
* **queue** (1): entries appended and popped (consumed within the step).
* **buffer** : `register_buffer("x", ..., persistent=False)` (1); a persistent one (2) only when
  it is also updated in place and never reset.
* **self-update** (2): rebuilt from its own value: `X = X * d + v`, `.mul_()` / `.lerp_()` / ...,
  `.copy_(f(X))` (a copy of a *computed* value: restoring a saved clone does not count).
* **training-read** (2): outside logging functions (named so, or logging without `backward` /
  `step`), the tensor or a value computed from it feeds a name about training
  (`loss`, `grad`, `param`, `lr`, `scale`: an assigned name, a keyword argument, the receiver of
  an in-place update, the return of such a function) or a `.backward()`.

Weighing: strong evidence is reset (1), self-update and training-read (2). Strong evidence for one
side only decides; for both, 2 wins when the value is carried (self-update) or every reset is for
logging, else 1 (a value reset every step is recomputed). Weak evidence alone decides by majority.
Confidence is `medium` with two or more kinds of evidence for the chosen side and none against,
else `low`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from unsafe_doctor.source.files import is_file, python_files
from unsafe_doctor.source.imports import Imports
from unsafe_doctor.source.syntax import (
    Function,
    child_statements,
    compound_header,
    is_cache_decorator,
    is_empty_value,
    parameter_names,
    walk_scope,
)
from unsafe_doctor.source.workspace import SourceFile, Workspace
from unsafe_doctor.subject import Evidence, Subject, TensorRef

MAX_FILES = 2000
MAX_EVIDENCE = 8
MAX_PER_KIND = 3
MAX_FILE_BYTES = 2_000_000
MAX_CALLER_DEPTH = 3

_TRAIN_TOKENS = frozenset(
    {"loss", "losses", "grad", "grads", "gradient", "gradients", "param", "params", "parameter", "parameters",
     "lr", "scale", "scaled", "scaler"}
)
_STEP_TOKENS = frozenset(
    {"train", "training", "step", "iteration", "forward", "backward", "log", "logging", "metrics", "track",
     "finalize", "fit"}
)
_HELPER_TOKENS = frozenset({"reset", "clear", "zero", "destroy", "init", "initialize", "get", "set"})
_INIT_TOKENS = frozenset({"init", "initialize", "initialise", "setup", "build", "create"})
_TRAIN_LOOP_TOKENS = frozenset({"train", "training", "fit", "run", "main", "loop", "pretrain"})
_REPORT_TOKENS = frozenset({"log", "logging", "logs", "metric", "metrics", "track", "report", "summary", "tensorboard"})
_LOG_CALLS = frozenset(
    {"print", "print_rank_0", "print_rank_last", "log_single_rank", "add_scalar", "add_scalars", "add_histogram",
     "log", "info", "debug", "warning"}
)
_LOG_RECEIVERS = frozenset({"logger", "logging", "wandb", "writer", "wandb_writer", "tb_writer"})
_TRAIN_CALLS = frozenset({"backward", "step", "zero_grad"})

_RESET_METHODS = frozenset({"zero_", "clear", "cache_clear"})
_ACCUMULATE_METHODS = frozenset({"add_", "sub_", "index_add_", "scatter_add_"})
_DECAY_METHODS = frozenset({"mul_", "div_", "lerp_", "addcmul_", "addcdiv_", "pow_", "sqrt_", "clamp_", "exp_"})
_QUEUE_ADD = frozenset({"append", "appendleft", "extend", "insert"})
_QUEUE_TAKE = frozenset({"pop", "popleft"})
_COPY_CALLS = frozenset(
    {"clone", "detach", "to", "float", "half", "bfloat16", "double", "cpu", "cuda", "npu", "contiguous", "stack",
     "cat", "view", "reshape", "flatten", "deepcopy", "copy", "item", "tolist", "list", "dict", "tuple"}
)
_FRESH_CALLS = frozenset(
    {"zeros", "empty", "zeros_like", "empty_like", "dict", "list", "set", "deque", "OrderedDict", "defaultdict"}
)  # called with any arguments: `torch.zeros(n)`, `defaultdict(float)`
_METADATA_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"})
_METADATA_METHODS = frozenset({"size", "numel", "dim", "element_size", "keys", "nelement", "data_ptr"})
_ELEMENT_METHODS = frozenset({"items", "values", "get", "setdefault"})
_SHAPE_TOKENS = frozenset({"shape", "size", "dtype", "device", "len", "numel", "seq", "seqlen"})
_HANDLE_TOKENS = frozenset({"group", "pg", "stream", "communicator", "comm"})  # keyword arguments that carry no data

Kind = Literal[
    "reset", "per-step", "accumulate", "log-read", "overwrite", "cache", "queue", "buffer", "self-update",
    "training-read",
]
_STRONG = {"reset": 1, "self-update": 2, "training-read": 2}
_ORDER = ("reset", "per-step", "self-update", "training-read", "accumulate", "buffer", "overwrite", "cache", "queue",
          "log-read")


@dataclass(frozen=True)
class Verdict:
    scenario: Literal[1, 2] | None
    confidence: Literal["medium", "low"] | None
    reason: str  # one or two sentences; with no verdict, what the user should check
    evidence: tuple[Evidence, ...]


def judge(subject: Subject, workspace: Workspace) -> Verdict:
    """Scenario 1 or 2 from the evidence in the source, with how sure; None with what to check.

    `workspace`: the command's, over the source roots (`context.Groundwork`)."""
    tensor = subject.tensor
    if tensor is None or not tensor.variable or not tensor.variable.isidentifier():
        shown = tensor.expression if tensor else "the tensor"
        return Verdict(
            None, None,
            f"The log does not name the global behind {shown}: read the culprit line and check whether it "
            "depends on training iterations.",
            (),
        )
    return _Study(subject, tensor, workspace).verdict()


# --- names ------------------------------------------------------------------------------------------

def _tokens(name: str) -> set[str]:
    """`train_step` -> {train, step}; `forwardBackward` -> {forward, backward}."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return {token.lower() for token in spaced.split("_") if token}


def _callee(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _target_name(node: ast.expr) -> str | None:
    """The identifier an assignment target is about: `loss`, `self.loss`, `group["lr"]` -> lr."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return key.value
        return _target_name(node.value)
    return None


def _dotless(node: ast.expr) -> str:
    """`(x.shape, x.dtype)` -> `(x_shape, x_dtype)`: its words, for token matching."""
    return ast.unparse(node).replace(".", "_")


def _is_logging_call(call: ast.Call) -> bool:
    name = _callee(call.func)
    receiver = _root_name(call.func.value) if isinstance(call.func, ast.Attribute) else None
    return name in _LOG_CALLS or receiver in _LOG_RECEIVERS


def _is_fresh(value: ast.expr) -> bool:
    """A value a reset rebinds to: None, an empty literal, a new zeroed tensor or empty container."""
    return is_empty_value(value) or (isinstance(value, ast.Call) and _callee(value.func) in _FRESH_CALLS)


def _calls_in(nodes: Sequence[ast.AST]) -> Iterator[ast.Call]:
    """Calls in expressions, not inside lambdas."""
    pending = list(nodes)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Call):
            yield node
        pending.extend(ast.iter_child_nodes(node))


def _header(statement: ast.stmt) -> Sequence[ast.AST]:
    """The expressions a statement evaluates itself (a compound statement's header only)."""
    header = compound_header(statement)
    if header is not None:
        return header
    if isinstance(statement, (ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return []
    return [child for child in ast.iter_child_nodes(statement) if isinstance(child, ast.expr)]


def _functions(body: Sequence[ast.stmt], class_name: str | None) -> Iterator[tuple[Function, str | None]]:
    """Every function and method, nested ones too, with the class whose `self` it sees."""
    for statement in body:
        if isinstance(statement, ast.ClassDef):
            yield from _functions(statement.body, statement.name)
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield statement, class_name
            yield from _functions(statement.body, class_name)
        else:
            yield from _functions(child_statements(statement), class_name)


def _is_reporting(name: str, calls: Sequence[ast.Call] = ()) -> bool:
    """A logging function: named so, or its calls log and drive no training (no backward, step)."""
    if _tokens(name) & _REPORT_TOKENS:
        return True
    logs = any(_is_logging_call(call) for call in calls)
    return logs and not any(_callee(call.func) in _TRAIN_CALLS for call in calls)


# --- evidence ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Event:
    kind: Kind
    path: Path
    line: int
    what: str
    detached: bool = False  # accumulate: of detached values
    persistent: bool = False  # buffer: saved with the model
    for_logging: bool = False  # reset: done only by or for logging functions
    function: str = ""


@dataclass(frozen=True)
class _CallSite:
    callee: str
    caller: str  # enclosing function, '<module>' at module level
    path: Path
    line: int
    in_loop: bool


class _Study:
    """Evidence about one tensor, gathered over the files in scope."""

    def __init__(self, subject: Subject, tensor: TensorRef, workspace: Workspace):
        self.subject = subject
        self.variable: str = tensor.variable or ""
        self.owner = tensor.owner
        self.attribute = tensor.owner is not None or tensor.expression.startswith(("self.", "cls."))
        self.roots = workspace.source_roots
        self.workspace = workspace
        self.module = tensor.module
        self.events: dict[tuple[Kind, Path, int], _Event] = {}
        self.texts: dict[Path, str] = {}  # the files in scope ("" when unreadable or too large)
        self.truncated = False
        self.referencing: list[Path] = []
        self.sites: dict[Path, list[_CallSite]] = {}
        self.defining: SourceFile | None = None
        self.accessors: set[str] = set()
        self.classes_here: set[str] = set()
        self.queue_filled = False  # entries are appended to it somewhere
        self.queue_takes: list[tuple[_FunctionStudy, ast.stmt]] = []

    # files

    def _culprit_path(self) -> Path | None:
        printed = self.subject.source_file or (self.subject.frame.file if self.subject.frame else None)
        return Path(printed) if printed and is_file(Path(printed)) else None

    def _package_dir(self, module: str | None) -> Path | None:
        if not module:
            return None
        found = self.workspace.module_path(module.split(".")[0])
        if found is None:
            return None
        return found.parent if found.name == "__init__.py" else found

    def _scope(self) -> list[Path]:
        """Defining module, culprit file, then the module's package and the source roots, bounded."""
        first = []
        defining = self.workspace.module_path(self.module) if self.module else None
        for path in (defining, self._culprit_path()):
            if path is not None and path.is_file() and path not in first:
                first.append(path)
        culprit = self._culprit_path()
        culprit_module = self.workspace.find(str(culprit)).module if culprit else None
        folders = [self._package_dir(self.module), self._package_dir(culprit_module), *self.roots]
        files = list(first)
        seen = {path.resolve() for path in first}
        for folder in dict.fromkeys(folder.resolve() for folder in folders if folder is not None):
            for path in python_files(folder):  # under a resolved folder: compared as they are
                if len(files) >= MAX_FILES:
                    self.truncated = True
                    return files
                if path not in seen:
                    seen.add(path)
                    files.append(path)
        return files

    def _read(self, path: Path) -> str | None:
        if path not in self.texts:
            try:
                small = path.stat().st_size <= MAX_FILE_BYTES
            except OSError:
                small = False
            self.texts[path] = (self.workspace.text(path) if small else None) or ""
        return self.texts[path] or None

    def parse(self, path: Path) -> SourceFile | None:
        """A file in scope, parsed once by the workspace; None when unreadable, too large or invalid."""
        if self._read(path) is None:
            return None
        return self.workspace.source(path, self.workspace.find(str(path)).module)

    def shown(self, path: Path) -> str:
        resolved = path.resolve()
        for root in self.roots:
            if resolved.is_relative_to(root.resolve()):
                return resolved.relative_to(root.resolve()).as_posix()
        return str(path)

    # gathering

    def gather(self) -> None:
        files = self._scope()
        for path in files:
            self._read(path)  # all read first: a reset's callers may be in any of them
        defining = self.workspace.module_path(self.module) if self.module else None
        self.defining = self.parse(defining) if defining is not None and defining.is_file() else None
        if self.defining is not None:
            self.classes_here = {node.name for node in ast.walk(self.defining.tree) if isinstance(node, ast.ClassDef)}
            if not self.attribute:
                self.accessors = self._accessors(self.defining)
                self._lru_cache(self.defining)
        names = (self.variable, *sorted(self.accessors))
        alternatives = "|".join(map(re.escape, names))
        as_words = re.compile(rf"\b(?:{alternatives})\b")
        for path in files:
            text = self.texts[path]
            named = any(name in text for name in names) and as_words.search(text)  # substring first: fast
            parsed = self.parse(path) if named else None
            if parsed is not None:
                self.referencing.append(path)
                _FileStudy(self, parsed).run()
        self._queues()

    def _accessors(self, parsed: SourceFile) -> set[str]:
        """Module functions that return the global itself (`get_x()` is then the global)."""
        found = set()
        for statement in parsed.tree.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in walk_scope(statement):
                    returned = node.value if isinstance(node, ast.Return) else None
                    if isinstance(returned, ast.Name) and returned.id == self.variable:
                        found.add(statement.name)
        return found

    def _lru_cache(self, parsed: SourceFile) -> None:
        for statement in parsed.tree.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == self.variable:
                for decorator in statement.decorator_list:
                    if is_cache_decorator(decorator):
                        code = parsed.lines[decorator.lineno - 1].strip()
                        what = f"{self.variable}() is an lru_cache, rebuilt deterministically: `{code}`"
                        self.add("cache", parsed.path, decorator.lineno, what)

    def add(self, kind: Kind, path: Path, line: int, what: str, **flags) -> _Event:
        event = _Event(kind, path, line, what, **flags)
        self.events.setdefault((kind, path, line), event)
        return self.events[(kind, path, line)]

    def _queues(self) -> None:
        if self.queue_filled:
            for function, statement in self.queue_takes:
                function.add("queue", statement, "entries appended elsewhere are consumed")

    # who calls a reset

    def call_sites(self, callee: str) -> list[_CallSite]:
        found: list[_CallSite] = []
        for path, text in self.texts.items():
            if text and callee in text:
                if path not in self.sites:
                    parsed = self.parse(path)
                    self.sites[path] = _call_sites(parsed.tree, path) if parsed else []
                found.extend(site for site in self.sites[path] if site.callee == callee)
        return sorted(found, key=lambda site: (str(site.path), site.line))

    def every_iteration(self, function: str, depth: int = 0) -> list[_CallSite] | None:
        """The chain of call sites by which `function` runs every iteration, nearest first."""
        sites = self.call_sites(function)
        for site in sites:
            if _per_step(site.caller, site.in_loop):
                return [site]
        if depth + 1 < MAX_CALLER_DEPTH:
            for site in sites:
                if site.caller not in ("<module>", function):
                    chain = self.every_iteration(site.caller, depth + 1)
                    if chain:
                        return [site, *chain]
        return None

    # deciding

    def verdict(self) -> Verdict:
        self.gather()
        variable = self.variable
        if self.defining is None and not self.referencing:
            return Verdict(None, None, f"Could not read the source of {variable}: pass --source-root pointing at the "
                                       "training code.", ())
        one, two = self._sides()
        suffix = f" (searched the first {MAX_FILES:,} files only)" if self.truncated else ""
        if not one and not two:
            files = self.referencing or ([self.defining.path] if self.defining else [])
            return Verdict(None, None, f"Found no reset and no carried state for {variable} in {self._files(files)}: "
                                       f"check whether it depends on training iterations{suffix}.", ())
        strong_one = any(_STRONG.get(event.kind) == 1 for event in one)
        strong_two = any(_STRONG.get(event.kind) == 2 for event in two)
        scenario: Literal[1, 2]
        if strong_one and strong_two:
            resets = [event for event in one if event.kind == "reset"]
            carried = any(event.kind == "self-update" for event in two)
            scenario = 2 if carried or all(event.for_logging for event in resets) else 1
        elif strong_one or strong_two:
            scenario = 1 if strong_one else 2
        elif len(_kinds(one)) != len(_kinds(two)):
            scenario = 1 if len(_kinds(one)) > len(_kinds(two)) else 2
        else:
            reason = (f"Mixed evidence for {variable}: {_summary(one, 1)}, but {_summary(two, 2)}: check whether it "
                      f"depends on training iterations{suffix}.")
            return Verdict(None, None, reason, self._lines(one, two))
        chosen, other = (one, two) if scenario == 1 else (two, one)
        confidence: Literal["medium", "low"] = "medium" if len(_kinds(chosen)) >= 2 and not other else "low"
        if scenario == 1:
            reason = f"{variable} looks independent of the training iterations: {_summary(chosen, 1)}"
        else:
            reason = f"{variable} carries state into the next iteration: {_summary(chosen, 2)}"
        if other:
            reason += f"; but {_summary(other, scenario % 2 + 1)}: check by hand"
        return Verdict(scenario, confidence, reason + suffix + ".", self._lines(chosen, other))

    def _sides(self) -> tuple[list[_Event], list[_Event]]:
        events = list(self.events.values())
        kinds = {event.kind for event in events}
        reset = "reset" in kinds
        one: list[_Event] = []
        two: list[_Event] = []
        for event in events:
            if event.kind == "accumulate":
                (one if event.detached or reset else two).append(event)
            elif event.kind == "log-read":
                if "training-read" not in kinds:
                    one.append(event)
            elif event.kind == "buffer":
                updated = "self-update" in kinds or any(e.kind == "accumulate" and not e.detached for e in events)
                if not event.persistent:
                    one.append(event)
                elif updated and not reset:
                    two.append(event)
            elif event.kind in ("self-update", "training-read"):
                two.append(event)
            else:
                one.append(event)
        return one, two

    def _lines(self, chosen: list[_Event], other: list[_Event]) -> tuple[Evidence, ...]:
        """The chosen side's evidence first, strongest kinds first, at most a few lines of each kind."""
        lines: list[Evidence] = []
        for side in (chosen, other):
            shown: dict[Kind, int] = {}
            for event in sorted(side, key=lambda event: (_ORDER.index(event.kind), str(event.path), event.line)):
                shown[event.kind] = shown.get(event.kind, 0) + 1
                if shown[event.kind] <= MAX_PER_KIND:
                    lines.append(Evidence(self.shown(event.path), event.line, event.what))
        return tuple(lines[:MAX_EVIDENCE])

    def _files(self, paths: list[Path]) -> str:
        shown = [self.shown(path) for path in paths[:3]]
        more = f" and {len(paths) - 3} more files" if len(paths) > 3 else ""
        return ", ".join(shown) + more if shown else "the source"


def _kinds(events: list[_Event]) -> set[Kind]:
    return {event.kind for event in events}


def _summary(events: list[_Event], scenario: int) -> str:
    """The kinds of evidence in words, strongest first."""
    phrases = []
    for kind in _ORDER:
        matching = [event for event in events if event.kind == kind]
        if not matching:
            continue
        if kind == "reset":
            functions = ", ".join(dict.fromkeys(f"{event.function}()" for event in matching))
            phrases.append(f"it is reset by {functions}")
        elif kind == "per-step":
            logging = all(event.for_logging for event in matching)
            phrases.append("that reset runs every logging step" if logging else "that reset runs every iteration")
        elif kind == "accumulate":
            phrases.append("it accumulates values within a step" if scenario == 1
                           else "it accumulates across iterations and is never reset")
        elif kind == "training-read":
            phrases.append("it is read to compute training values")
        else:
            phrases.append({
                "self-update": "it is updated from its own previous value",
                "buffer": "it is a non-persistent buffer" if scenario == 1
                else "it is a persistent buffer updated in place",
                "overwrite": "it is overwritten with fresh values",
                "cache": "it is a cache rebuilt deterministically",
                "queue": "it is a queue consumed within the step",
                "log-read": "it is read for logging",
            }[kind])
    return ", ".join(phrases)


def _per_step(function: str, in_loop: bool) -> bool:
    """Runs every iteration: named like a training or logging step (a helper named for what it resets,
    `reset_loss_log`, is not), or sits in a loop of a train-like function or of the module."""
    tokens = _tokens(function)
    if tokens & _STEP_TOKENS and not tokens & _HELPER_TOKENS:
        return True
    return in_loop and (function == "<module>" or bool(tokens & _TRAIN_LOOP_TOKENS))


def _call_sites(tree: ast.Module, path: Path) -> list[_CallSite]:
    sites: list[_CallSite] = []

    def visit(node: ast.AST, function: str, in_loop: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name, False)
                continue
            looping = in_loop or (isinstance(node, (ast.For, ast.AsyncFor, ast.While)) and child in node.body)
            if isinstance(child, ast.Call):
                callee = _callee(child.func)
                if callee:
                    sites.append(_CallSite(callee, function, path, child.lineno, looping))
            visit(child, function, looping)

    visit(tree, "<module>", False)
    return sites


# --- one file, one function --------------------------------------------------------------------------

Relation = Literal["ref", "copy", "computed"]
_NO_GRAD = frozenset({"no_grad", "inference_mode"})
_TRY = (ast.Try, getattr(ast, "TryStar", ast.Try))  # try/except* from Python 3.11


@dataclass(frozen=True)
class _Context:
    """Where a statement sits: in a loop, with autograd off, in a branch that builds a missing value."""

    in_loop: bool = False
    no_grad: bool = False
    lazy: bool = False


class _FileStudy:
    def __init__(self, study: _Study, source: SourceFile):
        self.study = study
        self.source = source
        self.defining = study.defining is not None and source.path == study.defining.path
        self.lines = source.lines

    def run(self) -> None:
        """Module-level code, then each function whose text names the tensor or an accessor."""
        study = self.study
        names = (study.variable, *study.accessors)
        _FunctionStudy(self, None, None, "<module>", self.source.tree.body).run()
        for function, class_name in _functions(self.source.tree.body, None):
            text = "\n".join(self.lines[function.lineno - 1 : function.end_lineno])
            if any(name in text for name in names):
                _FunctionStudy(self, function, class_name, function.name, function.body).run()

    def code(self, node: ast.stmt) -> str:
        """The statement's lines on one line, shortened for an evidence line."""
        lines = self.lines[node.lineno - 1 : node.end_lineno or node.lineno]
        code = " ".join(line.strip() for line in lines)
        return code if len(code) <= 80 else code[:77] + "..."


class _FunctionStudy:
    """One function's (or the module level's) statements, in order, following the tensor's aliases."""

    def __init__(self, file: _FileStudy, function: Function | None, class_name: str | None, name: str,
                 body: list[ast.stmt]):
        study = file.study
        self.file, self.function, self.class_name, self.name, self.body = file, function, class_name, name, body
        self.nodes = list(walk_scope(function)) if function is not None else []
        self.imports = Imports.of(file.source, function)  # the module's imports, with the function's own
        self.reporting = _is_reporting(name, [node for node in self.nodes if isinstance(node, ast.Call)])
        self.initialising = name == "__init__" or bool(_tokens(name) & _INIT_TOKENS)
        self.x_names: set[str] = set()  # names that are the global itself
        self.accessors: set[str] = set()  # names of functions returning it
        self.aliases: set[str] = set()  # locals holding it or an element of it
        self.derived: dict[str, Relation] = {}  # locals computed from it
        if study.attribute:
            return
        for local, imported in self.imports.names.items():
            head, _, tail = imported.target.rpartition(".")
            if head == study.module and tail == study.variable:
                self.x_names.add(local)
            elif head == study.module and tail in study.accessors:
                self.accessors.add(local)
        if file.defining:
            self.accessors |= study.accessors
            if not self._shadows(study.variable):
                self.x_names.add(study.variable)

    def _shadows(self, name: str) -> bool:
        """The function binds `name` locally (a parameter, or assigned without `global`)."""
        if self.function is None:
            return False
        if name in parameter_names(self.function):
            return True
        nodes = self.nodes
        if any(isinstance(node, ast.Global) and name in node.names for node in nodes):
            return False
        return any(isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store) for node in nodes)

    # what an expression is

    def _receiver_ok(self, receiver: ast.expr) -> bool:
        """For an attribute: `self.x` in the owner's class (or a class of its module); any other object."""
        if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
            study = self.file.study
            return (
                study.owner is None
                or self.class_name == study.owner
                or (self.file.defining and self.class_name in study.classes_here)
            )
        return True

    def is_global(self, node: ast.expr) -> bool:
        """The tensor itself: its name, `module.X`, `obj.x`, `get_x()`, `X.data`."""
        study = self.file.study
        variable = study.variable
        if isinstance(node, ast.Name):
            return node.id in self.x_names
        if isinstance(node, ast.Attribute):
            if node.attr == "data":
                return self.is_global(node.value)
            if node.attr != variable:
                return False
            if study.attribute:
                return self._receiver_ok(node.value)
            return self.imports.dotted(node.value) == study.module
        if isinstance(node, ast.Call):
            func = node.func
            if study.attribute:
                return (
                    _callee(func) == "getattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value == variable
                )
            if isinstance(func, ast.Name):
                return func.id in self.accessors
            return (
                isinstance(func, ast.Attribute) and func.attr in study.accessors
                and self.imports.dotted(func.value) == study.module
            )
        return False

    def is_ref(self, node: ast.expr) -> bool:
        """The tensor, an element or view of it, or a local alias of either."""
        while True:
            if self.is_global(node):
                return True
            if isinstance(node, ast.Name):
                return node.id in self.aliases
            if isinstance(node, ast.Subscript):
                node = node.value
            elif (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and (node.func.attr in _ELEMENT_METHODS or node.func.attr.endswith("_"))
            ):
                node = node.func.value  # X.values(), X.mul_(d) (still X)
            else:
                return False

    def relation(self, node: ast.AST | None) -> Relation | None:
        """How a value relates to the tensor: the tensor itself, a plain copy, computed from it, or not."""
        if node is None or isinstance(node, ast.Lambda):
            return None
        if isinstance(node, ast.expr) and self.is_ref(node):
            return "ref"
        if isinstance(node, ast.Name):
            return self.derived.get(node.id)
        if isinstance(node, ast.Attribute):
            return None if node.attr in _METADATA_ATTRS else self.relation(node.value)
        if isinstance(node, ast.Subscript):
            return self.relation(node.value) or ("computed" if self.relation(node.slice) else None)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _METADATA_METHODS:
                return None
            parts = [self.relation(argument) for argument in node.args]
            parts += [
                self.relation(keyword.value) for keyword in node.keywords
                if not (keyword.arg and _tokens(keyword.arg) & _HANDLE_TOKENS)
            ]
            if isinstance(func, ast.Attribute):
                parts.append(self.relation(func.value))
            parts = [part for part in parts if part]
            if not parts:
                return None
            return "copy" if _callee(func) in _COPY_CALLS and "computed" not in parts else "computed"
        if isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Starred)):
            parts = [self.relation(child) for child in ast.iter_child_nodes(node)]
            parts = [part for part in parts if part]
            return None if not parts else ("computed" if "computed" in parts else "copy")
        if isinstance(node, ast.comprehension):
            return self.relation(node.iter)
        parts = [self.relation(child) for child in ast.iter_child_nodes(node)]
        return "computed" if any(parts) else None

    # events

    def add(self, kind: Kind, node: ast.stmt, what: str, **flags) -> _Event:
        code = self.file.code(node)
        where = "at module level" if self.function is None else f"in {self.name}()"
        return self.file.study.add(kind, self.file.source.path, node.lineno, f"{what} {where}: `{code}`",
                                   function=self.name, **flags)

    def reset(self, node: ast.stmt, context: _Context) -> None:
        study = self.file.study
        if self.initialising:
            return  # setting up, not resetting
        if _per_step(self.name, context.in_loop):
            when = "every logging step" if self.reporting else "every iteration"
            self.add("reset", node, f"reset {when}", for_logging=self.reporting)
            return
        chain = study.every_iteration(self.name) if self.function is not None else None
        if not chain:
            self.add("reset", node, "reset", for_logging=self.reporting)
            return
        last = chain[-1]
        logging_step = _is_reporting(last.caller)
        self.add("reset", node, "reset", for_logging=self.reporting or logging_step)
        when = "every logging step" if logging_step else "every iteration"
        via = f", reached from {last.caller}()" if len(chain) > 1 else ""
        what = f"{chain[0].caller}() calls {self.name}() {when}{via}"
        study.add("per-step", chain[0].path, chain[0].line, what, for_logging=logging_step)

    # walking the statements

    def run(self) -> None:
        self.walk(self.body, _Context())

    def walk(self, body: Sequence[ast.stmt], context: _Context) -> None:
        for statement in body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if self.function is None and not context.in_loop and isinstance(statement, (ast.Assign, ast.AnnAssign)):
                continue  # the global's own definition and module constants
            self.calls(statement, context)
            if child_statements(statement):
                self.compound(statement, context)
            else:
                self.simple(statement, context)

    def simple(self, statement: ast.stmt, context: _Context) -> None:
        if isinstance(statement, ast.Assign):
            self.assign(statement.targets, statement.value, statement, context)
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            self.assign([statement.target], statement.value, statement, context)
        elif isinstance(statement, ast.AugAssign):
            self.augmented(statement, context)
        elif isinstance(statement, ast.Delete):
            if any(self.is_ref(target) for target in statement.targets):
                self.reset(statement, context)
        elif isinstance(statement, ast.Return):
            self.returned(statement)

    def compound(self, statement: ast.stmt, context: _Context) -> None:
        """A statement's blocks, each with what its header says about them."""
        if isinstance(statement, (ast.For, ast.AsyncFor, ast.While)):
            if not isinstance(statement, ast.While):
                self.bind_loop(statement.target, statement.iter)
            self.walk(statement.body, replace(context, in_loop=True))
            self.walk(statement.orelse, context)
        elif isinstance(statement, (ast.With, ast.AsyncWith)):
            quiet = any(isinstance(item.context_expr, ast.Call) and _callee(item.context_expr.func) in _NO_GRAD
                        for item in statement.items)
            self.walk(statement.body, replace(context, no_grad=True) if quiet else context)
        elif isinstance(statement, ast.If):
            lazy = self.is_missing_test(statement.test)
            self.walk(statement.body, replace(context, lazy=True) if lazy else context)
            self.walk(statement.orelse, context)
        elif isinstance(statement, _TRY):
            for block in (statement.body, *(handler.body for handler in statement.handlers),
                          statement.orelse, statement.finalbody):
                self.walk(block, context)
        elif isinstance(statement, ast.Match):
            for case in statement.cases:
                self.walk(case.body, context)

    def is_missing_test(self, test: ast.expr) -> bool:
        """`X is None`, `not X`, `k not in X`: the branch builds what is missing (lazy initialisation)."""
        if isinstance(test, ast.BoolOp):
            return any(self.is_missing_test(value) for value in test.values)
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return self.is_ref(test.operand)
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            operator, right = test.ops[0], test.comparators[0]
            if isinstance(operator, ast.Is) and isinstance(right, ast.Constant) and right.value is None:
                return self.is_ref(test.left)
            return isinstance(operator, ast.NotIn) and self.is_ref(right)
        return False

    def calls(self, statement: ast.stmt, context: _Context) -> None:
        study = self.file.study
        for call in _calls_in(_header(statement)):
            receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
            method = call.func.attr if isinstance(call.func, ast.Attribute) else None
            if method is not None and receiver is not None and self.is_ref(receiver):
                self.method_on_tensor(call, method, receiver, statement, context)
            elif method in _QUEUE_ADD and isinstance(receiver, ast.Name) and call.args:
                self.bind(receiver, self.relation(call.args[0]), merge=True)  # lst.append(X)
            if method == "register_buffer" and study.attribute and call.args:
                self.buffer(call, statement)
            values = [*call.args, *(keyword.value for keyword in call.keywords)]
            if _is_logging_call(call) and any(self.relation(value) for value in values):
                self.add("log-read", statement, "read for logging")
            if not self.reporting:
                self.training_call(call, method, receiver, statement)

    def training_call(self, call: ast.Call, method: str | None, receiver: ast.expr | None, statement: ast.stmt) -> None:
        """A call that back-propagates, updates a training value or computes one from the tensor."""
        if method == "backward" and receiver is not None and self.relation(receiver):
            self.add("training-read", statement, "read to compute a value that is back-propagated")
        elif method and receiver is not None and method.endswith("_") and _tokens(_target_name(receiver) or "") & _TRAIN_TOKENS:
            if any(self.relation(argument) for argument in call.args) and not self.is_ref(receiver):
                self.add("training-read", statement, f"read to update {_target_name(receiver)}")
        for keyword in call.keywords:
            if keyword.arg and _tokens(keyword.arg) & _TRAIN_TOKENS and self.relation(keyword.value):
                self.add("training-read", statement, f"read to compute {keyword.arg}=")

    def method_on_tensor(
        self, call: ast.Call, method: str, receiver: ast.expr, statement: ast.stmt, context: _Context
    ) -> None:
        argument = call.args[0] if call.args else None
        if method in _RESET_METHODS or (method == "fill_" and isinstance(argument, ast.Constant)):
            self.reset(statement, context)
        elif method == "copy_" and argument is not None and _is_fresh(argument):
            self.reset(statement, context)
        elif method in ("copy_", "fill_"):
            relation = self.relation(argument)
            if relation == "computed":
                self.add("self-update", statement, "updated from its own previous value")
            elif relation is None and not context.lazy:
                self.add("overwrite", statement, "overwritten from other values")
            # a plain copy of itself (restoring a saved clone) says nothing
        elif method in _ACCUMULATE_METHODS:
            chained = isinstance(receiver, ast.Call) and _callee(receiver.func) in _DECAY_METHODS
            if not chained:  # `X.mul_(d).add_(v)` is one moving-average update, seen at `mul_`
                self.accumulate(statement, argument, context)
        elif method in _DECAY_METHODS:
            self.add("self-update", statement, "updated from its own previous value")
        elif method in _QUEUE_TAKE:
            self.file.study.queue_takes.append((self, statement))
        elif method in _QUEUE_ADD:
            self.file.study.queue_filled = True

    def accumulate(self, statement: ast.stmt, value: ast.expr | None, context: _Context) -> None:
        calls = _calls_in([value] if value is not None else [])
        detached = context.no_grad or any(_callee(call.func) in ("detach", "item") for call in calls)
        what = "accumulated from detached values" if detached else "accumulated"
        self.add("accumulate", statement, what, detached=detached)

    def buffer(self, call: ast.Call, statement: ast.stmt) -> None:
        name = call.args[0]
        if not (isinstance(name, ast.Constant) and name.value == self.file.study.variable):
            return
        persistent = next((keyword.value for keyword in call.keywords if keyword.arg == "persistent"), None)
        if len(call.args) >= 3:
            persistent = call.args[2]
        kept = not (isinstance(persistent, ast.Constant) and persistent.value is False)
        what = "registered as a persistent buffer" if kept else "registered as a non-persistent buffer"
        self.add("buffer", statement, what, persistent=kept)

    def assign(self, targets: Sequence[ast.expr], value: ast.expr, statement: ast.stmt, context: _Context) -> None:
        relation = self.relation(value)
        for target in targets:
            if self.is_global(target) or (isinstance(target, ast.Subscript) and self.is_ref(target.value)):
                self.store(target, value, relation, statement, context)
                continue
            if isinstance(target, (ast.Name, ast.Tuple, ast.List)):
                self.bind(target, relation, merge=False)
            elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and relation:
                self.bind(target.value, "copy" if relation == "ref" else relation, merge=True)
            self.training_target(target, relation, statement)

    def store(self, target: ast.expr, value: ast.expr, relation: Relation | None, statement: ast.stmt,
              context: _Context) -> None:
        """An assignment to the tensor (`X = v`) or into it (`X[k] = v`)."""
        if self.initialising:
            return
        whole = not isinstance(target, ast.Subscript)
        added = isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Add, ast.Sub))
        if added and isinstance(value, ast.BinOp) and (self.is_ref(value.left) or self.is_ref(value.right)):
            self.accumulate(statement, value, context)  # X = X + v, X[k] = X.get(k, 0) + v
        elif relation == "computed":
            self.add("self-update", statement, "updated from its own previous value")
        elif context.lazy or relation is not None:
            return  # built when missing, or a plain copy of itself (a dtype cast)
        elif whole and _is_fresh(value):
            self.reset(statement, context)
        elif whole:
            self.add("overwrite", statement, "rebound to a new value")
        elif isinstance(target, ast.Subscript) and not isinstance(target.slice, ast.Slice) and (
            _tokens(_dotless(target.slice)) & _SHAPE_TOKENS
        ):
            self.add("cache", statement, "cache keyed by shape")

    def augmented(self, statement: ast.AugAssign, context: _Context) -> None:
        if self.is_ref(statement.target):
            if isinstance(statement.op, (ast.Add, ast.Sub)):
                self.accumulate(statement, statement.value, context)
            else:
                self.add("self-update", statement, "updated from its own previous value")
            return
        relation = self.relation(statement.value)
        if isinstance(statement.target, ast.Name) and relation:
            self.bind(statement.target, "computed", merge=True)
        self.training_target(statement.target, "computed" if relation else None, statement)

    def training_target(self, target: ast.expr, relation: Relation | None, statement: ast.stmt) -> None:
        """A value computed from the tensor assigned to a training name (`loss`, `grad_scale`); a plain
        copy only when the name is nothing else (`lr = X.item()`, not `cached_aux_losses = X.clone()`)."""
        name = _target_name(target)
        if not relation or not name or self.reporting:
            return
        tokens = _tokens(name)
        if tokens & _TRAIN_TOKENS and (relation == "computed" or tokens <= _TRAIN_TOKENS):
            self.add("training-read", statement, f"read to compute {name}")

    def returned(self, statement: ast.Return) -> None:
        if self.reporting or self.function is None or not _tokens(self.name) & _TRAIN_TOKENS:
            return
        if self.relation(statement.value):
            self.add("training-read", statement, "read to compute the return value")

    def bind_loop(self, target: ast.expr, iterable: ast.expr) -> None:
        pairing = _callee(iterable.func) if isinstance(iterable, ast.Call) else None
        if isinstance(iterable, ast.Call) and pairing in ("zip", "enumerate") and isinstance(target, ast.Tuple):
            arguments: list[ast.expr | None] = [*iterable.args] if pairing == "zip" else [None, *iterable.args[:1]]
            for element, argument in zip(target.elts, arguments, strict=False):
                self.bind(element, self.relation(argument) if argument is not None else None, merge=False)
            return
        self.bind(target, self.relation(iterable), merge=False)

    def bind(self, target: ast.expr, relation: Relation | None, *, merge: bool) -> None:
        """Record what a local now holds: the tensor (alias), something computed from it, or neither."""
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.bind(element, relation, merge=merge)
            return
        if isinstance(target, ast.Starred):
            self.bind(target.value, relation, merge=merge)
            return
        if not isinstance(target, ast.Name):
            return
        name = target.id
        if merge:
            if relation == "ref":
                self.aliases.add(name)
            elif relation:
                old = self.derived.get(name)
                self.derived[name] = "computed" if "computed" in (old, relation) else "copy"
            return
        self.aliases.discard(name)
        self.derived.pop(name, None)
        if relation == "ref":
            self.aliases.add(name)
        elif relation:
            self.derived[name] = relation
