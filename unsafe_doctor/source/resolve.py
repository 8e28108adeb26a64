"""Which global an expression means: the one resolver.

Every stage that asks "which module global, class attribute or singleton field does this code
name" asks here; nothing else walks imports to resolve a name. Files are read through a
`Workspace`, never imported. (The audit's flow walk, `unsafe_doctor.recovery_code.walk`, asks
another question: what every statement of whole trees does to any holder, in one forward pass.)

Entry points:

* `resolve(expression, scope, workspace)` (or `resolve_chain(flatten(expression), ...)`): how the
  chain's root name is bound, as a `Resolved`: the global's `variable`, its `module` and `owner`
  class, the `anchor` (which part of the chain names it), a `Tier` (how sure), notes, the
  `parameter` it starts at, and whether it is an lru-cached call's result. None: no tensor
  (a builtin, a library module, a constant flag, a function object).
* `resolve_written(parts, statement, scope, workspace)`: the same for a chain written inside a
  statement, where a comprehension's loop variable stands for an element of its iterable: the
  iterable's chain is resolved, and returned with its `Resolved`.
* `Scope` says where the expression is: `Scope.of(source)` for module-level code,
  `Scope.of(source, function, cls)` for a function or method of a parsed `SourceFile` (for
  instance one of an index of modules: `workspace.module_source(name)` or `workspace.source(path,
  module)`), with `line` set to see only the local bindings made up to it (a log frame's line).
* In `unsafe_doctor.source.imports`, for callers that know the module they look for:
  `module_named(dotted, workspace)`, the module on disk a dotted import target names, through
  re-exports (`from . import parallel_state as mpu`); `module_member(target, attributes,
  workspace)`, which module and member an imported name and the attributes after it mean
  (`mpu._X.y` -> `megatron.core.parallel_state`, `_X`, `('y',)`); `Imports.of(source, function)`,
  the names the module's and the function's imports bind, and `imports.dotted(node)`, the dotted
  path an expression names through them (`mpu._X`).

From an index of modules rather than a log frame, resolve every name a function reads:

    workspace = Workspace(roots)
    source = workspace.module_source("toytrain.train")  # or workspace.source(path, module)
    function = source.bindings["clip_gradients"]
    scope = Scope.of(source, function)  # a method: Scope.of(source, method, class_node)
    for node in ast.walk(function):
        if isinstance(node, (ast.Name, ast.Attribute)):
            found = resolve(node, scope, workspace)
            # state._EMA_GRAD_NORM -> Resolved(Tier.GLOBAL, name=GlobalName(module='toytrain.state',
            #                                  owner=None, variable='_EMA_GRAD_NORM'), ...)

Resolving may read further modules through the workspace (imports, re-exports, a function's
`return`), at most `MAX_DEPTH` deep; it never imports them.

The rules, in order (see also `unsafe_doctor.diagnose.locate`): `self.x` / `cls.x` is attribute `x` of the
method's class (`self.rope(n)` is an lru-cached call's result when `Rope.forward` is cached); a
name the function declares `global` is the module's; a parameter stays a parameter; a local is
what it was last bound to before the line (an import, or an alias of a global:
`buf = mod._BUF`, `tracker = get_tracker()`, or of the iterable of a comprehension:
`xs = [t[0] for t in _X]`); then the module-level binding: an import
(followed into the module it names, through re-exports), a class (`Cls.attr`,
`Cls.instance.field`), a function (the global it returns, or its lru-cached result), an
assignment (the module global itself, unless a constant flag). Without source, naming conventions
decide (`_UPPER`, `mod._UPPER`, `ClassName.attr`): tier `GUESS`.
"""

from __future__ import annotations

import ast
import builtins
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import IntEnum

from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.source.syntax import (
    Function,
    ImportedName,
    comprehension_element,
    declared_globals,
    flatten,
    is_cached,
    is_lambda_parameter,
    local_binding,
    loop_iterable,
    one_line,
    parameter_names,
    returned_values,
    source_segment,
    walk_scope,
)
from unsafe_doctor.source.workspace import Binding, SourceFile, Workspace


