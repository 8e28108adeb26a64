"""What imports bind, and which module on disk a dotted target means (through re-exports): the
import half of `unsafe_doctor.source.resolve`, for callers that know the module they look for
(stale's resets, heuristics' uses of one global, the audit's index of modules). What a function's
own imports bind (`imports_bound`) and the dotted path a chain names through them
(`through_imports`) are read here for every stage, the audit's flow walk and the adaptor's
blocks included."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from unsafe_doctor.source.syntax import Function, ImportedName, dotted_name, import_bindings, scope_statements
from unsafe_doctor.source.workspace import SourceFile, Workspace

MAX_HOPS = 6  # re-exports followed at most


@dataclass(frozen=True)
class Imports:
    """The names imports bind in a scope: the module's (also under `if` / `try`), then those of the
    function's own imports up to `line`, the last one of a name winning."""

    names: dict[str, ImportedName]

    @classmethod
    def of(cls, source: SourceFile, function: Function | None = None, line: int | None = None) -> Imports:
        names = dict(source.imports)
        if function is not None:
            local = [
                statement
                for statement in scope_statements(function.body)
                if isinstance(statement, (ast.Import, ast.ImportFrom)) and (line is None or statement.lineno <= line)
            ]
            names.update(imports_bound(local, source.package))
        return cls(names)

    def target(self, name: str) -> str | None:
        imported = self.names.get(name)
        return imported.target if imported is not None else None

    def dotted(self, node: ast.expr) -> str | None:
        """The dotted path a name or attribute chain names through the imports: `mpu._X` ->
        `megatron.core.parallel_state._X`; None when its root is not imported."""
        return through_imports(node, self.target)


def imports_bound(statements: Iterable[ast.Import | ast.ImportFrom], package: str | None) -> dict[str, ImportedName]:
    """The names a scope's import statements bind (relative ones against `package`), the last one
    of a name by line winning: a function's own imports, for `Imports.of` and the audit's flow walk."""
    names: dict[str, ImportedName] = {}
    for statement in sorted(statements, key=lambda statement: statement.lineno):
        names.update(import_bindings(statement, package))
    return names


def through_imports(node: ast.AST, target_of: Callable[[str], str | None]) -> str | None:
    """The dotted path a name or attribute chain names through the import its root name is bound
    to (`target_of(root)`, None for no import): `F.relu` with `F` bound to `torch.nn.functional` ->
    `torch.nn.functional.relu`. None for a chain that is no dotted name (`f().x`, `a[0].x`). The
    one reader of a chain through imports: each caller says what binds a root name in its scope."""
    root, _, rest = (dotted_name(node) or "").partition(".")
    target = target_of(root) if root else None
    if target is None:
        return None
    return f"{target}.{rest}" if rest else target


def module_named(dotted: str, workspace: Workspace, hops: int = 0) -> str | None:
    """The dotted name of the module on disk that `dotted` refers to, following re-exports such as
    `mpu = parallel_state` or `from . import parallel_state as mpu` in a package's `__init__`."""
    if not dotted or hops > MAX_HOPS:
        return None
    if workspace.module_path(dotted) is not None:
        return dotted
    head, _, name = dotted.rpartition(".")
    parent = module_named(head, workspace, hops + 1) if head else None
    binding = workspace.imported_name(parent, name) if parent else None
    if binding is not None:
        return module_named(binding.target, workspace, hops + 1)
    return None


@dataclass(frozen=True)
class ModuleMember:
    """A module-level name of a module on disk, and the attributes or subscripts (None) after it."""

    module: str
    name: str
    rest: tuple[str | None, ...]


def module_member(target: str, attributes: Sequence[str | None], workspace: Workspace) -> ModuleMember | None:
    """Which module member an imported name (bound to `target`) followed by `attributes` means:
    `mpu` -> `megatron.core.parallel_state` with `("_X", "y")` is `_X` of that module, `("y",)` after
    it; submodules are descended into while a name follows them. None when the module is not on
    disk or the chain names a module itself."""
    module = module_named(target, workspace)
    names = list(attributes)
    if module is None:
        head, _, name = target.rpartition(".")
        module = module_named(head, workspace) if head else None
        if module is None:
            return None
        names.insert(0, name)  # `from pkg.mod import X` then `X.field = ...`
    while len(names) > 1 and names[0] is not None:
        deeper = module_named(f"{module}.{names[0]}", workspace)
        if deeper is None:
            break
        module = deeper
        names.pop(0)
    first = names[0] if names else None
    return ModuleMember(module, first, tuple(names[1:])) if first is not None else None


def defined_member(target: str, workspace: Workspace, readable: Callable[[str], bool]) -> ModuleMember | None:
    """The module member an import target names where it is defined, through the names modules
    re-export (`from .state import BUF` in a package's `__init__`); None for a module itself, or for
    a target whose top-level package `readable` refuses (libraries are not read)."""
    for _ in range(MAX_HOPS + 1):
        if not readable(target):
            return None
        member = module_member(target, (), workspace)
        binding = workspace.imported_name(member.module, member.name) if member is not None else None
        if binding is None:
            return member
        target = binding.target
    return None
