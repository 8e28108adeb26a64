"""Derive knowledge_base/writers.json: under which run settings the training step writes each rule's global.

    python scripts/derive_writers.py --cache WHEELS --mindspeed MINDSPEED_GIT_DIR --mindspeed-llm MINDSPEED_LLM_GIT_DIR

For each shipped rule with a `first_read` whose global has a name (a module's global, or an
attribute of a named class) and a framework, and for each real release of that framework the
rule's `versions` admit (megatron-core wheels, as `scripts/build_index.py` fetches them), the
script finds with `ast` the functions that store a value into the global (an assignment, an
augmented assignment, a store into an item or attribute of it, a mutating call on it, a
`register_buffer` of its name; a store of None or an empty container holds no tensor and does not
count), through its getters and local aliases. It walks their callers back by name, through the
patches MindSpeed registers (`register_patch("a.B.routing", f)` makes `f` a `routing`), up to
MAX_DEPTH calls, until the step (a `forward`, `backward` or `step`). Callers that start outside the
step (`__init__`, the training loop's logging, a megatron-core function nothing in the release
calls) do not count. Each path records the conjunction of the `if` tests around every call and
write that test run settings (`self.config.X`, `config.X`, `args.X`, `get_args().X`, an attribute
`__init__` copies from one of those, a local copied once), and of the early returns before them.
Tests of anything else are dropped where that only widens the path (`guard_of`); a test of a
setting the script cannot express is `unknown`. MindSpeed and MindSpeed-LLM tags are read the same
way (MindSpeed's MindSpore backend aside), with the megatron-core functions on the paths as further
writers (their patches call them), and a patch nothing in its release calls reached where
megatron-core calls the function it replaces. A release with more than MAX_PATHS paths is recorded
as always written. Each release is recorded with its source (wheel or commit), each test and each
step of a path with its file and line.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from build_index import git_releases, megatron_releases  # scripts/ is the script's own folder on sys.path
from packaging.version import Version

from unsafe_doctor.knowledge.loading import load_knowledge, shipped_knowledge_dir
from unsafe_doctor.knowledge.rules import Rule
from unsafe_doctor.knowledge.writers import (
    FORMAT,
    WRITERS_FILE,
    AllOf,
    AnyOf,
    Constant,
    Guard,
    Leaf,
    Test,
    Unknown,
    WritePath,
    negated,
    paths_json,
)
from unsafe_doctor.recovery_code.index import register_buffer_name
from unsafe_doctor.recovery_code.vocabulary import CONTAINER_ADD
from unsafe_doctor.source.syntax import Function, callee_name, is_empty_value, one_line

Seed = tuple["Def", tuple[Guard, ...], tuple[str, ...]]  # a function, the guards from its entry to a write, where
MAX_DEPTH = 5
MINDSPORE = "mindspeed/mindspore/"  # MindSpeed's patches for the MindSpore backend: a torch_npu job does not run them
MAX_PATHS = 400  # more paths than this in one release: the rule is recorded as always written there
STEP = frozenset({"forward", "backward", "step", "forward_step", "backward_step", "train_step"})
OUTSIDE = frozenset(
    {
        "__init__",
        "training_log",
        "train",
        "pretrain",
        "evaluate",
        "evaluate_and_print_results",
        "save_checkpoint",
        "load_checkpoint",
        "setup_model_and_optimizer",
    }
)
MUTATORS = CONTAINER_ADD | {"update", "__setitem__"}  # calls that put a value in (update may, too)
ALWAYS = WritePath((), ("too many paths to read: always written",))


@dataclass(frozen=True)
class Target:
    """The global a rule names: a module's variable, or an attribute of `owner`."""

    variable: str
    owner: str | None
    module: str | None  # a glob over the module that holds the global (a module's variable)


@dataclass
class Def:
    """A top-level function or a method, with what reading its tests needs."""

    path: str
    node: Function
    owner: str | None
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.node.name