class Tier(IntEnum):
    """How likely a chain names the global tensor: higher wins."""

    LOCAL = 0  # a plain local
    PARAMETER = 1  # a parameter of the function: its caller knows more
    UNKNOWN = 2  # a name whose binding is not known
    SELF = 3  # `self.attr`
    GUESS = 4  # looks global, without source (`_UPPER`, `mod._UPPER`, `ClassName.attr`)
    GLOBAL = 5  # resolved to a global from the source


MAX_DEPTH = 6  # calls, imports and aliases followed at most
_TENSOR_ATTRIBUTES = frozenset({"data", "grad", "T", "mT", "H", "mH", "real", "imag"})
_LIBRARIES = frozenset({"torch", "torch_npu", "torchair", "numpy", "transformer_engine", "apex", "triton"})
_LIBRARY_ALIASES = frozenset({"torch", "torch_npu", "np", "numpy", "math", "F", "nn", "dist", "te", "os", "sys"})
_BUILTINS = frozenset(dir(builtins))
_GLOBAL_NAME = re.compile(r"_*[A-Z][A-Z0-9_]*")
_CLASS_NAME = re.compile(r"_*[A-Z]\w*[a-z]\w*")


@dataclass(frozen=True)
class Scope:
    """Where an expression is: its module and source, the functions around it, the class of `self`."""

    module: str | None
    source: SourceFile | None
    functions: tuple[Function, ...]  # enclosing functions, innermost last
    cls: ast.ClassDef | None  # class of the method that binds `self`
    line: int | None  # local bindings up to this line are visible (None: all of them)

    @classmethod
    def of(cls, source: SourceFile, function: Function | None = None, owner: ast.ClassDef | None = None) -> Scope:
        """Module-level code of `source` (no function), or a function or method of it."""
        return cls(source.module, source, (function,) if function is not None else (), owner, None)

    def local_binding(self, function: Function, name: str) -> ast.expr | ImportedName | None:
        """What `function` last bound `name` to, up to the scope's line (see `syntax.local_binding`)."""
        return local_binding(function, name, self.line, self.source.package if self.source else None)


@dataclass(frozen=True)
class Resolved:
    """The global a chain names, or what the chain is when it names none (tier below GUESS)."""

    tier: Tier
    anchor: int  # index of the chain part that names the global
    name: GlobalName[str | None, str | None]  # its owner the class, for a class attribute, singleton field or `self.attr`
    notes: tuple[str, ...] = ()
    parameter: str | None = None  # the chain starts at this parameter of the scope's function
    cached: bool = False  # the chain's call hands back what an lru_cache keeps across steps


def resolve(expression: ast.expr, scope: Scope, workspace: Workspace) -> Resolved | None:
    """The global `expression` names (see the module docstring); None for no tensor or no chain."""
    parts = flatten(expression)
    return resolve_chain(parts, scope, workspace) if parts is not None else None


def _unresolved(scope: Scope, tier: Tier, parts: Sequence[ast.expr], parameter: str | None = None) -> Resolved:
    """No global found: the expression is the chain's field path (`mod.obj.field`, `tracker`)."""
    end = 0
    while _is_field(parts, end + 1):
        end += 1
    return Resolved(tier, end, GlobalName(scope.module, None, None), parameter=parameter)


def _root(parts: Sequence[ast.expr]) -> str:
    """The name a chain starts at (`flatten` makes only chains rooted at a name)."""
    first = parts[0]
    return first.id if isinstance(first, ast.Name) else ""


def _attribute(parts: Sequence[ast.expr], index: int) -> str | None:
    """The attribute name at `parts[index]`; None when that part is no attribute (or past the end)."""
    part = parts[index] if index < len(parts) else None
    return part.attr if isinstance(part, ast.Attribute) else None


def _is_attribute(parts: Sequence[ast.expr], index: int) -> bool:
    return _attribute(parts, index) is not None


def _is_call(parts: Sequence[ast.expr], index: int) -> bool:
    return index < len(parts) and isinstance(parts[index], ast.Call)


def _is_field(parts: Sequence[ast.expr], index: int) -> bool:
    """An attribute that names an object's field: not a tensor attribute, not a method being called."""
    return _is_attribute(parts, index) and _attribute(parts, index) not in _TENSOR_ATTRIBUTES and not _is_call(parts, index + 1)


