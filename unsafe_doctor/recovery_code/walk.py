"""Walking one scope's statements in order, for the uses they make of holders.

A `Walker` follows local aliases of holders (`tracker = get_x()`, `for v in X.values()`) and the
placements of local tensors, and hands every use it finds to `record`. It is the common part of two
readings: `audit.holders.FrameworkScanner` (what framework code stores where) and
`coverage.RecoveryReader` (what recovery code does to each holder, following the helpers it calls)."""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from typing import Any

from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.recovery_code.flow_scope import FlowScope
from unsafe_doctor.recovery_code.index import Index, Span
from unsafe_doctor.recovery_code.names import Accessors, Names
from unsafe_doctor.recovery_code.places import Places
from unsafe_doctor.recovery_code.refs import ClassKey, ClassRef, FunctionRef, HolderRef, SelfRef
from unsafe_doctor.recovery_code.uses import Use, UseKind
from unsafe_doctor.recovery_code.vocabulary import CONTAINER_ADD, DATA_METHODS, NOT_DATA_CALLS, updates_data_in_place
from unsafe_doctor.source.syntax import (
    child_nodes,
    child_statements,
    compound_header,
    import_bindings,
    is_empty_value,
    names_bound,
)

_BEFORE_ANY = ast.Pass(lineno=0, col_offset=0)  # the current statement before the walk starts: no use comes from it


