"""Resets in the adaptor's rollback function that miss the framework the user actually runs.

A rollback that re-initialises `mpu._MOE_AUX_LOSSES_LOGGING_TRACKER` on a Megatron that renamed it
only creates an unused attribute: the real tracker keeps its unsafe tensors. This module reads the
adaptor (never imports it), finds the statements of the profile's rollback function that reset a
module attribute, resolves the module through the adaptor's imports (module level and inside the
function) with `unsafe_doctor.source.imports`, finds that module's source on disk (source roots,
then `sys.path`) and reports:

* **missing**: the module exists but defines no such name at module level (assignment, annotated
  assignment, function, class, import, or a `global` declaration in one of its functions). A module
  with `from x import *` or a module `__getattr__` is given the benefit of the doubt. When the
  framework's package has a module-level name that shares the symbol's first and last word
  (`_MOE_..._TRACKER`), the closest one is named as the likely successor (a text scan of the
  package's column-0 assignments, fast on a whole Megatron tree).
* **rebinding**: `mod.X = []` (or `{}`, `set()`, ...) where another module of the same package did
  `from mod import X` at module level: that importer keeps the old object, so the reset splits them;
  the container must be emptied in place with `.clear()`.
* **copy**: `mod.get_x().clear()` (any method on what a call returns) where that function returns a
  new container built on each call (megatron-core 0.18's `get_moe_layer_wise_logging_tracker()`):
  the method empties the copy, the framework's own state keeps its tensors.

Where the release names the global that took the reset's place (the successor, or for a copy the
global the getter's name says), the rule whose fix resets it for that release is named too.

Reset statements: `mod.X = ...`, `mod.X[k] = ...`, `mod.X.attr = ...`, `setattr(mod, "X", ...)` and
method calls on a module attribute (`mod.X.clear()`). Calls of module functions (`mpu.f()`) are not
resets. Modules that cannot be found locally are skipped: nothing can be said about them.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from pathlib import Path
from typing import Literal

from packaging.version import Version

from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.rules import AdaptorProfile, Rule
from unsafe_doctor.knowledge.versions import Environment
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.source.files import FRAMEWORK_DISTRIBUTIONS, package_folder, python_files, read_replacing
from unsafe_doctor.source.imports import Imports, ModuleMember, module_member, module_named
from unsafe_doctor.source.syntax import (
    Function,
    ImportedName,
    is_empty_container,
    scope_statements,
    source_segment,
)
from unsafe_doctor.source.workspace import SourceFile, Workspace

StaleKind = Literal["missing", "rebinding", "copy"]
_MODULE_LEVEL_NAME = re.compile(r"^([A-Za-z_]\w*)\s*(?::[^=\n]*)?=(?!=)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class StaleReset:
    file: Path
    line: int
    statement: str  # the statement as written, on one line
    symbol: str  # '_MOE_AUX_LOSSES_LOGGING_TRACKER'
    module: str  # 'megatron.core.parallel_state'
    kind: StaleKind
    why: str


def stale_resets(
    adaptor: Path, profile: AdaptorProfile, environment: Environment, workspace: Workspace, rules: Sequence[Rule]
) -> list[StaleReset]:
    """Reset statements in the adaptor's rollback function that miss the detected framework.

    `workspace`: the command's (`context.Groundwork`), over the environment's source roots; `rules`:
    the knowledge's, to name the right reset."""
    adaptor = Path(adaptor)
    source = workspace.local_source(adaptor)
    if source is None:
        raise UsageError(f"adaptor {adaptor} cannot be read or is not valid Python")
    rollback = source.bindings.get(profile.rollback)
    if not isinstance(rollback, Function):
        return []
    checker = _Checker(workspace, source, rollback, environment, rules)
    found: list[StaleReset] = []
    for statement in scope_statements(rollback.body):
        for target, rebinds in _reset_targets(statement):
            stale = checker.check(statement, target, rebinds=rebinds)
            if stale is not None:
                found.append(stale)
        getter = _method_on_a_call(statement)
        if getter is not None:
            stale = checker.check_copy(statement, getter)
            if stale is not None:
                found.append(stale)
    return found


# --- which statements reset what ---------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    root: str  # the name the chain starts at: 'mpu'
    attributes: tuple[str | None, ...]  # attribute names after the root; None for a subscript
    value: ast.expr | None  # the value assigned, when the statement assigns one


def _reset_targets(statement: ast.stmt) -> Iterator[tuple[_Target, bool]]:
    """(chain, rebinds) for each module attribute the statement writes or mutates."""
    if isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None:
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        for target in targets:
            chain = _chain(target, statement.value)
            if chain is not None and chain.attributes:
                yield chain, isinstance(target, ast.Attribute)
    elif isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
        call = statement.value
        if getattr(call.func, "id", None) == "setattr" and len(call.args) == 3:
            chain = _chain(call.args[0], call.args[2])
            name = call.args[1]
            if chain is not None and isinstance(name, ast.Constant) and isinstance(name.value, str):
                yield _Target(chain.root, (*chain.attributes, name.value), call.args[2]), True
        elif isinstance(call.func, ast.Attribute):
            chain = _chain(call.func.value, None)
            if chain is not None and chain.attributes:
                yield chain, False  # a method of a module attribute: `mod.X.clear()`