class Program:
    """One release's files, parsed once: its functions, who calls whom by name, and patch aliases."""

    def __init__(self, files: dict[str, bytes], *, foreign: bool, inherited: dict[str, dict[str, str]] | None = None) -> None:
        self.foreign = foreign  # a framework patched into another's: a function no file calls may be a patch
        self.inherited = inherited or {}  # the patched framework's classes' copied settings (`settings`)
        self.patched: set[str] = set()
        self.patch_owner: dict[str, str] = {}  # function name -> the class a patch installs it in
        self.defs: list[Def] = []
        self.calls: dict[str, list[tuple[Def, ast.Call]]] = {}
        self.referenced: set[str] = set()
        self.aliases: dict[str, set[str]] = {}  # function name -> the names patches install it as
        self.settings: dict[str, dict[str, str]] = {}  # class -> attribute -> the setting __init__ copies
        for path, content in sorted(files.items()):
            if path.startswith(MINDSPORE):
                continue
            try:
                tree = ast.parse(content.decode("utf-8", "replace"))
            except SyntaxError:
                continue
            for statement in tree.body:
                if isinstance(statement, Function):
                    self._add(Def(path, statement, None))
                elif isinstance(statement, ast.ClassDef):
                    for member in statement.body:
                        if isinstance(member, Function):
                            self._add(Def(path, member, statement.name))
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    self._patch(node)

    def _add(self, found: Def) -> None:
        self.defs.append(found)
        for node in ast.walk(found.node):
            for child in ast.iter_child_nodes(node):
                found.parents[child] = node
        callees = set()
        for node in ast.walk(found.node):
            if isinstance(node, ast.Call) and (name := callee_name(node.func)):
                self.calls.setdefault(name, []).append((found, node))
                callees.add(id(node.func))
        for node in ast.walk(found.node):
            if isinstance(node, ast.Attribute | ast.Name) and isinstance(node.ctx, ast.Load) and id(node) not in callees:
                self.referenced.add(node.attr if isinstance(node, ast.Attribute) else node.id)
        if found.name == "__init__" and found.owner is not None:
            copied = self.settings.setdefault(found.owner, {})
            for node in ast.walk(found.node):
                if (
                    isinstance(node, ast.Assign)
                    and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Attribute)
                    and _is_self(node.targets[0].value)
                    and (setting := _setting(node.value, found, Copies({})))
                ):
                    copied[node.targets[0].attr] = setting

    def _patch(self, call: ast.Call) -> None:
        """`register_patch("pkg.Class.name", function)`: the function runs as `name`."""
        dotted = next(
            (
                arg.value
                for arg in call.args
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and "." in arg.value and " " not in arg.value
            ),
            None,
        )
        for arg in call.args:
            if dotted and isinstance(arg, ast.Name | ast.Attribute) and (name := callee_name(arg)):
                self.aliases.setdefault(name, set()).add(dotted.rsplit(".", 1)[1])
                self.patched.add(name)
                owner = dotted.split(".")[-2]
                if owner[:1].isupper():
                    self.patch_owner[name] = owner

    def names(self, found: Def) -> set[str]:
        return {found.name, *self.aliases.get(found.name, ())}


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


@dataclass
class Copies:
    """What stands for a run setting in one function: `settings` (a name -> the setting it holds) and
    `guards` (a local assigned once from a test on settings -> that test)."""

    settings: dict[str, str]
    guards: dict[str, tuple[Guard | None, Guard | None]] = field(default_factory=dict)  # when true, when false


def _setting(node: ast.expr, where: Def, copied: Copies) -> str | None:
    """The run setting an expression reads: `self.config.X`, `config.X`, `args.X` (args = get_args()),
    `get_args().X`, `getattr(<one of those objects>, "X", ...)`, an attribute `__init__` copies from
    one, or a local copied from one."""
    if isinstance(node, ast.Call) and callee_name(node.func) == "getattr" and len(node.args) >= 2:
        name = node.args[1]
        if _settings_object(node.args[0], where) and isinstance(name, ast.Constant) and isinstance(name.value, str):
            return name.value
        return None
    if isinstance(node, ast.Name):
        return copied.settings.get(node.id)
    if not isinstance(node, ast.Attribute):
        return None
    if _settings_object(node.value, where):
        return node.attr
    if _is_self(node.value):
        return copied.settings.get(f"self.{node.attr}")
    return None