def resolve_chain(parts: list[ast.expr], scope: Scope, workspace: Workspace, depth: int = 0) -> Resolved | None:
    """How the chain's root name is bound, per the frame's source; None when it is no tensor."""
    root = _root(parts)
    if depth > MAX_DEPTH:
        return _unresolved(scope, Tier.UNKNOWN, parts)
    if root in ("self", "cls"):
        return _self_member(parts, scope, workspace)
    if scope.source is None:
        return _guess(parts, scope, workspace)
    function = scope.functions[-1] if scope.functions else None
    if function is not None:
        if root in declared_globals(function):
            return _in_source(scope.source, scope.module, root, parts, 0, workspace=workspace, depth=depth, cross_module=False)
        if root in parameter_names(function):
            return _rebound_parameter(root, function, parts, scope, workspace, depth=depth)
        binding = scope.local_binding(function, root)
        if isinstance(binding, ImportedName):
            return _imported(binding.target, parts, 0, workspace, depth)
        if binding is not None:
            return _alias(root, binding, parts, scope, workspace, depth=depth)
        if any(root in parameter_names(outer) or scope.local_binding(outer, root) for outer in scope.functions[:-1]):
            return _unresolved(scope, Tier.LOCAL, parts)
    if root in scope.source.bindings:
        return _in_source(scope.source, scope.module, root, parts, 0, workspace=workspace, depth=depth, cross_module=False)
    if root in _BUILTINS:
        return None
    return _unresolved(scope, Tier.UNKNOWN, parts)


def _rebound_parameter(
    name: str, function: Function, parts: list[ast.expr], scope: Scope, workspace: Workspace, *, depth: int
) -> Resolved:
    """A parameter, unless the function rebinds it to a global before the line
    (`if attention_mask is None: attention_mask = get_attention_mask()`): that global, which
    names a tensor where the caller's argument may name none."""
    parameter = _unresolved(scope, Tier.PARAMETER, parts, parameter=name)
    rebound = scope.local_binding(function, name)
    line = getattr(rebound, "lineno", None)  # none on `OPAQUE`: a loop target, `with ... as`
    if not isinstance(rebound, ast.expr) or line is None or scope.line is None or line > scope.line:
        return parameter
    resolved = _alias(name, rebound, parts, scope, workspace, depth=depth)
    return resolved if resolved.tier >= Tier.GUESS else parameter


def resolve_written(
    parts: list[ast.expr], written_in: ast.AST, scope: Scope, workspace: Workspace, depth: int = 0
) -> tuple[list[ast.expr], Resolved] | None:
    """How a chain written inside `written_in` (a statement, or a value) is bound, with the chain
    that names it: a comprehension's loop variable stands for an element of its iterable, so the
    iterable's chain is resolved instead (`t[0]` in `sum(t[0] for t in _LOSSES)` is `_LOSSES`).
    A loop variable over something that names nothing (`range(n)`, `zip(a, b)`), and a lambda's
    parameter, are plain locals."""
    root = parts[0]
    if isinstance(root, ast.Name) and is_lambda_parameter(written_in, root):
        return parts, _unresolved(scope, Tier.LOCAL, parts)
    iterable = loop_iterable(written_in, root) if isinstance(root, ast.Name) else None
    if iterable is None:
        resolved = resolve_chain(parts, scope, workspace, depth)
        return (parts, resolved) if resolved is not None else None
    iterable_parts = flatten(comprehension_element(iterable))
    followed = None
    if iterable_parts is not None and depth <= MAX_DEPTH:
        followed = resolve_written(iterable_parts, written_in, scope, workspace, depth + 1)
    if followed is None:
        return parts, _unresolved(scope, Tier.LOCAL, parts)
    iterable_parts, resolved = followed
    note = f"{_root(parts)} is an element of {ast.unparse(iterable)}"
    return iterable_parts, replace(resolved, notes=(*resolved.notes, note))


