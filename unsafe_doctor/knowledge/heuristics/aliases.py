"""What stands for the tensor in one function (or the module level): the names that are the global,
the accessors that return it, the locals holding it or an element of it, and the locals computed
from it, followed statement by statement as the events walk them.

Not `source.resolve` (which global one expression means, at one line) nor the audit's flow walk
(`recovery_code.walk`: what code does to any holder): this follows one known tensor, and what is
copied or computed from it, which neither of them tracks."""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from unsafe_doctor.knowledge.heuristics.vocabulary import (
    COPY_CALLS,
    ELEMENT_METHODS,
    HANDLE_TOKENS,
    METADATA_ATTRS,
    METADATA_METHODS,
    tokens,
)
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.source.imports import Imports
from unsafe_doctor.source.syntax import Function, callee_name, parameter_names
from unsafe_doctor.source.workspace import SourceFile

Relation = Literal["ref", "copy", "computed"]  # the tensor itself, a plain copy of it, or computed from it


class Followed(Protocol):
    """The tensor whose names are followed, as its study knows it (`gather.TensorStudy` is the one)."""

    @property
    def name(self) -> GlobalName[str | None, str | None]: ...  # the tensor's, as its subject names it
    @property
    def variable(self) -> str: ...  # its variable, "" where the subject names none
    @property
    def attribute(self) -> bool: ...  # reached as an attribute (`self.x`, `Cls.x`), not by a bare name
    @property
    def accessors(self) -> set[str]: ...  # the defining module's functions that return it
    @property
    def classes_here(self) -> frozenset[str]: ...  # the classes the defining module defines


class Aliases:
    """The tensor's names in one scope. `defining`: the scope is in the module that defines the global,
    where its bare name means it unless the function binds that name itself."""

    def __init__(
        self,
        study: Followed,
        source: SourceFile,
        *,
        defining: bool,
        function: Function | None,
        class_name: str | None,
        nodes: Callable[[], Sequence[ast.AST]],
    ):
        """`nodes`: the function's own scope's nodes, listed when asked."""
        self.study, self.defining, self.function, self.class_name, self.nodes = study, defining, function, class_name, nodes
        self.imports = Imports.of(source, function)  # the module's imports, with the function's own
        self.x_names: set[str] = set()  # names that are the global itself
        self.accessors: set[str] = set()  # names of functions returning it
        self.holding: set[str] = set()  # locals holding it or an element of it
        self.derived: dict[str, Relation] = {}  # locals computed from it
        if study.attribute:
            return
        for local, imported in self.imports.names.items():
            head, _, tail = imported.target.rpartition(".")
            if head == study.name.module and tail == study.variable:
                self.x_names.add(local)
            elif head == study.name.module and tail in study.accessors:
                self.accessors.add(local)
        if defining:
            self.accessors |= study.accessors
            if not self._shadows(study.variable):
                self.x_names.add(study.variable)

    def _shadows(self, name: str) -> bool:
        """The function binds `name` locally (a parameter, or assigned without `global`)."""
        if self.function is None:
            return False
        if name in parameter_names(self.function):
            return True
        nodes = self.nodes()
        if any(isinstance(node, ast.Global) and name in node.names for node in nodes):
            return False
        return any(isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store) for node in nodes)

    def names(self) -> set[str]:
        """The names that can stand for the tensor here: no expression spelling none of them is it,
        holds it, or is computed from it."""
        return {self.study.variable, *self.study.accessors, *self.x_names, *self.accessors, *self.holding, *self.derived}

    # what an expression is

    def _receiver_ok(self, receiver: ast.expr) -> bool:
        """For an attribute: `self.x` in the owner's class (or a class of its module); any other object."""
        if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
            study = self.study
            return (
                study.name.owner is None
                or self.class_name == study.name.owner
                or (self.defining and self.class_name in study.classes_here)
            )
        return True

    def is_global(self, node: ast.expr) -> bool:
        """The tensor itself: its name, `module.X`, `obj.x`, `get_x()`, `X.data`."""
        study = self.study
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
            return self.imports.dotted(node.value) == study.name.module
        if isinstance(node, ast.Call):
            func = node.func
            if study.attribute:
                return (
                    callee_name(func) == "getattr"
                    and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value == variable
                )
            if isinstance(func, ast.Name):
                return func.id in self.accessors
            return (
                isinstance(func, ast.Attribute)
                and func.attr in study.accessors
                and self.imports.dotted(func.value) == study.name.module
            )
        return False

    def is_ref(self, node: ast.expr) -> bool:
        """The tensor, an element or view of it, or a local alias of either."""
        while True:
            if self.is_global(node):
                return True
            if isinstance(node, ast.Name):
                return node.id in self.holding
            if isinstance(node, ast.Subscript):
                node = node.value
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and (node.func.attr in ELEMENT_METHODS or node.func.attr.endswith("_"))
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
            return None if node.attr in METADATA_ATTRS else self.relation(node.value)
        if isinstance(node, ast.Subscript):
            return self.relation(node.value) or ("computed" if self.relation(node.slice) else None)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in METADATA_METHODS:
                return None
            parts = [self.relation(argument) for argument in node.args]
            parts += [
                self.relation(keyword.value)
                for keyword in node.keywords
                if not (keyword.arg and tokens(keyword.arg) & HANDLE_TOKENS)
            ]
            if isinstance(func, ast.Attribute):
                parts.append(self.relation(func.value))
            parts = [part for part in parts if part]
            if not parts:
                return None
            return "copy" if callee_name(func) in COPY_CALLS and "computed" not in parts else "computed"
        if isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Starred)):
            parts = [self.relation(child) for child in ast.iter_child_nodes(node)]
            parts = [part for part in parts if part]
            return None if not parts else ("computed" if "computed" in parts else "copy")
        if isinstance(node, ast.comprehension):
            return self.relation(node.iter)
        parts = [self.relation(child) for child in ast.iter_child_nodes(node)]
        return "computed" if any(parts) else None

    # what a local now holds

    def bind_loop(self, target: ast.expr, iterable: ast.expr) -> None:
        pairing = callee_name(iterable.func) if isinstance(iterable, ast.Call) else None
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
                self.holding.add(name)
            elif relation:
                old = self.derived.get(name)
                self.derived[name] = "computed" if "computed" in (old, relation) else "copy"
            return
        self.holding.discard(name)
        self.derived.pop(name, None)
        if relation == "ref":
            self.holding.add(name)
        elif relation:
            self.derived[name] = relation