def _settings_object(node: ast.expr, where: Def) -> bool:
    if isinstance(node, ast.Call):
        return callee_name(node.func) == "get_args"
    if isinstance(node, ast.Attribute):
        return node.attr == "config" and _is_self(node.value)
    return isinstance(node, ast.Name) and (node.id == "config" or node.id == "args" and _args_from_get_args(where))


def _args_from_get_args(where: Def) -> bool:
    return any(
        isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and callee_name(node.value.func) == "get_args"
        and any(isinstance(target, ast.Name) and target.id == "args" for target in node.targets)
        for node in ast.walk(where.node)
    )


def _copies(where: Def, program: Program) -> Copies:
    """Names in the function that stand for a setting or a test: `self.A` copied in `__init__`, locals assigned once from one."""
    owner = where.owner or program.patch_owner.get(where.name, "")
    copied = Copies(
        {
            f"self.{attribute}": setting
            for attribute, setting in program.settings.get(owner, program.inherited.get(owner, {})).items()
        }
    )
    assigned: dict[str, list[ast.expr]] = {}
    for node in ast.walk(where.node):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.For) and isinstance(node.target, ast.Name):
            assigned.setdefault(node.target.id, []).extend([node.target, node.target])
    for name, values in assigned.items():
        if len(values) != 1:
            continue
        if setting := _setting(values[0], where, copied):
            copied.settings[name] = setting
        elif (guards := (guard_of(values[0], where, copied), guard_of(values[0], where, copied, holds=False))) != (None, None):
            copied.guards[name] = guards
    return copied


def _constant(node: ast.expr) -> tuple[bool, Constant | tuple[Constant, ...]]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | bool | type(None)):
        return True, node.value
    if isinstance(node, ast.Tuple | ast.List | ast.Set) and all(isinstance(item, ast.Constant) for item in node.elts):
        return True, tuple(item.value for item in node.elts if isinstance(item, ast.Constant))
    return False, None


_COMPARISONS: dict[type, Test] = {ast.Eq: "==", ast.NotEq: "!=", ast.In: "in", ast.NotIn: "not in"}


def guard_of(test: ast.expr, where: Def, copied: Copies, *, holds: bool = True) -> Guard | None:
    """The guard on run settings for `test` coming out `holds` (False: an else branch, an early
    return); None when that constrains no setting. Whatever tests no setting is dropped only where
    dropping widens the guard: from an `and` that must hold (an `or` that must fail); in an `or`
    that must hold (an `and` that must fail) it leaves the whole unconstrained."""
    at = f"{where.path}:{test.lineno}"
    if isinstance(test, ast.BoolOp):
        items = [guard_of(value, where, copied, holds=holds) for value in test.values]
        if isinstance(test.op, ast.And) == holds:  # every part must come out so
            kept = tuple(item for item in items if item is not None)
            return AllOf(kept) if kept else None
        if any(item is None for item in items):
            return None  # one part on no setting may decide it whatever the settings are
        return AnyOf(tuple(item for item in items if item is not None))
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return guard_of(test.operand, where, copied, holds=not holds)
    if isinstance(test, ast.Name) and test.id in copied.guards:
        return copied.guards[test.id][0 if holds else 1]
    leaf = _leaf(test, where, copied, at)
    return negated(leaf) if leaf is not None and not holds else leaf


def _leaf(test: ast.expr, where: Def, copied: Copies, at: str) -> Leaf | Unknown | None:
    """One test of one setting (`X`, `X == c`, `X in (...)`, `X is None`), `unknown` for another test
    that reads a setting, None for a test that reads none."""
    if (setting := _setting(test, where, copied)) is not None:
        return Leaf(setting, "true", None, at)
    unknown = Unknown(one_line(ast.unparse(test)), at) if _mentions_setting(test, where, copied) else None
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return unknown
    left, right, op = test.left, test.comparators[0], test.ops[0]
    setting = _setting(left, where, copied)
    if setting is None and isinstance(op, ast.Eq | ast.NotEq) and (setting := _setting(right, where, copied)):
        left, right = right, left
    known, value = _constant(right)
    if setting is None or not known:
        return unknown
    if isinstance(op, ast.Is | ast.IsNot) and value is None:
        return Leaf(setting, "is None" if isinstance(op, ast.Is) else "is not None", None, at)
    return Leaf(setting, _COMPARISONS[type(op)], value, at) if type(op) in _COMPARISONS else unknown