class Walker:
    """One scope's statements, in order; every use of a holder goes to `record`. The hooks below
    do nothing here: each reading overrides the ones it needs."""

    def __init__(self, index: Index, accessors: Accessors, scope: FlowScope, via: tuple[str, ...] = ()):
        self.index = index
        self.accessors = accessors
        self.scope = scope
        self.names = Names(index, accessors, scope)
        self.places = Places(self.names)
        self.resolve = self.names.resolve
        self.via = via
        self.statement: ast.stmt = _BEFORE_ANY
        self.in_init = scope.function is not None and scope.function.name == "__init__"

    # --- hooks

    def record(self, key: GlobalName[str, str], use: Use) -> None:
        """A use of the holder `key`."""
        raise NotImplementedError

    def stored_in_self(self, value: ast.expr | None) -> None:
        """A method stores `value` into its instance (`self.x = v`, `self.xs.append(v)`)."""

    def returning(self, value: ast.expr) -> None:
        """The function returns `value`."""

    def registering_buffer(self, call: ast.Call) -> None:
        """A method calls `self.register_buffer(...)`."""

    def calling(self, callee: FunctionRef) -> None:
        """A call of a function that is no accessor."""

    def assigned_local(self, name: str, value: ast.expr) -> None:
        """A local is bound to `value` (which refers to no holder)."""

    def stored_from_holder(self, value: ast.expr) -> bool:
        """Whether a value stored into a holder counts as computed from a holder's data."""
        return False

    # --- statements

    def run(self, body: Sequence[ast.stmt]) -> None:
        for statement in body:
            self.visit_statement(statement)

    def visit_statement(self, statement: ast.stmt) -> None:
        self.statement = statement
        _STATEMENTS.get(type(statement), Walker._other_statement)(self, statement)

    def _function_def(self, statement: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for decorator in statement.decorator_list:
            self.visit(decorator)
        if self.scope.function is not None:
            self.scope.nested[statement.name] = statement  # calls from here on mean this one
        # its body is walked as a scope of its own

    def _class_def(self, node: ast.ClassDef) -> None:
        """At module level, class attributes bound in the body: their definitions and the tensors
        they start with. (Methods are scopes of their own.)"""
        if self.scope.function is not None:
            return
        for decorator in node.decorator_list:
            self.visit(decorator)
        module = self.scope.module
        attributes = module.classes[node.name].attributes if node.name in module.classes else {}
        for statement in node.body:
            self.statement = statement
            if isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None:
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                self.visit(statement.value)
                for name in names_bound(targets):
                    if attributes.get(name) is statement:
                        ref = HolderRef(GlobalName(module.name, node.name, name), False)
                        self.emit("rebind", ref, place=self.places.of(statement.value), value=statement.value)

    def _assign(self, statement: ast.Assign) -> None:
        self.visit(statement.value)
        for target in statement.targets:
            self.store(target, statement.value)

    def _annotated_assign(self, statement: ast.AnnAssign) -> None:
        if statement.value is not None:
            self.visit(statement.value)
            self.store(statement.target, statement.value)

    def _augmented_assign(self, statement: ast.AugAssign) -> None:
        self.visit(statement.value)
        self.augment(statement.target, statement.value)

    def _delete(self, statement: ast.Delete) -> None:
        for target in statement.targets:
            ref = self.resolve(target)
            if isinstance(ref, HolderRef):
                self.emit("delete", ref)
            self.visit_inside(target)

    def _for(self, statement: ast.For | ast.AsyncFor) -> None:
        self.visit(statement.iter)
        self.bind_loop(statement.target, statement.iter)
        self.run(statement.body)
        self.run(statement.orelse)

    def _with(self, statement: ast.With | ast.AsyncWith) -> None:
        for item in statement.items:
            self.visit(item.context_expr)
            if item.optional_vars is not None:
                self.store(item.optional_vars, item.context_expr)
        self.run(statement.body)

    def _import_from(self, statement: ast.ImportFrom) -> None:
        for binding in import_bindings(statement, self.scope.module.source.package).values():
            ref = self.index.resolve_dotted(binding.target)
            if isinstance(ref, HolderRef) and not ref.element:
                self.emit("import", ref, module_level=self.scope.function is None)

    def _import(self, statement: ast.Import) -> None:
        pass  # `import a.b` binds a module, never a holder

    def _return(self, statement: ast.Return) -> None:
        if statement.value is not None:
            self.visit(statement.value)
            self.returning(statement.value)

    def _block(self, statement: ast.stmt) -> None:
        """`if`, `while`, `try`, `match`: the header, then the blocks in order."""
        for expression in compound_header(statement) or ():
            self.statement = statement
            self.visit(expression)
        for child in child_statements(statement):
            self.visit_statement(child)

    def _other_statement(self, statement: ast.stmt) -> None:
        for child in child_nodes(statement):
            if isinstance(child, ast.expr):
                self.visit(child)

    # --- bindings

    def store(self, target: ast.expr, value: ast.expr | None) -> None:
        if isinstance(target, ast.Name):
            self._store_name(target.id, value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.store(element, None)
        elif isinstance(target, ast.Starred):
            self.store(target.value, None)
        else:
            self._store_into(target, value)

    def _store_name(self, name: str, value: ast.expr | None) -> None:
        scope = self.scope
        if scope.function is None or name in scope.globals:
            global_ = HolderRef(GlobalName(scope.module.name, None, name), False)
            self.emit("rebind", global_, place=self.places.of(value), value=value)
            return
        scope.forget(name)
        if value is None:
            return
        ref = self.resolve(_or_empty(value))
        if isinstance(ref, HolderRef):
            scope.aliases[name] = ref
            return
        if _gathers_items(value) and (found := self.names.holder_in(value)) is not None:
            scope.aliases[name] = HolderRef(found.key, True)  # `[x]`, `list(x.values())`: a holder's items
            return
        place = self.places.of(value)
        if place is not None:
            scope.places[name] = place
        device = self.places.device_value(value)
        if device is not None:
            scope.devices[name] = device
        self.assigned_local(name, value)

    def _store_into(self, target: ast.expr, value: ast.expr | None) -> None:
        """`X.a = v`, `X[k] = v`, `self.x = v`."""
        self.visit_inside(target)
        ref = self.resolve(target)
        if isinstance(ref, HolderRef) and not ref.element and self.names.instance_attribute(target):
            ref = None  # `self.x = v` where the class has an `x`: the instance gets its own
        if isinstance(ref, HolderRef):
            self.emit("store" if ref.element else "rebind", ref, place=self.places.of(value), value=value)
        elif self.names.self_rooted(target):
            self.stored_in_self(value)

    def augment(self, target: ast.expr, value: ast.expr) -> None:
        ref = self.resolve(target)
        if not isinstance(target, ast.Name):
            self.visit_inside(target)
        if not isinstance(ref, HolderRef) and isinstance(target, ast.Name):
            if self.scope.function is None or target.id in self.scope.globals:
                ref = HolderRef(GlobalName(self.scope.module.name, None, target.id), False)
        if isinstance(ref, HolderRef):
            self.emit("augment", ref, place=self.places.of(value), value=value, reads_data=True)
        elif self.names.self_rooted(target):
            self.stored_in_self(value)

    def bind_loop(self, target: ast.expr, iterable: ast.expr) -> None:
        """`for v in X.values()`, `for k, v in X.items()`, `for t in [X]`: the loop variables alias X."""
        found = self.names.holder_in(iterable)
        for name in names_bound([target]):
            self.scope.aliases.pop(name, None)
            self.scope.places.pop(name, None)
            if found is not None:
                self.scope.aliases[name] = HolderRef(found.key, True)

    # --- expressions

    def visit(self, node: ast.AST | None) -> None:
        """Every use an expression makes of a holder."""
        if node is not None:
            _EXPRESSIONS.get(type(node), Walker._children)(self, node)

    def _children(self, node: ast.AST) -> None:
        for child in child_nodes(node):
            self.visit(child)

    def _reference(self, node: ast.Name | ast.Attribute | ast.Subscript) -> None:
        ref = self.resolve(node)
        if isinstance(ref, HolderRef):
            self.emit("read", ref)
            self.visit_inside(node)
        elif not isinstance(ref, FunctionRef) and not isinstance(node, ast.Name):
            self._children(node)

    def _binary(self, node: ast.BinOp) -> None:
        """Arithmetic on a holder reads its data."""
        for side in (node.left, node.right):
            ref = self.resolve(side)
            if isinstance(ref, HolderRef):
                self.emit("read", ref, reads_data=True)
                self.visit_inside(side)
            else:
                self.visit(side)

    def _nothing(self, node: ast.AST) -> None:
        pass  # a lambda's body runs later, if ever

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp) -> None:
        for generator in node.generators:
            self.scope.locals.update(names_bound([generator.target]))
        self._children(node)

    def _named(self, node: ast.NamedExpr) -> None:
        self.scope.locals.update(names_bound([node.target]))
        self._children(node)

    def visit_inside(self, node: ast.expr) -> None:
        """The subscripts and call arguments inside a reference chain, not the chain itself."""
        while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
            if isinstance(node, ast.Subscript):
                self.visit(node.slice)
                node = node.value
            elif isinstance(node, ast.Call):
                for argument in [*node.args, *(keyword.value for keyword in node.keywords)]:
                    self.visit(argument)
                node = node.func
            else:
                node = node.value

    def call(self, node: ast.Call) -> None:
        func = node.func
        arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
        if isinstance(func, ast.Attribute):
            base = self.resolve(func.value)
            if isinstance(base, HolderRef):
                self._method_of_holder(base, func, node, arguments)
                return
            if isinstance(base, SelfRef) and func.attr == "register_buffer":
                self.registering_buffer(node)
            elif func.attr in CONTAINER_ADD and self.names.self_rooted(func.value) and node.args:
                self.stored_in_self(node.args[-1])
        self._callee(func)
        name = self.names.dotted(func) or (func.attr if isinstance(func, ast.Attribute) else None)
        for argument in arguments:
            ref = self.resolve(argument)
            if isinstance(ref, HolderRef) and name is not None and name.split(".")[-1] not in NOT_DATA_CALLS:
                torch_op = name.startswith("torch.") and not name.startswith("torch.distributed.")
                self.emit("argument", ref, callee=name, reads_data=torch_op)
                self.visit_inside(argument)
            else:
                self.visit(argument)

    def _method_of_holder(self, base: HolderRef, func: ast.Attribute, node: ast.Call, arguments: list[ast.expr]) -> None:
        """`X.append(t)`, `X.zero_()`, `X.copy_(y)`."""
        method = func.attr
        copied_from_holder = method == "copy_" and any(self.names.reads_holder(argument) for argument in arguments)
        reads = method in DATA_METHODS or (updates_data_in_place(method) and method != "copy_")
        place = self.places.added(method, node)
        added = node.args[-1] if method in CONTAINER_ADD and node.args else None
        self.emit(
            "method",
            base,
            method=method,
            place=place,
            reads_data=reads,
            value_reads_holder=copied_from_holder,
            instance_of=self.instance_class(added),
        )
        self.visit_inside(func.value)
        for argument in arguments:
            self.visit(argument)

    def instance_class(self, value: ast.expr | None) -> ClassKey | None:
        """The class `value` is an instance of, where the code says: `C(...)`, or `self` in C's methods."""
        if isinstance(value, ast.Call):
            made = self.resolve(value.func)
            return ClassKey(made.module, made.name) if isinstance(made, ClassRef) else None
        ref = self.resolve(value) if value is not None else None
        return ClassKey(ref.module, ref.name) if isinstance(ref, SelfRef) else None

    def _callee(self, func: ast.expr) -> None:
        callee = self.resolve(func)
        if isinstance(callee, HolderRef):
            self.emit("read", callee)  # calling a cached function reads its cache
        elif isinstance(callee, FunctionRef):
            key = self.accessors.returned_by(callee)
            if key is not None:
                self.emit("read", HolderRef(key, False))
            else:
                self.calling(callee)
        else:
            self.visit(func)

    # --- emitting

    def make(self, kind: UseKind, *, element: bool = False, **details: Any) -> Use:
        """A use made by the current statement."""
        statement = self.statement
        return Use(
            kind=kind,
            element=element,
            module=self.scope.module,
            statement=Span.of(statement),
            line=statement.lineno,
            function=self.scope.qualname,
            in_init=self.in_init,
            via=self.via,
            **details,
        )

    def emit(self, kind: UseKind, ref: HolderRef, *, value: ast.expr | None = None, **details: Any) -> None:
        if kind in ("rebind", "store") and value is not None:
            details.setdefault("value_reads_holder", self.stored_from_holder(value))
            details["empty"] = is_empty_value(value)
            details["instance_of"] = self.instance_class(value)
        self.record(ref.key, self.make(kind, element=ref.element, **details))


_Visitor = Callable[[Walker, Any], None]


# Statements whose blocks are walked in order after their header (try/except* is Python 3.11+).
def _or_empty(value: ast.expr) -> ast.expr:
    """`x or []` (or `{}`, `()`, `None`) is `x`, when it holds anything to walk."""
    empty = (ast.List, ast.Tuple, ast.Dict, ast.Constant)
    if (
        isinstance(value, ast.BoolOp)
        and isinstance(value.op, ast.Or)
        and all(isinstance(item, empty) and not getattr(item, "elts", getattr(item, "keys", ())) for item in value.values[1:])
    ):
        return value.values[0]
    return value


def _gathers_items(value: ast.expr) -> bool:
    """A list or tuple of what an expression holds: a display, `list(...)` / `tuple(...)`, or a choice of them."""
    if isinstance(value, ast.IfExp):
        return _gathers_items(value.body) or _gathers_items(value.orelse)
    if isinstance(value, ast.Call):
        return isinstance(value.func, ast.Name) and value.func.id in ("list", "tuple")
    return isinstance(value, (ast.List, ast.Tuple))


_BLOCKS = tuple(getattr(ast, name) for name in ("If", "While", "Try", "TryStar", "Match") if hasattr(ast, name))
_STATEMENTS: dict[type, _Visitor] = {
    ast.FunctionDef: Walker._function_def,
    ast.AsyncFunctionDef: Walker._function_def,
    ast.ClassDef: Walker._class_def,
    ast.Assign: Walker._assign,
    ast.AnnAssign: Walker._annotated_assign,
    ast.AugAssign: Walker._augmented_assign,
    ast.Delete: Walker._delete,
    ast.For: Walker._for,
    ast.AsyncFor: Walker._for,
    ast.With: Walker._with,
    ast.AsyncWith: Walker._with,
    ast.Import: Walker._import,
    ast.ImportFrom: Walker._import_from,
    ast.Return: Walker._return,
    **{block: Walker._block for block in _BLOCKS},
}
_EXPRESSIONS: dict[type, _Visitor] = {
    ast.Name: Walker._reference,
    ast.Attribute: Walker._reference,
    ast.Subscript: Walker._reference,
    ast.Call: Walker.call,
    ast.BinOp: Walker._binary,
    ast.Lambda: Walker._nothing,
    ast.FunctionDef: Walker._nothing,
    ast.AsyncFunctionDef: Walker._nothing,
    ast.ClassDef: Walker._nothing,
    ast.ListComp: Walker._comprehension,
    ast.SetComp: Walker._comprehension,
    ast.DictComp: Walker._comprehension,
    ast.GeneratorExp: Walker._comprehension,
    ast.NamedExpr: Walker._named,
}
