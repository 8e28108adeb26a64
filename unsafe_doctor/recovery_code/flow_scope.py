"""One scope of code as the flow walk (`walk.Walker`) goes through it, statement by statement: what
its names mean (locals, globals, imports, nested functions, `self`), read once from its statements,
and what the walk has learnt so far (aliases of holders, placements of locals).

It is not `source.resolve.Scope`, which places one expression at one line and asks, for that one
name, what the function bound it to last (reading the function again for each name). The walk
resolves every name of every function of whole trees in one forward pass, so a scope here keeps
its names as sets and the walk's findings as it goes."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from unsafe_doctor.recovery_code.index import ModuleInfo
from unsafe_doctor.recovery_code.refs import HolderRef
from unsafe_doctor.source.imports import imports_bound
from unsafe_doctor.source.syntax import (
    Function,
    ImportedName,
    functions_in,
    names_bound,
    parameter_names,
    scope_statements,
)

TensorPlace = Literal["device", "cpu", "unknown"]  # where a tensor lives, as far as the code says


@dataclass
class FlowScope:
    """A function's or the module body's names, and what the walk learnt of its locals so far."""

    module: ModuleInfo
    function: Function | None  # None: the module body
    owner: str | None  # the class of a method
    qualname: str | None
    self_name: str | None  # a method's first parameter: `self` (instance) or `cls` (classmethod)
    self_is_class: bool
    locals: set[str]
    globals: set[str]
    imports: dict[str, ImportedName]
    nested: dict[str, Function]
    aliases: dict[str, HolderRef] = field(default_factory=dict)
    places: dict[str, TensorPlace] = field(default_factory=dict)  # local name -> placement of the tensor it holds
    devices: dict[str, TensorPlace] = field(default_factory=dict)  # local name -> placement of the device it names
    derived: set[str] = field(default_factory=set)  # locals computed from a holder's data
    mentions: set[str] | None = None

    @classmethod
    def of_function(cls, module: ModuleInfo, node: Function, owner: str | None, qualname: str | None = None) -> FlowScope:
        locals_: set[str] = set(parameter_names(node))
        globals_: set[str] = set()
        imported: list[ast.Import | ast.ImportFrom] = []
        nested: dict[str, Function] = {}
        # Statements only: names bound inside expressions (comprehensions, `:=`) become local when
        # the walker meets them. Walking every expression here would double the audit's time.
        for inner in scope_statements(node.body):
            if isinstance(inner, ast.Global):
                globals_.update(inner.names)
            elif isinstance(inner, (ast.Import, ast.ImportFrom)):
                imported.append(inner)
            elif isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                nested.setdefault(inner.name, inner)  # the walker moves on to later ones of a name
            else:
                locals_.update(_bound_by(inner))
        imports = imports_bound(imported, module.source.package) if imported else {}
        locals_.update(nested)
        locals_ -= globals_
        self_name, self_is_class = _self_parameter(node) if owner is not None else (None, False)
        return cls(module, node, owner, qualname or node.name, self_name, self_is_class, locals_, globals_, imports, nested)

    @classmethod
    def of_module(cls, module: ModuleInfo) -> FlowScope:
        return cls(module, None, None, None, None, False, set(), set(), {}, {})

    def mentioned(self) -> set[str]:
        """Every name and attribute the function spells; an imported name under its own name too
        (`from m import C as _ud_C`, as unsafe-doctor's blocks import, spells `C`)."""
        if self.mentions is None:
            nodes = ast.walk(self.function) if self.function is not None else ()
            self.mentions = {_spelled(node) for node in nodes if isinstance(node, (ast.Name, ast.Attribute, ast.alias))}
        return self.mentions

    def forget(self, name: str) -> None:
        """A local rebound: what was known about its old value no longer holds."""
        self.aliases.pop(name, None)
        self.places.pop(name, None)
        self.devices.pop(name, None)
        self.derived.discard(name)


def _bound_by(statement: ast.stmt) -> Iterator[str]:
    """The local names a statement binds (other than imports and functions)."""
    if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        yield from names_bound(statement.targets if isinstance(statement, ast.Assign) else [statement.target])
    elif isinstance(statement, (ast.For, ast.AsyncFor)):
        yield from names_bound([statement.target])
    elif isinstance(statement, (ast.With, ast.AsyncWith)):
        yield from names_bound([item.optional_vars for item in statement.items if item.optional_vars])
    elif isinstance(statement, ast.Try):
        yield from (handler.name for handler in statement.handlers if handler.name)
    elif isinstance(statement, ast.ClassDef):
        yield statement.name


def _self_parameter(node: Function) -> tuple[str | None, bool]:
    """A method's first parameter, and whether it is the class (a classmethod's `cls`)."""
    decorators = {getattr(d, "id", getattr(d, "attr", None)) for d in node.decorator_list}
    positional = [*node.args.posonlyargs, *node.args.args]
    if positional and "staticmethod" not in decorators:
        return positional[0].arg, "classmethod" in decorators
    return None, False


def functions_of(body: Sequence[ast.stmt]) -> Iterator[tuple[Function, str | None, str]]:
    """Every function and method in a block, with its class (methods of module-level classes only:
    deeper classes, and functions nested in a method, are walked as plain code) and qualified name."""
    for function, enclosing in functions_in(body):
        owner = enclosing[0].name if len(enclosing) == 1 and isinstance(enclosing[0], ast.ClassDef) else None
        yield function, owner, ".".join([*(scope.name for scope in enclosing), function.name])


def _spelled(node: ast.Name | ast.Attribute | ast.alias) -> str:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else node.name.rpartition(".")[2]