def _mentions_setting(test: ast.expr, where: Def, copied: Copies) -> bool:
    return any(isinstance(node, ast.expr) and _setting(node, where, copied) for node in ast.walk(test))


def _terminates(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], ast.Return | ast.Raise)


def guards_to(node: ast.AST, where: Def, program: Program) -> tuple[Guard, ...]:
    """The guards on settings that must hold for `node` to run: the `if`s around it and the early returns before it."""
    copied = _copies(where, program)
    found: list[Guard] = []

    def add(guard: Guard | None) -> None:
        if guard is not None:
            found.append(guard)

    child: ast.AST = node
    while child is not where.node and child in where.parents:
        parent = where.parents[child]
        if isinstance(parent, ast.If | ast.IfExp):
            if child in (parent.body if isinstance(parent, ast.If) else [parent.body]):
                add(guard_of(parent.test, where, copied))
            elif child is not parent.test:
                add(guard_of(parent.test, where, copied, holds=False))
        for name in ("body", "orelse", "finalbody"):
            block = getattr(parent, name, None)
            if isinstance(block, list) and child in block:
                for before in block[: block.index(child)]:
                    if isinstance(before, ast.If) and _terminates(before.body) and not before.orelse:
                        add(guard_of(before.test, where, copied, holds=False))
        child = parent
    return tuple(reversed(found))


# --- writes -----------------------------------------------------------------------------------------


def _handle_names(program: Program, target: Target) -> set[str]:
    """Functions that return the global (its getters)."""
    getters = set()
    for found in program.defs:
        for node in ast.walk(found.node):
            if isinstance(node, ast.Return) and node.value is not None and _names_global(node.value, target, found, set()):
                getters.add(found.name)
    return getters


def _names_global(node: ast.expr, target: Target, where: Def, getters: set[str]) -> bool:
    if isinstance(node, ast.Call):
        return callee_name(node.func) in getters and not node.args
    if isinstance(node, ast.Name):  # a bare name stands for the global only in its own module
        module = where.path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        return target.owner is None and node.id == target.variable and fnmatch.fnmatchcase(module, target.module or "")
    if isinstance(node, ast.Attribute) and node.attr == target.variable:
        if target.owner is None:
            return True
        return where.owner == target.owner or isinstance(node.value, ast.Name) and node.value.id == target.owner
    return False


def writes(program: Program, target: Target, getters: set[str]) -> Iterator[tuple[Def, ast.AST]]:
    """Each statement or call that stores a value into the global, with its function."""
    names = {target.variable, *getters}
    for found in program.defs:
        if any(
            isinstance(node, ast.Name) and node.id in names or isinstance(node, ast.Attribute) and node.attr in names
            for node in ast.walk(found.node)
        ):
            stores = _Stores(target, found, getters)
            yield from ((found, node) for node in ast.walk(found.node) if stores.writes(node))


class _Stores:
    """What in one function stores into the global: the global itself (its name, `mod.X`, a getter's
    call) and the locals bound to it (`tracker = get_tracker()`), and stores into their items."""

    def __init__(self, target: Target, where: Def, getters: set[str]) -> None:
        self.target, self.where, self.getters = target, where, getters
        self.aliases = {
            name.id
            for node in ast.walk(where.node)
            if isinstance(node, ast.Assign) and _names_global(node.value, target, where, getters)
            for name in node.targets
            if isinstance(name, ast.Name)
        }

    def writes(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Assign):
            return not is_empty_value(node.value) and any(self._into(target, bare=True) for target in node.targets)
        if isinstance(node, ast.AugAssign | ast.AnnAssign):
            return node.value is not None and not is_empty_value(node.value) and self._into(node.target, bare=True)
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            return False
        if node.func.attr in MUTATORS:
            return self._into(node.func.value, bare=False)
        return (
            node.func.attr == "register_buffer"
            and register_buffer_name(node) == self.target.variable
            and self.target.owner in (None, self.where.owner)
        )

    def _into(self, expr: ast.expr, *, bare: bool) -> bool:
        """Whether a store into `expr` stores into the global (`bare`: the expression itself is the target)."""
        while True:
            if isinstance(expr, ast.Name) and expr.id in self.aliases:
                return not bare  # binding the local is no store
            if _names_global(expr, self.target, self.where, self.getters):
                return not (bare and isinstance(expr, ast.Name) and self.target.variable not in _declared(self.where))
            if not isinstance(expr, ast.Subscript | ast.Attribute):
                return False
            expr, bare = expr.value, False


