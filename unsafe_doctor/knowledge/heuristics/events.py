"""The study of one file and of one function: the statements that touch the tensor, in order, each
read as an event (reset, accumulate, self-update, training-read, ...; the rules of evidence are in
the package's docstring). A reset looks up who calls its function, through the study, to know
whether it runs every iteration."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property, partial
from pathlib import Path
from typing import Literal, Protocol

from unsafe_doctor.knowledge.heuristics.aliases import Aliases, Followed, Relation
from unsafe_doctor.knowledge.heuristics.vocabulary import (
    ACCUMULATE_METHODS,
    DECAY_METHODS,
    INIT_TOKENS,
    NO_GRAD,
    QUEUE_ADD,
    QUEUE_TAKE,
    RESET_METHODS,
    SHAPE_TOKENS,
    TRAIN_TOKENS,
    dotless,
    is_fresh,
    is_logging_call,
    is_reporting,
    runs_per_step,
    target_name,
    tokens,
)
from unsafe_doctor.source.syntax import (
    Function,
    callee_name,
    child_nodes,
    child_statements,
    compound_header,
    functions_in,
    walk_scope,
)
from unsafe_doctor.source.workspace import SourceFile

EvidenceKind = Literal[  # the kinds of evidence, as the rules of evidence name them
    "reset",
    "per-step",
    "accumulate",
    "log-read",
    "overwrite",
    "cache",
    "queue",
    "buffer",
    "self-update",
    "training-read",
]


@dataclass(frozen=True)
class Event:
    """One piece of evidence: what was seen, where; the flags the weighing reads for some kinds."""

    kind: EvidenceKind
    path: Path
    line: int
    what: str
    detached: bool = False  # accumulate: of detached values
    persistent: bool = False  # buffer: saved with the model
    for_logging: bool = False  # reset: done only by or for logging functions
    function: str = ""  # the function (or '<module>') whose statement it is


@dataclass(frozen=True)
class CallSite:
    """A call by name (`train_step()`, `obj.reset()`): where it is and the function it runs in."""

    callee: str
    caller: str  # enclosing function, '<module>' at module level
    path: Path
    line: int
    in_loop: bool


class Study(Followed, Protocol):
    """What a file's study reads of the tensor's study and records into it (`gather.TensorStudy` is the one)."""

    queue_filled: bool  # entries are appended to the tensor (a queue) somewhere
    queue_takes: list[tuple[FunctionStudy, ast.stmt]]  # where entries are taken, judged once all files are read

    @property
    def defining(self) -> SourceFile | None: ...
    def add(
        self,
        kind: EvidenceKind,
        path: Path,
        line: int,
        what: str,
        *,
        function: str = "",
        detached: bool = False,
        persistent: bool = False,
        for_logging: bool = False,
    ) -> Event: ...
    def every_iteration(self, function: str) -> list[CallSite] | None: ...


_TRY = (ast.Try, getattr(ast, "TryStar", ast.Try))  # try/except* from Python 3.11


@dataclass(frozen=True)
class _Context:
    """Where a statement sits: in a loop, with autograd off, in a branch that builds a missing value."""

    in_loop: bool = False
    no_grad: bool = False
    lazy: bool = False


def _calls_in(nodes: Sequence[ast.AST]) -> Iterator[ast.Call]:
    """Calls in expressions, not inside lambdas."""
    pending = list(nodes)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Call):
            yield node
        pending.extend(child_nodes(node))


def _header(statement: ast.stmt) -> Sequence[ast.AST]:
    """The expressions a statement evaluates itself (a compound statement's header only)."""
    header = compound_header(statement)
    if header is not None:
        return header
    if isinstance(statement, (ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return []
    return [child for child in child_nodes(statement) if isinstance(child, ast.expr)]


class FileStudy:
    """One file in scope: its module level, then each function that names the tensor or an accessor."""

    def __init__(self, study: Study, source: SourceFile):
        self.study = study
        self.source = source
        self.defining = study.defining is not None and source.path == study.defining.path
        self.lines = source.lines

    def run(self) -> None:
        study = self.study
        names = (study.variable, *study.accessors)
        FunctionStudy(self, None, None, "<module>", self.source.tree.body).run()
        for function, enclosing in functions_in(self.source.tree.body):
            class_name = next((scope.name for scope in reversed(enclosing) if isinstance(scope, ast.ClassDef)), None)
            text = "\n".join(self.lines[function.lineno - 1 : function.end_lineno])
            if any(name in text for name in names):
                FunctionStudy(self, function, class_name, function.name, function.body).run()

    def code(self, node: ast.stmt) -> str:
        """The statement's lines on one line, shortened for an evidence line."""
        lines = self.lines[node.lineno - 1 : node.end_lineno or node.lineno]
        code = " ".join(line.strip() for line in lines)
        return code if len(code) <= 80 else code[:77] + "..."


def _scope_nodes(file: FileStudy, function: Function) -> tuple[ast.AST, ...]:
    """The nodes of a function's own scope, listed once per parsed tree: every global a function
    names studies it again."""
    what = f"scope nodes of the function at {function.lineno}:{function.col_offset}"
    nodes = file.source.of_nodes.get(what)
    if not isinstance(nodes, tuple):
        nodes = file.source.of_nodes[what] = tuple(walk_scope(function))
    return nodes


class FunctionStudy:
    """One function's (or the module level's) statements, in order, following the tensor's aliases."""

    def __init__(self, file: FileStudy, function: Function | None, class_name: str | None, name: str, body: list[ast.stmt]):
        self.file, self.function, self.name, self.body = file, function, name, body
        # the nodes of the function's own scope, listed only when asked (no reference back here: no cycle)
        self.nodes = partial(_scope_nodes, file, function) if function is not None else tuple
        self.tensor = Aliases(
            file.study, file.source, defining=file.defining, function=function, class_name=class_name, nodes=self.nodes
        )
        self.initialising = name == "__init__" or bool(tokens(name) & INIT_TOKENS)

    @cached_property
    def reporting(self) -> bool:
        return is_reporting(self.name, [node for node in self.nodes() if isinstance(node, ast.Call)])

    # events

    def add(self, kind: EvidenceKind, node: ast.stmt, what: str, **flags: bool) -> Event:
        code = self.file.code(node)
        where = "at module level" if self.function is None else f"in {self.name}()"
        return self.file.study.add(
            kind, self.file.source.path, node.lineno, f"{what} {where}: `{code}`", function=self.name, **flags
        )

    def reset(self, node: ast.stmt, context: _Context) -> None:
        study = self.file.study
        if self.initialising:
            return  # setting up, not resetting
        if runs_per_step(self.name, in_loop=context.in_loop):
            when = "every logging step" if self.reporting else "every iteration"
            self.add("reset", node, f"reset {when}", for_logging=self.reporting)
            return
        chain = study.every_iteration(self.name) if self.function is not None else None
        if not chain:
            self.add("reset", node, "reset", for_logging=self.reporting)
            return
        last = chain[-1]
        logging_step = is_reporting(last.caller)
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
            if not self.mentions_tensor(statement):
                continue  # no event without a name of the tensor, and no name of it bound or unbound
            self.calls(statement, context)
            if child_statements(statement):
                self.compound(statement, context)
            else:
                self.simple(statement, context)

    def mentions_tensor(self, statement: ast.stmt) -> bool:
        """Whether the statement's text spells a name that stands for the tensor here (the global,
        its accessors, the locals holding it or computed from it)."""
        text = "\n".join(self.file.lines[statement.lineno - 1 : statement.end_lineno or statement.lineno])
        return any(name in text for name in self.tensor.names())

    def simple(self, statement: ast.stmt, context: _Context) -> None:
        if isinstance(statement, ast.Assign):
            self.assign(statement.targets, statement.value, statement, context)
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            self.assign([statement.target], statement.value, statement, context)
        elif isinstance(statement, ast.AugAssign):
            self.augmented(statement, context)
        elif isinstance(statement, ast.Delete):
            if any(self.tensor.is_ref(target) for target in statement.targets):
                self.reset(statement, context)
        elif isinstance(statement, ast.Return):
            self.returned(statement)

    def compound(self, statement: ast.stmt, context: _Context) -> None:
        """A statement's blocks, each with what its header says about them."""
        if isinstance(statement, (ast.For, ast.AsyncFor, ast.While)):
            if not isinstance(statement, ast.While):
                self.tensor.bind_loop(statement.target, statement.iter)
            self.walk(statement.body, replace(context, in_loop=True))
            self.walk(statement.orelse, context)
        elif isinstance(statement, (ast.With, ast.AsyncWith)):
            quiet = any(
                isinstance(item.context_expr, ast.Call) and callee_name(item.context_expr.func) in NO_GRAD
                for item in statement.items
            )
            self.walk(statement.body, replace(context, no_grad=True) if quiet else context)
        elif isinstance(statement, ast.If):
            lazy = self.is_missing_test(statement.test)
            self.walk(statement.body, replace(context, lazy=True) if lazy else context)
            self.walk(statement.orelse, context)
        elif isinstance(statement, _TRY):
            for block in (
                statement.body,
                *(handler.body for handler in statement.handlers),
                statement.orelse,
                statement.finalbody,
            ):
                self.walk(block, context)
        elif isinstance(statement, ast.Match):
            for case in statement.cases:
                self.walk(case.body, context)

    def is_missing_test(self, test: ast.expr) -> bool:
        """`X is None`, `not X`, `k not in X`: the branch builds what is missing (lazy initialisation)."""
        if isinstance(test, ast.BoolOp):
            return any(self.is_missing_test(value) for value in test.values)
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return self.tensor.is_ref(test.operand)
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            operator, right = test.ops[0], test.comparators[0]
            if isinstance(operator, ast.Is) and isinstance(right, ast.Constant) and right.value is None:
                return self.tensor.is_ref(test.left)
            return isinstance(operator, ast.NotIn) and self.tensor.is_ref(right)
        return False

    def calls(self, statement: ast.stmt, context: _Context) -> None:
        study = self.file.study
        for call in _calls_in(_header(statement)):
            receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
            method = call.func.attr if isinstance(call.func, ast.Attribute) else None
            if method is not None and receiver is not None and self.tensor.is_ref(receiver):
                self.method_on_tensor(call, method, receiver, statement, context)
            elif method in QUEUE_ADD and isinstance(receiver, ast.Name) and call.args:
                self.tensor.bind(receiver, self.tensor.relation(call.args[0]), merge=True)  # lst.append(X)
            if method == "register_buffer" and study.attribute and call.args:
                self.buffer(call, statement)
            values = [*call.args, *(keyword.value for keyword in call.keywords)]
            if is_logging_call(call) and any(self.tensor.relation(value) for value in values):
                self.add("log-read", statement, "read for logging")
            self.training_call(call, method, receiver, statement)

    def training_call(self, call: ast.Call, method: str | None, receiver: ast.expr | None, statement: ast.stmt) -> None:
        """A call that back-propagates, updates a training value or computes one from the tensor (not
        in a logging function, asked last: it lists the function's calls)."""
        if method == "backward" and receiver is not None and self.tensor.relation(receiver):
            if not self.reporting:
                self.add("training-read", statement, "read to compute a value that is back-propagated")
        elif method and receiver is not None and method.endswith("_") and tokens(target_name(receiver) or "") & TRAIN_TOKENS:
            if any(self.tensor.relation(argument) for argument in call.args) and not self.tensor.is_ref(receiver):
                if not self.reporting:
                    self.add("training-read", statement, f"read to update {target_name(receiver)}")
        for keyword in call.keywords:
            if keyword.arg and tokens(keyword.arg) & TRAIN_TOKENS and self.tensor.relation(keyword.value):
                if not self.reporting:
                    self.add("training-read", statement, f"read to compute {keyword.arg}=")

    def method_on_tensor(self, call: ast.Call, method: str, receiver: ast.expr, statement: ast.stmt, context: _Context) -> None:
        argument = call.args[0] if call.args else None
        if method in RESET_METHODS or (method == "fill_" and isinstance(argument, ast.Constant)):
            self.reset(statement, context)
        elif method == "copy_" and argument is not None and is_fresh(argument):
            self.reset(statement, context)
        elif method in ("copy_", "fill_"):
            relation = self.tensor.relation(argument)
            if relation == "computed":
                self.add("self-update", statement, "updated from its own previous value")
            elif relation is None and not context.lazy:
                self.add("overwrite", statement, "overwritten from other values")
            # a plain copy of itself (restoring a saved clone) says nothing
        elif method in ACCUMULATE_METHODS:
            chained = isinstance(receiver, ast.Call) and callee_name(receiver.func) in DECAY_METHODS
            if not chained:  # `X.mul_(d).add_(v)` is one moving-average update, seen at `mul_`
                self.accumulate(statement, argument, context)
        elif method in DECAY_METHODS:
            self.add("self-update", statement, "updated from its own previous value")
        elif method in QUEUE_TAKE:
            self.file.study.queue_takes.append((self, statement))
        elif method in QUEUE_ADD:
            self.file.study.queue_filled = True

    def accumulate(self, statement: ast.stmt, value: ast.expr | None, context: _Context) -> None:
        calls = _calls_in([value] if value is not None else [])
        detached = context.no_grad or any(callee_name(call.func) in ("detach", "item") for call in calls)
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
        relation = self.tensor.relation(value)
        for target in targets:
            if self.tensor.is_global(target) or (isinstance(target, ast.Subscript) and self.tensor.is_ref(target.value)):
                self.store(target, value, relation, statement, context)
                continue
            if isinstance(target, (ast.Name, ast.Tuple, ast.List)):
                self.tensor.bind(target, relation, merge=False)
            elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and relation:
                self.tensor.bind(target.value, "copy" if relation == "ref" else relation, merge=True)
            self.training_target(target, relation, statement)

    def store(self, target: ast.expr, value: ast.expr, relation: Relation | None, statement: ast.stmt, context: _Context) -> None:
        """An assignment to the tensor (`X = v`) or into it (`X[k] = v`)."""
        if self.initialising:
            return
        whole = not isinstance(target, ast.Subscript)
        added = isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Add, ast.Sub))
        if added and isinstance(value, ast.BinOp) and (self.tensor.is_ref(value.left) or self.tensor.is_ref(value.right)):
            self.accumulate(statement, value, context)  # X = X + v, X[k] = X.get(k, 0) + v
        elif relation == "computed":
            self.add("self-update", statement, "updated from its own previous value")
        elif context.lazy or relation is not None:
            return  # built when missing, or a plain copy of itself (a dtype cast)
        elif whole and is_fresh(value):
            self.reset(statement, context)
        elif whole:
            self.add("overwrite", statement, "rebound to a new value")
        elif (
            isinstance(target, ast.Subscript)
            and not isinstance(target.slice, ast.Slice)
            and (tokens(dotless(target.slice)) & SHAPE_TOKENS)
        ):
            self.add("cache", statement, "cache keyed by shape")

    def augmented(self, statement: ast.AugAssign, context: _Context) -> None:
        if self.tensor.is_ref(statement.target):
            if isinstance(statement.op, (ast.Add, ast.Sub)):
                self.accumulate(statement, statement.value, context)
            else:
                self.add("self-update", statement, "updated from its own previous value")
            return
        relation = self.tensor.relation(statement.value)
        if isinstance(statement.target, ast.Name) and relation:
            self.tensor.bind(statement.target, "computed", merge=True)
        self.training_target(statement.target, "computed" if relation else None, statement)

    def training_target(self, target: ast.expr, relation: Relation | None, statement: ast.stmt) -> None:
        """A value computed from the tensor assigned to a training name (`loss`, `grad_scale`); a plain
        copy only when the name is nothing else (`lr = X.item()`, not `cached_aux_losses = X.clone()`)."""
        name = target_name(target)
        if not relation or not name or self.reporting:
            return
        words = tokens(name)
        if words & TRAIN_TOKENS and (relation == "computed" or words <= TRAIN_TOKENS):
            self.add("training-read", statement, f"read to compute {name}")

    def returned(self, statement: ast.Return) -> None:
        if self.reporting or self.function is None or not tokens(self.name) & TRAIN_TOKENS:
            return
        if self.tensor.relation(statement.value):
            self.add("training-read", statement, "read to compute the return value")