def _self_member(parts: list[ast.expr], scope: Scope, workspace: Workspace) -> Resolved | None:
    """`self.attr` -> attribute `attr` of the class whose method the frame runs."""
    attribute = _attribute(parts, 1)
    if attribute is None:
        return None  # bare self
    if _is_call(parts, 2):
        return _cached_submodule_call(attribute, scope, workspace) or _unresolved(scope, Tier.UNKNOWN, parts)
    owner = scope.cls.name if scope.cls else None
    notes: tuple[str, ...] = () if owner or scope.source is None else ("the class of `self` was not found in the source",)
    return Resolved(Tier.SELF, 1, GlobalName(scope.module, owner, attribute), notes)


# Calling an object runs these: `__call__`, or `forward` for a torch.nn.Module.
_CALL_METHODS = ("forward", "__call__")


def _cached_submodule_call(attribute: str, scope: Scope, workspace: Workspace) -> Resolved | None:
    """`self.rope(n)` where a method of the class set `self.rope = Rope(...)` and Rope's forward (or
    __call__) is an lru_cache: the result is the cache's, kept across steps by the class."""
    if scope.cls is None or scope.source is None:
        return None
    for method in scope.cls.body:
        if not isinstance(method, Function):
            continue
        for node in walk_scope(method):
            if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
                continue
            if not any(_is_self_attribute(target, attribute) for target in node.targets):
                continue
            defined = _class_definition(node.value.func, replace(scope, functions=(method,), line=None), workspace)
            if defined is None:
                continue
            cls, module = defined
            called = next((f for f in cls.body if is_cached(f) and f.name in _CALL_METHODS), None)
            if called is not None:
                note = (
                    f"self.{attribute} is a {cls.name}, whose {called.name}() is an lru_cache: "
                    "it returns what earlier steps built"
                )
                return Resolved(Tier.GLOBAL, 2, GlobalName(module, cls.name, called.name), (note,), cached=True)
    return None


def _is_self_attribute(target: ast.expr, attribute: str) -> bool:
    return (
        isinstance(target, ast.Attribute)
        and target.attr == attribute
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    )


def _class_definition(callee: ast.expr, scope: Scope, workspace: Workspace) -> tuple[ast.ClassDef, str | None] | None:
    """The class a constructor call's callee (`Rope`, `mod.Rope`) names, with its module: followed
    through imports (a function's own included) and re-exports, read from source."""
    parts = flatten(callee)
    if parts is None or scope.source is None or not all(isinstance(part, (ast.Name, ast.Attribute)) for part in parts):
        return None
    root = _root(parts)
    binding: ast.expr | Binding | None = scope.local_binding(scope.functions[-1], root) if scope.functions else None
    binding = binding if binding is not None else scope.source.binding(root)
    module, attributes = scope.module, [part.attr for part in parts[1:] if isinstance(part, ast.Attribute)]
    for _ in range(MAX_DEPTH):
        if isinstance(binding, ast.ClassDef) and not attributes:
            return binding, module
        if not isinstance(binding, ImportedName):
            return None
        module, _, name = ".".join([binding.target, *attributes]).rpartition(".")
        if _is_library(module):
            return None
        source = workspace.module_source(module) if module else None
        if source is None:
            return None
        binding, attributes = source.binding(name), []
    return None


def _guess(parts: list[ast.expr], scope: Scope, workspace: Workspace) -> Resolved | None:
    """Without source, naming conventions decide: `_UPPER` globals, `mod._UPPER`, `ClassName.attr`."""
    root = _root(parts)
    if root in _BUILTINS or root in _LIBRARY_ALIASES:
        return None
    if _CLASS_NAME.fullmatch(root) and _is_attribute(parts, 1):
        return _class_member(parts, 0, root, scope.module, Tier.GUESS)
    if _GLOBAL_NAME.fullmatch(root):
        return Resolved(Tier.GUESS, 0, GlobalName(scope.module, None, root))
    attribute = _attribute(parts, 1)
    if attribute is not None and _GLOBAL_NAME.fullmatch(attribute):
        module, note = _guess_module(root, scope.module, workspace)
        return Resolved(Tier.GUESS, 1, GlobalName(module, None, attribute), (note,))
    return _unresolved(scope, Tier.UNKNOWN, parts)


