"""What an expression in one scope refers to: a holder (or part of one), a function, a class, a
module; and the holders that small accessor functions return (`def get_x(): return X`).

The flow walk's name lookup, not `source.resolve`: it answers from the scope's names as the walk
has learnt them (`flow_scope.FlowScope`) and from the index of modules, for every name of whole
trees, where the resolver reads a function back for one expression at one line."""

from __future__ import annotations

import ast

from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.recovery_code.flow_scope import FlowScope
from unsafe_doctor.recovery_code.index import ACCESSOR_SIZE, Index
from unsafe_doctor.recovery_code.refs import ClassKey, ClassRef, FunctionRef, HolderRef, Ref, SelfRef
from unsafe_doctor.recovery_code.vocabulary import METADATA, NOT_DATA_CALLS
from unsafe_doctor.source.imports import through_imports
from unsafe_doctor.source.syntax import ImportedName, returned_values, scope_statements


class Accessors:
    """The holder each module function returns, if it is an accessor; decided once per function."""

    def __init__(self, index: Index):
        self.index = index
        # (module, class, line, column) of a function -> holder key it returns: by place, as a tree
        # read again has other nodes
        self._returned: dict[tuple[str, str | None, int, int], GlobalName[str, str] | None] = {}

    def returned_by(self, function: FunctionRef) -> GlobalName[str, str] | None:
        place = (function.module, function.owner, *function.place)
        if place in self._returned:
            return self._returned[place]
        self._returned[place] = None  # while deciding: a recursive accessor returns nothing
        info = self.index.module(function.module)
        key = None
        small = function.owner is None and function.statements <= ACCESSOR_SIZE  # the node is read only then
        small = small and not (info is not None and function.place in info.no_accessors)
        node = function.node if small else None
        if info is not None and node is not None and sum(1 for _ in scope_statements(node.body)) <= ACCESSOR_SIZE:
            names = Names(self.index, self, FlowScope.of_function(info, node, None))
            for value in returned_values(node):
                ref = names.resolve(value)
                if isinstance(ref, HolderRef) and not ref.element:
                    key = ref.key
                    break
        self._returned[place] = key
        return key


class Names:
    """Name resolution inside one scope, with what the walk of that scope has learnt so far."""

    def __init__(self, index: Index, accessors: Accessors, scope: FlowScope):
        self.index = index
        self.accessors = accessors
        self.scope = scope

    def resolve(self, node: ast.AST) -> Ref | None:
        if isinstance(node, ast.Name):
            return self.resolve_name(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            if base is not None:
                return self.index.member(base, node.attr)
            return self.buffer_by_name(node.attr)
        if isinstance(node, ast.Subscript):
            base = self.resolve(node.value)
            return HolderRef(base.key, True) if isinstance(base, HolderRef) else None
        if isinstance(node, ast.Call):
            attribute = _as_attribute(node)
            return self.resolve(attribute) if attribute is not None else self._called(node.func)
        return None

    def _called(self, func: ast.expr) -> Ref | None:
        """What a call returns: the holder an accessor returns, or a part of a holder."""
        if isinstance(func, ast.Attribute) and func.attr in METADATA:
            return None
        base = self.resolve(func)
        if isinstance(base, FunctionRef):
            key = self.accessors.returned_by(base)
            return HolderRef(key, False) if key is not None else None
        if isinstance(base, HolderRef):
            return HolderRef(base.key, True)
        return None

    def resolve_name(self, name: str) -> Ref | None:
        scope = self.scope
        if name in scope.aliases:
            return scope.aliases[name]
        if name in scope.imports:
            return self.index.resolve_dotted(scope.imports[name].target)
        if name in scope.nested:
            return FunctionRef.holding(scope.module.name, None, scope.nested[name])
        if name == scope.self_name and scope.owner is not None:
            return ClassRef(scope.module.name, scope.owner) if scope.self_is_class else SelfRef(scope.module.name, scope.owner)
        if name in scope.locals:
            return None
        return self.index.member_of(scope.module, name)

    def buffer_by_name(self, attribute: str) -> HolderRef | None:
        """`<anything>.expert_bias` where the function names the buffer's class."""
        owners = self.index.buffers.get(attribute)
        if not owners or self.scope.function is None:
            return None
        named = [owner for owner in owners if owner.name in self.scope.mentioned()]
        if len(named) != 1:
            return None
        return HolderRef(GlobalName(named[0].module, named[0].name, attribute), False)

    def holder_in(self, node: ast.AST) -> HolderRef | None:
        """The first holder an expression refers to, anywhere in it."""
        for inner in ast.walk(node):
            if isinstance(inner, (ast.Name, ast.Attribute, ast.Subscript, ast.Call)):
                ref = self.resolve(inner)
                if isinstance(ref, HolderRef):
                    return ref
        return None

    def reads_holder(self, node: ast.AST | None) -> bool:
        """Whether computing the expression reads a holder's data (metadata does not count)."""
        if node is None:
            return False
        if isinstance(node, ast.Name) and node.id in self.scope.derived:
            return True
        if isinstance(node, ast.Attribute) and node.attr in METADATA:
            return False
        if isinstance(node, ast.Call) and _reads_no_data(node.func):
            return False
        if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)) and isinstance(self.resolve(node), HolderRef):
            return True
        return any(self.reads_holder(child) for child in ast.iter_child_nodes(node) if isinstance(child, ast.expr))

    def dotted(self, node: ast.expr) -> str | None:
        """`torch.zeros`, `F.relu` -> 'torch.nn.functional.relu': the imported name a chain spells."""
        return through_imports(node, self._imported)

    def _imported(self, name: str) -> str | None:
        """What an import binds `name` to here: the function's own import, else the module's, unless
        the function binds `name` otherwise."""
        binding = self.scope.imports.get(name) or self.scope.module.source.bindings.get(name)
        if not isinstance(binding, ImportedName) or (name in self.scope.locals and name not in self.scope.imports):
            return None
        return binding.target

    def instance_attribute(self, target: ast.expr) -> bool:
        """`self.x` naming a class attribute (not a buffer)."""
        if not isinstance(target, ast.Attribute):
            return False
        base = self.resolve(target.value)
        if not isinstance(base, SelfRef):
            return False
        owner = self.index.class_(ClassKey(base.module, base.name))
        return owner is not None and target.attr not in owner.buffers

    def self_rooted(self, node: ast.expr) -> bool:
        """`self.x`, `self.x[k].y` in a method (not a classmethod)."""
        if self.scope.owner is None or self.scope.self_name is None or self.scope.self_is_class:
            return False
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return isinstance(node, ast.Name) and node.id == self.scope.self_name


def _reads_no_data(func: ast.expr) -> bool:
    """`x.shape()`-like metadata methods and `isinstance()`-like calls read no tensor data."""
    if isinstance(func, ast.Attribute):
        return func.attr in METADATA
    return isinstance(func, ast.Name) and func.id in NOT_DATA_CALLS


def _as_attribute(call: ast.Call) -> ast.Attribute | None:
    """`getattr(x, "name", default)` reads `x.name`: how generated fixes read a global that may be absent."""
    func, args = call.func, call.args
    if not (isinstance(func, ast.Name) and func.id == "getattr" and 2 <= len(args) <= 3):
        return None
    name = args[1]
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.isidentifier()):
        return None
    return ast.Attribute(value=args[0], attr=name.value, ctx=ast.Load())