def _method_on_a_call(statement: ast.stmt) -> _Target | None:
    """`mod.get_x().clear()` -> the called chain `mod.get_x` (a method of what a call returns)."""
    if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)):
        return None
    method = statement.value.func
    if not (isinstance(method, ast.Attribute) and isinstance(method.value, ast.Call)):
        return None
    return _chain(method.value.func, None)


def _chain(node: ast.expr, value: ast.expr | None) -> _Target | None:
    """`mod.X[k].y` -> root 'mod', attributes ('X', None, 'y'); None when not rooted at a name."""
    attributes: list[str | None] = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        attributes.append(node.attr if isinstance(node, ast.Attribute) else None)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return _Target(node.id, tuple(reversed(attributes)), value)


# --- resolving and checking ----------------------------------------------------------------------


class _Checker:
    def __init__(
        self, workspace: Workspace, adaptor: SourceFile, rollback: Function, environment: Environment, rules: Sequence[Rule]
    ):
        self.workspace = workspace
        self.adaptor = adaptor
        self.rollback = rollback
        self.environment = environment
        self.rules = rules
        self._names: dict[Path, list[tuple[str, str]]] = {}  # package folder -> (module, name) defined there

    def check(self, statement: ast.stmt, target: _Target, *, rebinds: bool) -> StaleReset | None:
        member = self._resolve(target, statement.lineno)
        if member is None:
            return None
        module, symbol, rest = member.module, member.name, member.rest
        holder = self.workspace.module_source(module)
        if holder is None:
            return None  # a namespace folder, or unreadable: nothing to compare with
        if holder.path.name == "__init__.py" and rest:
            return None  # `pkg.sub.X`: `sub` may be a submodule this tree lacks, not a stale name
        ran = self._releases_run(module)
        if ran is not None:  # the job ran other releases than this machine's: their modules, from the index
            missing = self._missing_in_releases(module, symbol, *ran)
        else:
            missing = None if _defines(holder, symbol) else self._missing_why(holder, module, symbol)
        if missing is not None:
            return self._stale(statement, symbol, module, "missing", missing)
        if rebinds and not rest and is_empty_container(target.value):
            importer = self._importer(holder, module, symbol)
            if importer is not None:
                why = (
                    f"{importer} imports {symbol} from {module} by name: rebinding it leaves that module "
                    f"with the old object; empty it in place with {_alias_of(target)}.clear()"
                )
                return self._stale(statement, symbol, module, "rebinding", why)
        return None

    def check_copy(self, statement: ast.stmt, getter: _Target) -> StaleReset | None:
        """A method called on what a module function returns, where that function builds a new
        container on each call: the method changes the copy only."""
        member = self._resolve(getter, statement.lineno)
        if member is None or member.rest:
            return None
        holder = self.workspace.module_source(member.module)
        function = holder.bindings.get(member.name) if holder is not None else None
        if holder is None or not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or not _returns_new(function):
            return None
        why = (
            f"{self._release(member.module, holder)}: {member.name}() in {member.module} returns a new container on each "
            "call, so this empties a copy and the framework's own state keeps its tensors"
        )
        successor = self._successor(holder, member.module, "_" + member.name.removeprefix("get_").upper())
        if successor is not None:
            why += self._right_reset(*successor)
        return self._stale(statement, member.name, member.module, "copy", why)

    def _release(self, module: str, holder: SourceFile) -> str:
        """`megatron-core 0.18.2`, or the module's file when its release is not known."""
        distribution = _distribution(module)
        version = self.environment.versions.get(distribution) if distribution else None
        return f"{distribution} {version}" if version is not None else f"{module} at {holder.path}"

    def _right_reset(self, module: str, symbol: str) -> str:
        """'; the right reset is rule X's fix', for the rule that names the global in this release."""
        distribution = _distribution(module)
        version = self.environment.versions.get(distribution) if distribution else None
        for rule in self.rules:
            claims = rule.versions is None or version is None or version in rule.versions
            if claims and any(
                match.module is not None and match.names(GlobalName(module, None, symbol)) for match in rule.matches
            ):
                return f"; the right reset is rule {rule.id}'s fix (unsafe-doctor fix writes it)"
        return ""

    def _resolve(self, target: _Target, line: int) -> ModuleMember | None:
        """The module member a chain rooted at an imported name writes (an import in the rollback
        function before the line, else the adaptor's module-level import)."""
        imported = Imports.of(self.adaptor, self.rollback, line).target(target.root)
        return module_member(imported, target.attributes, self.workspace) if imported is not None else None

    def _releases_run(self, module: str) -> tuple[str, tuple[Version, ...], str] | None:
        """(framework, releases, where they come from) when the job ran other releases of the module's
        framework than the one read here (`Environment.job_releases`, as the suspects reason); else None."""
        distribution = _distribution(module)
        ran = self.environment.job_releases().get(distribution or "")
        if distribution is None or ran is None or ran[1] == self.environment.origins.get(distribution):
            return None
        return distribution, ran[0], ran[1]

    def _missing_in_releases(
        self, module: str, symbol: str, distribution: str, releases: tuple[Version, ...], why: str
    ) -> str | None:
        """Why the reset is stale on the releases the job ran (their modules, from the shipped index),
        or None when every one the index holds defines the name; those it does not hold are named
        unchecked, never counted as defining it."""
        held = {str(release): self.workspace.module_source_at(module, distribution, str(release)) for release in releases}
        compared = {release: source for release, source in held.items() if source is not None}
        lacking = [release for release, source in compared.items() if not _defines(source, symbol)]
        if not lacking:
            return None
        some = len(lacking) < len(compared)  # the others define it: the reset is stale on these only
        verb = "have" if some and len(lacking) > 1 else "has"
        listed = (" and " if some else " or ").join(lacking)
        unchecked = [release for release in held if release not in compared]
        not_checked = (
            f"; not checked on {' and '.join(unchecked)} (the index does not hold the module there)" if unchecked else ""
        )
        return f"{distribution} {listed} ({why}) {verb} no {symbol} in {module}{not_checked}"

    def _missing_why(self, holder: SourceFile, module: str, symbol: str) -> str:
        why = f"{self._release(module, holder)} has no {symbol} in {module}"
        successor = self._successor(holder, module, symbol)
        if successor is not None and successor[1] == symbol:
            why += f"; it is now in {successor[0]}"
        elif successor is not None:
            why += f"; its likely successor is {successor[1]} in {successor[0]}"
        if successor is not None:
            why += self._right_reset(*successor)
        return why

    def _successor(self, holder: SourceFile, module: str, symbol: str) -> tuple[str, str] | None:
        """The module-level name of the same package most like `symbol`: same first and last word
        (`_MOE_..._TRACKER`); the same name in another module beats any other."""
        words = symbol.strip("_").split("_")
        top = package_folder(holder.path, module)
        if top is None or not words[0]:
            return None
        candidates = [
            (where, name)
            for where, name in self._module_names(top, module)
            if (where, name) != (module, symbol)
            and name.strip("_").split("_")[0] == words[0]
            and name.strip("_").split("_")[-1] == words[-1]
        ]
        if not candidates:
            return None
        return max(candidates, key=lambda item: (item[1] == symbol, SequenceMatcher(None, item[1], symbol).ratio(), item))

    def _module_names(self, top: Path, module: str) -> list[tuple[str, str]]:
        """(module, name) for each column-0 assignment in the package: a text scan, fast on big trees."""
        if top not in self._names:
            root = top.parent
            names: list[tuple[str, str]] = []
            for path in sorted(python_files(top)):
                try:
                    text = read_replacing(path)
                except OSError:
                    continue
                dotted = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
                names.extend((dotted, name) for name in _MODULE_LEVEL_NAME.findall(text))
            self._names[top] = names
        return self._names[top]

    def _importer(self, holder: SourceFile, module: str, symbol: str) -> str | None:
        """A module of the same package that binds `symbol` from `module` at import time."""
        top = package_folder(holder.path, module)
        if top is None:
            return None
        wanted = f"{module}.{symbol}"
        for path in sorted(python_files(top)):
            try:
                if symbol not in read_replacing(path):
                    continue
            except OSError:
                continue
            dotted = ".".join(path.relative_to(top.parent).with_suffix("").parts).removesuffix(".__init__")
            source = self.workspace.source(path, dotted)
            if source is not None and any(
                isinstance(binding, ImportedName) and self._same_target(binding.target, wanted)
                for binding in source.bindings.values()
            ):
                return dotted
        return None

    def _same_target(self, target: str, wanted: str) -> bool:
        head, _, name = target.rpartition(".")
        return target == wanted or (f"{module_named(head, self.workspace)}.{name}" == wanted if head else False)

    def _stale(self, statement: ast.stmt, symbol: str, module: str, kind: StaleKind, why: str) -> StaleReset:
        text = source_segment(self.adaptor.text, statement) or ast.unparse(statement)
        return StaleReset(self.adaptor.path, statement.lineno, " ".join(text.split()), symbol, module, kind, why)


def _distribution(module: str) -> str | None:
    """The framework distribution a module belongs to (`megatron-core` for `megatron.core.…`)."""
    return next((name for name, top in FRAMEWORK_DISTRIBUTIONS.items() if module.split(".")[0] == top), None)


def _returns_new(function: Function) -> bool:
    """Whether every `return` of the function builds a new dict, list or set (a literal or comprehension)."""
    returned = [node.value for node in ast.walk(function) if isinstance(node, ast.Return)]
    new = (ast.Dict, ast.DictComp, ast.List, ast.ListComp, ast.Set, ast.SetComp)
    return bool(returned) and all(isinstance(value, new) for value in returned)


def _defines(source: SourceFile, symbol: str) -> bool:
    return (
        symbol in source.bindings or symbol in source.declared_globals or source.star_import or "__getattr__" in source.bindings
    )


def _alias_of(target: _Target) -> str:
    return ".".join([target.root, *(name for name in target.attributes if name is not None)])