def _declared(found: Def) -> set[str]:
    return {name for node in ast.walk(found.node) if isinstance(node, ast.Global) for name in node.names}


# --- paths ------------------------------------------------------------------------------------------


def paths(program: Program, seeds: list[Seed], outer: dict[str, list[WritePath]] | None = None) -> tuple[WritePath, ...] | None:
    """Every call path from the step to a seed (a function and the guards from its entry to a write),
    or None when there are more than MAX_PATHS. `outer`: for a patch no file of its release calls,
    the ways the patched framework's step reaches a call of the function it replaces (by name)."""
    found: dict[str, WritePath] = {}  # one path per conjunction of guards: the first way found to it

    def add(guards: tuple[Guard, ...], via: tuple[str, ...]) -> None:
        found.setdefault(json.dumps(paths_json([WritePath(guards, ())])), WritePath(guards, via))

    stack = [(seed, guards, via, 0) for seed, guards, via in seeds]
    seen: set[tuple[int, int, str]] = set()  # (function, depth, guards) walked already
    while stack:
        function, guards, via, depth = stack.pop()
        state = (id(function), depth, json.dumps(paths_json([WritePath(guards, ())])))
        if state in seen:
            continue
        seen.add(state)
        names = program.names(function)
        if names & STEP or depth >= MAX_DEPTH:
            add(guards, via)
        elif names & OUTSIDE:
            continue
        else:
            callers = [site for name in names for site in program.calls.get(name, ()) if site[0] is not function]
            if names & (program.referenced - program.patched) or (not callers and program.foreign):
                ways = [way for name in names for way in (outer or {}).get(name, ())] if not callers else []
                for way in ways:  # a patch: the patched framework calls it where it called the original
                    add(way.guards + guards, via + way.via)
                if not ways:
                    add(guards, via)  # called from where the release does not show
            for caller, call in callers:
                at = f"{caller.path}:{call.lineno} {caller.name}"
                if at not in via:
                    stack.append((caller, guards_to(call, caller, program) + guards, (*via, at), depth + 1))
        if len(found) > MAX_PATHS:
            return None
    return tuple(found[key] for key in sorted(found))


def inner_seeds(program: Program, target: Target, known_getters: set[str]) -> tuple[list[Seed], dict[str, list[WritePath]]]:
    """The release's own writes as seeds, and for each function on a way to one, the paths from its
    entry to the write (what another framework's call into it adds)."""
    getters = _handle_names(program, target) | known_getters
    seeds = []
    for function, node in writes(program, target, getters):
        at = f"{function.path}:{getattr(node, 'lineno', 0)} {function.name}"
        seeds.append((function, guards_to(node, function, program), (at,)))
    inner: dict[str, list[WritePath]] = {}
    stack = [(seed, guards, via, 0) for seed, guards, via in seeds]
    while stack:
        function, guards, via, depth = stack.pop()
        names = program.names(function)
        if names & (STEP | OUTSIDE) or depth >= MAX_DEPTH:
            continue
        for name in names:
            inner.setdefault(name, []).append(WritePath(guards, via))
        for caller, call in (site for name in names for site in program.calls.get(name, ()) if site[0] is not function):
            at = f"{caller.path}:{call.lineno} {caller.name}"
            if at not in via:
                stack.append((caller, guards_to(call, caller, program) + guards, (*via, at), depth + 1))
    return seeds, inner


def foreign_seeds(program: Program, inner: dict[str, list[WritePath]]) -> list[Seed]:
    """Calls in this release to another framework's functions on a way to a write."""
    seeds = []
    for name, ways in inner.items():
        for caller, call in program.calls.get(name, ()):
            here = guards_to(call, caller, program)
            for way in ways:
                seeds.append((caller, here + way.guards, (*way.via, f"{caller.path}:{call.lineno} {caller.name}")))
    return seeds


# --- rules and releases -----------------------------------------------------------------------------