def _guess_module(alias: str, frame_module: str | None, workspace: Workspace) -> tuple[str, str]:
    """`parallel_state` seen in megatron/core/transformer/moe/x.py: the nearest package holding it."""
    packages = (frame_module or "").split(".")[:-1]
    for size in range(len(packages), -1, -1):
        candidate = ".".join([*packages[:size], alias])
        path = workspace.module_path(candidate)
        if path is not None:
            return candidate, f"`{alias}` taken as {candidate}, found at {path}"
    if frame_module is None:
        return alias, f"module `{alias}` was not found, nor the frame's own module: its full name is unknown"
    return alias, f"module `{alias}` was not found near {frame_module}: its full name is unknown"


def _class_member(parts: list[ast.expr], index: int, owner: str, module: str | None, tier: Tier) -> Resolved | None:
    """`Cls.attr` (class attribute) or `Cls.instance.field` (singleton field)."""
    if not _is_attribute(parts, index + 1):
        return None  # the class itself
    if _is_call(parts, index + 2):
        return Resolved(Tier.UNKNOWN, index, GlobalName(module, None, None))  # Cls.method(...)
    anchor = index + 2 if _is_field(parts, index + 2) else index + 1
    return Resolved(tier, anchor, GlobalName(module, owner, _attribute(parts, anchor)))


def _imported(target: str, parts: list[ast.expr], index: int, workspace: Workspace, depth: int) -> Resolved | None:
    """A name bound by an import to `target`: a module (then its attribute is the global) or a member."""
    if depth > MAX_DEPTH or _is_library(target):
        return None
    if workspace.module_path(target) is not None:
        module, at = target, index + 1
        attribute = _attribute(parts, at)
        while attribute is not None and workspace.module_path(f"{module}.{attribute}") is not None:
            module, at = f"{module}.{attribute}", at + 1
            attribute = _attribute(parts, at)
        if attribute is None:
            return None  # the module itself
        return _in_module(module, attribute, parts, at, workspace, depth=depth)
    head, _, name = target.rpartition(".")
    if head and workspace.module_path(head) is not None:
        return _in_module(head, name, parts, index, workspace, depth=depth)
    attribute = _attribute(parts, index + 1)
    if attribute is not None and not _CLASS_NAME.fullmatch(name):
        note = f"{target} was not found locally: taken as a module"
        return Resolved(Tier.GLOBAL, index + 1, GlobalName(target, None, attribute), (note,))
    return _in_source(None, head or None, name, parts, index, workspace=workspace, depth=depth, cross_module=True)


def _is_library(dotted: str) -> bool:
    top = dotted.split(".")[0]
    return top in _LIBRARIES or top in sys.stdlib_module_names


def _in_module(module: str, name: str, parts: list[ast.expr], index: int, workspace: Workspace, *, depth: int) -> Resolved | None:
    return _in_source(
        workspace.module_source(module), module, name, parts, index, workspace=workspace, depth=depth, cross_module=True
    )


def _in_source(
    source: SourceFile | None,
    module: str | None,
    name: str,
    parts: list[ast.expr],
    index: int,
    *,
    workspace: Workspace,
    depth: int,
    cross_module: bool,
) -> Resolved | None:
    """`name` (at parts[index]) as bound at module level in `source` (module `module`)."""
    binding = source.binding(name) if source else None
    if isinstance(binding, ImportedName):
        return _imported(binding.target, parts, index, workspace, depth + 1)
    looks_like_class = source is None and _CLASS_NAME.fullmatch(name) and _is_attribute(parts, index + 1)
    if isinstance(binding, ast.ClassDef) or looks_like_class:
        return _class_member(parts, index, name, module, Tier.GLOBAL)
    if isinstance(binding, Function):
        return _call_result(binding, source, parts, index, workspace, depth=depth)
    if _is_flag(binding, name, source):
        return None
    if _is_call(parts, index + 1):
        # A function whose source is not here, or a callable a global holds (`_fused_op = None`,
        # set at import): what the call returns is not that global.
        return Resolved(Tier.UNKNOWN, index + 1, GlobalName(module, None, None))
    if cross_module and source is not None and _lacks(source, binding, name):
        note = f"{module} here ({source.path}) has no {name}: the log's version differs from the local one"
        return Resolved(Tier.GLOBAL, index, GlobalName(module, None, name), (note,))
    return Resolved(Tier.GLOBAL, index, GlobalName(module, None, name))