def target_of(rule: Rule) -> Target | None:
    """The rule's global when it names one the derivation can follow: a variable, in a module or a class."""
    block = next((block for block in rule.matches if block.variable), None)
    if block is None or block.variable is None or rule.framework is None:
        return None
    if block.owner is None and block.module is None or block.function is not None:
        return None  # a function's local or cache: not a global a store names
    return Target(block.variable, block.owner, block.module)


def derive(rules: list[Rule], cache: Path, stacks: dict[str, Path]) -> dict[str, list[dict]]:
    targets = {rule.id: target for rule in rules if rule.first_read and (target := target_of(rule))}
    chosen = [rule for rule in rules if rule.id in targets and rule.framework == "megatron-core"]
    out: dict[str, list[dict]] = {rule.id: [] for rule in chosen}
    inner: dict[str, dict[str, list[WritePath]]] = {rule.id: {} for rule in chosen}
    getters: dict[str, set[str]] = {rule.id: set() for rule in chosen}  # megatron's, which the patches call too
    outer: dict[str, dict[str, list[WritePath]]] = {rule.id: {} for rule in chosen}  # see `paths`
    settings: dict[str, dict[str, str]] = {}  # megatron's classes' copied settings, for the patches' methods

    def wanted(version: Version) -> bool:
        return any(rule.versions is None or rule.versions.contains(version) for rule in chosen)

    for release, files in megatron_releases(cache, wanted):
        program = Program(files, foreign=False)
        for owner, copied in program.settings.items():
            settings.setdefault(owner, {}).update(copied)
        for rule in chosen:
            if rule.versions is not None and not rule.versions.contains(Version(release.name)):
                continue
            getters[rule.id] |= _handle_names(program, targets[rule.id])
            seeds, ways = inner_seeds(program, targets[rule.id], getters[rule.id])
            for name, found in ways.items():
                inner[rule.id].setdefault(name, []).extend(found)
                calls = [
                    (caller, guards_to(call, caller, program), (f"{caller.path}:{call.lineno} {caller.name}",))
                    for caller, call in program.calls.get(name, ())
                ]
                outer[rule.id].setdefault(name, []).extend(paths(program, calls) or ())
            entry(out[rule.id], "megatron-core", release.name, release.source, paths(program, seeds))
    for framework, repo in stacks.items():
        for release, files in git_releases(repo, framework):
            program = Program(files, foreign=True, inherited=settings)
            for rule in chosen:
                seeds, _ = inner_seeds(program, targets[rule.id], getters[rule.id])
                entry(
                    out[rule.id],
                    framework,
                    release.name,
                    release.source,
                    paths(program, seeds + foreign_seeds(program, inner[rule.id]), outer[rule.id]),
                )
    return out


def entry(entries: list[dict], framework: str, release: str, source: str, found: tuple[WritePath, ...] | None) -> None:
    print(f"{framework} {release}: {'too many' if found is None else len(found)} paths", file=sys.stderr)  # per rule
    entries.append(
        {"framework": framework, "release": release, "source": source, "paths": paths_json([ALWAYS] if found is None else found)}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, help="where downloaded megatron-core wheels are kept")
    parser.add_argument("--mindspeed", type=Path, help="git directory of a MindSpeed clone")
    parser.add_argument("--mindspeed-llm", type=Path, help="git directory of a MindSpeed-LLM clone")
    parser.add_argument("--out", type=Path, default=shipped_knowledge_dir() / WRITERS_FILE)
    arguments = parser.parse_args()
    cache = arguments.cache or Path(tempfile.mkdtemp(prefix="megatron-core-wheels-"))
    given = (("mindspeed", arguments.mindspeed), ("mindspeed-llm", arguments.mindspeed_llm))
    stacks = {name: path for name, path in given if path}
    rules = derive(list(load_knowledge().rules), cache, stacks)
    document = {
        "format": FORMAT,
        "generated_by": "python scripts/derive_writers.py --cache WHEELS --mindspeed MINDSPEED_GIT_DIR "
        "--mindspeed-llm MINDSPEED_LLM_GIT_DIR (see its docstring; do not edit by hand)",
        "rules": rules,
    }
    arguments.out.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {arguments.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