def _lacks(source: SourceFile, binding: Binding | None, name: str) -> bool:
    """The module does not define `name` (no binding, no `global` declaration, no `import *`)."""
    return binding is None and name not in source.declared_globals and not source.star_import


def _is_flag(binding: object, name: str, source: SourceFile | None) -> bool:
    """A module constant such as `HAVE_TE = True`: never a tensor."""
    value = getattr(binding, "value", None)
    return (
        isinstance(binding, (ast.Assign, ast.AnnAssign))
        and isinstance(value, ast.Constant)
        and isinstance(value.value, (bool, int, float, str, bytes))
        and source is not None
        and name not in source.declared_globals
    )


def _call_result(
    function: Function, source: SourceFile | None, parts: list[ast.expr], index: int, workspace: Workspace, *, depth: int
) -> Resolved | None:
    """`get_x()` returning a module global, and `get_instance().field` (singleton field)."""
    if not _is_call(parts, index + 1):
        return None  # the function object
    module = source.module if source else None
    if is_cached(function):
        note = f"{function.name}() is an lru_cache: it returns what earlier steps built"
        return Resolved(Tier.GLOBAL, index + 1, GlobalName(module, None, function.name), (note,), cached=True)
    returned = _returned_global(function, source, workspace, depth)
    if returned is None:
        return Resolved(Tier.UNKNOWN, index + 1, GlobalName(module, None, None))
    note = f"{function.name}() returns {returned.name.variable} of {returned.name.module}"
    if _is_field(parts, index + 2):
        holder = workspace.module_source(returned.name.module) if returned.name.module else None
        owner = _instance_class(returned.name.variable, holder)
        field = _attribute(parts, index + 2)
        return Resolved(Tier.GLOBAL, index + 2, GlobalName(returned.name.module, owner, field), (*returned.notes, note))
    return replace(returned, anchor=index + 1, notes=(*returned.notes, note))


def _returned_global(function: Function, source: SourceFile | None, workspace: Workspace, depth: int) -> Resolved | None:
    if source is None:
        return None
    scope = Scope(source.module, source, (function,), None, None)
    for value in reversed(returned_values(function)):  # the last `return` first: the one after the guards
        parts = flatten(value)
        resolved = resolve_chain(parts, scope, workspace, depth + 1) if parts else None
        if resolved is not None and resolved.tier >= Tier.GUESS and resolved.name.variable:
            return resolved
    return None


def _instance_class(name: str | None, source: SourceFile | None) -> str | None:
    """The class of the object a module global holds: `_INSTANCE = Foo(...)` anywhere in its module."""
    if name is None or source is None:
        return None
    for node in ast.walk(source.tree):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(target, ast.Name) and target.id == name for target in node.targets)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
        ):
            return node.value.func.id
    return None


def _alias(name: str, value: ast.expr, parts: list[ast.expr], scope: Scope, workspace: Workspace, *, depth: int) -> Resolved:
    """A local assigned from a global (`tracker = get_tracker()`, `buf = mod._BUF`): that global,
    while the expression keeps the local's own name."""
    local = _unresolved(scope, Tier.LOCAL, parts)
    value_parts = flatten(comprehension_element(value))  # `x = [t[0] for t in _X]` holds elements of _X
    if value_parts is None:
        return local
    earlier = replace(scope, line=value.lineno - 1)
    written = resolve_written(value_parts, value, earlier, workspace, depth + 1)
    resolved = written[1] if written else None
    if resolved is not None and resolved.parameter:
        return _unresolved(scope, Tier.PARAMETER, parts, parameter=resolved.parameter)
    if resolved is None or resolved.tier < Tier.SELF or resolved.name.variable is None:
        return local
    text = source_segment(scope.source.text, value) if scope.source else None
    kind = "the cached result" if resolved.cached else f"a local alias of {resolved.name.variable}"
    note = f"{name} is {kind}: `{name} = {one_line(text or ast.unparse(value))}`"
    return replace(resolved, anchor=0, notes=(*resolved.notes, note))
