"""Scanning framework code for holders: the globals, class attributes, singletons, caches and
buffers where a tensor can outlive a training step, with where each is written and read.

A module global or class attribute is a holder when a tensor lands in it: assigned one, or one
stored into it (`X[k] = t`, `X[k]["v"] += t`, `X.append(t)`), wherever that happens. Holders whose
tensors are all CPU tensors are left out: torch_npu checks only device memory. A buffer made on the
CPU follows its module to the device: unknown."""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Sequence
from fnmatch import fnmatchcase
from pathlib import Path

from unsafe_doctor.knowledge.rules import Rule, RuleMatch, variable_pattern
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.recovery_code.flow_scope import FlowScope, TensorPlace, functions_of
from unsafe_doctor.recovery_code.index import Index, ModuleInfo, Span, register_buffer_name
from unsafe_doctor.recovery_code.model import Holder, HolderKind, InstanceHolderKind, Placement, Site
from unsafe_doctor.recovery_code.names import Accessors
from unsafe_doctor.recovery_code.places import combine
from unsafe_doctor.recovery_code.refs import ClassKey
from unsafe_doctor.recovery_code.uses import Use, shortened, sites
from unsafe_doctor.recovery_code.vocabulary import COMMUNICATION_INTO, CONTAINER_ADD, CONTAINER_REMOVE, updates_data_in_place
from unsafe_doctor.recovery_code.walk import Walker
from unsafe_doctor.source.syntax import child_nodes, source_segment

PlacedUse = tuple[TensorPlace, Use]  # a tensor's placement, and the statement that puts it there


class ScanFindings:
    """What the scan of every audited module found, by holder."""

    def __init__(self) -> None:
        self.uses: dict[GlobalName[str, str], list[Use]] = {}
        self.classes: dict[ClassKey, list[PlacedUse]] = {}  # tensors a class's methods keep in `self`
        self.members: dict[ClassKey, list[tuple[ClassKey, Use]]] = {}  # instances of other classes it keeps there
        self.returns: dict[GlobalName[str, str], list[PlacedUse]] = {}  # tensors cached functions return
        self.buffers: dict[GlobalName[str, str], tuple[TensorPlace | None, Use]] = {}  # register_buffer calls
        self.rule_named: list[tuple[Path, Holder]] = []  # what rules name in each module (`named_by_rules`)

    def take(self, other: ScanFindings, modules: dict[Path, ModuleInfo], position: dict[Path, int]) -> None:
        """What another process's scan found, its uses pointing at this process's modules
        (`Index.adopt`). Of a buffer registered in two files, the file given first keeps it."""
        for uses in other.uses.values():
            self._adopted(uses, modules)
        for evidence in (*other.classes.values(), *other.returns.values()):
            self._adopted([use for _, use in evidence], modules)
        self._adopted([use for _, use in other.buffers.values()], modules)
        self._adopted([use for members in other.members.values() for _, use in members], modules)
        for key, uses in other.uses.items():
            self.uses.setdefault(key, []).extend(uses)
        for owner, evidence in other.classes.items():
            self.classes.setdefault(owner, []).extend(evidence)
        for key, evidence in other.returns.items():
            self.returns.setdefault(key, []).extend(evidence)
        for owner, members in other.members.items():
            self.members.setdefault(owner, []).extend(members)
        for key, buffer in other.buffers.items():
            kept = self.buffers.setdefault(key, buffer)
            if position[buffer[1].module.path] < position[kept[1].module.path]:
                self.buffers[key] = buffer
        self.rule_named += other.rule_named

    @staticmethod
    def _adopted(uses: list[Use], modules: dict[Path, ModuleInfo]) -> None:
        for use in uses:
            use.module = modules.get(use.module.path, use.module)

    def in_order(self, position: dict[Path, int]) -> None:
        """Each holder's uses and evidence in the order of the files given (`position`), whatever the
        order the files were scanned in; a file's own in the order of its statements."""
        for uses in self.uses.values():
            uses.sort(key=lambda use: position[use.module.path])
        for evidence in (*self.classes.values(), *self.returns.values()):
            evidence.sort(key=lambda item: position[item[1].module.path])
        for members in self.members.values():
            members.sort(key=lambda item: position[item[1].module.path])
        self.rule_named.sort(key=lambda item: position[item[0]])


class FrameworkScanner(Walker):
    """Reads one scope of framework code: every use of a holder, and the tensors that classes keep,
    cached functions return and buffers are registered with."""

    def __init__(self, index: Index, accessors: Accessors, scope: FlowScope, found: ScanFindings):
        super().__init__(index, accessors, scope)
        self.found = found

    def record(self, key: GlobalName[str, str], use: Use) -> None:
        self.found.uses.setdefault(key, []).append(use)

    def stored_in_self(self, value: ast.expr | None) -> None:
        if self.scope.owner is None:
            return
        owner = ClassKey(self.scope.module.name, self.scope.owner)
        place = self.places.of(value)
        if place is not None:
            self.found.classes.setdefault(owner, []).append((place, self.make("read")))
            return
        member = self.instance_class(value)
        if member is not None and member != owner:
            self.found.members.setdefault(owner, []).append((member, self.make("read")))

    def returning(self, value: ast.expr) -> None:
        """What a cached function returns: a tensor by its construction, or by the function's
        `-> Tensor` annotation (placement unknown)."""
        function = self.scope.function
        if function is None or not self.scope.module.is_cached(self.scope.owner, function.name):
            return
        place = self.places.of(value)
        if place is None and _annotated_tensor(function.returns):
            place = "unknown"
        if place is not None:
            key = GlobalName(self.scope.module.name, self.scope.owner, function.name)
            self.found.returns.setdefault(key, []).append((place, self.make("read")))

    def registering_buffer(self, call: ast.Call) -> None:
        name = register_buffer_name(call)
        value = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "tensor"), None)
        if name is None or self.scope.owner is None:
            return
        key = GlobalName(self.scope.module.name, self.scope.owner, name)
        self.found.buffers.setdefault(key, (self.places.of(value) if value is not None else None, self.make("store")))


def _annotated_tensor(annotation: ast.expr | None) -> bool:
    """`-> Tensor`, `-> torch.Tensor`, `-> "torch.Tensor"`."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value.rpartition(".")[2] == "Tensor"
    name = annotation.attr if isinstance(annotation, ast.Attribute) else getattr(annotation, "id", None)
    return name == "Tensor"


def scan_module(index: Index, accessors: Accessors, info: ModuleInfo, found: ScanFindings, rules: Sequence[Rule]) -> None:
    """Every scope of an audited module: its body, class bodies, functions and methods, nested ones;
    and what the rules name in it, read from the same tree."""
    with info.kept():
        found.rule_named += [(info.path, holder) for holder in _named_by_rules_in(info, rules)]
        FrameworkScanner(index, accessors, FlowScope.of_module(info), found).run(info.source.tree.body)
        for node, owner, qualname in functions_of(info.source.tree.body):
            scope = FlowScope.of_function(info, node, owner, qualname)
            try:
                FrameworkScanner(index, accessors, scope, found).run(node.body)
            except RecursionError:  # a generated expression thousands of terms deep
                continue


# --- findings -> holders ---------------------------------------------------------------------------------


def holders(found: ScanFindings, index: Index) -> list[Holder]:
    """The holders of the audited modules, by module, class and name."""
    result = []
    scanned: dict[str, ModuleInfo] = {}
    for info in index.scanned:
        scanned.setdefault(info.name, info)  # of two files named alike, the first (as the index keeps it)
    for key in sorted({*found.uses, *found.returns, *found.buffers}, key=lambda k: (k.module, k.owner or "", k.variable)):
        if key.module in scanned:
            holder = _holder(found, scanned[key.module], key, found.uses.get(key, []))
            if holder is not None:
                result.append(holder)
    return result


def _holder(found: ScanFindings, info: ModuleInfo, key: GlobalName[str, str], uses: list[Use]) -> Holder | None:
    if key.owner is None and key.variable in info.imported:
        return None  # a module bound by an import (`te = MagicMock()` only stands in for it when absent)
    definition: Use | None = None
    if key in found.buffers:
        place, registered = found.buffers[key]
        if registered.in_init and not any(not use.in_init and _updates_in_place(use) for use in uses):
            return None  # no method but __init__ changes it: it carries nothing across steps
        # registered outside __init__: a cache rebuilt at run time (`_set_cos_sin_cache` of a longer sequence)
        kind: HolderKind = "buffer"
        evidence: list[PlacedUse] = [("device" if place == "device" else "unknown", registered)]  # a module moves its buffers
        definition = registered
    elif info.is_cached(key.owner, key.variable):
        kind = "lru-cache"
        evidence = found.returns.get(key, [])
    else:
        evidence, keeps = _stored_tensors(found, uses)
        kind = keeps or ("class-attribute" if key.owner else "module-global")
    placement = combine([place for place, _ in evidence])
    if placement not in ("device", "unknown"):
        return None
    writers = [use for use in uses if _writes(use)]
    return Holder(
        kind=kind,
        name=key,
        placement=_placement(placement),
        definition=definition.site() if definition is not None else _definition(info, key, uses, evidence),
        evidence=sites([use for place, use in evidence if place != "cpu"]),
        writers=sites(writers),
        readers=sites([use for use in uses if not _writes(use) and use.kind != "import"]),
        importers=sites([use for use in uses if use.kind == "import" and use.module_level and use.module.name != key.module]),
    )


def _placement(place: TensorPlace | None) -> Placement:
    return "device" if place == "device" else "unknown"


def _stored_tensors(found: ScanFindings, uses: list[Use]) -> tuple[list[PlacedUse], InstanceHolderKind | None]:
    """The tensors stored into a global or class attribute, and whether it keeps instances of a class
    whose methods keep tensors in `self`: rebound to one (a singleton), or holding them as items (a
    registry: `X.append(self)`, `X[k] = C(...)`); the generic fixes reach neither's tensors."""
    evidence: list[PlacedUse] = []
    keeps: InstanceHolderKind | None = None
    for use in uses:
        if use.kind in ("rebind", "store", "augment", "method") and use.place is not None:
            evidence.append((use.place, use))
        if use.kind in ("rebind", "store", "method") and use.instance_of is not None:
            held = _kept_in_instances(found, use.instance_of)
            place = combine([place for place, _ in held])
            if place is not None:
                evidence.append((place, use))
                evidence.append(next(item for item in held if item[0] == place))  # where the class keeps it
                if use.kind == "rebind" and not use.element:
                    keeps = "singleton"
                elif keeps is None:
                    keeps = "registry"
    return evidence, keeps


def _kept_in_instances(found: ScanFindings, cls: ClassKey) -> list[PlacedUse]:
    """The tensors a class's instances keep: in `self`, or in instances of other classes they keep
    there (a recipe's `self.scale = ScaleData(...)`, whose methods keep the amax history)."""
    kept: list[PlacedUse] = []
    pending, seen = [cls], {cls}
    while pending:
        current = pending.pop(0)
        kept += found.classes.get(current, [])
        for member, _ in found.members.get(current, []):
            if member not in seen:
                seen.add(member)
                pending.append(member)
    return kept


def _definition(info: ModuleInfo, key: GlobalName[str, str], uses: list[Use], evidence: list[PlacedUse]) -> Site:
    """Where the holder is defined: its module-level or class-body binding, its function, else its
    first write."""
    node: object = None
    if key.owner is None:
        node = info.spans.get(key.variable)
    elif key.owner in info.outlines:  # a class of the module
        outline = info.outlines[key.owner]
        method = outline.methods.get(key.variable)
        node = outline.attributes.get(key.variable) or (method[0] if method else None)
    if isinstance(node, (ast.stmt, ast.expr, Span)):
        code = (source_segment(info.text, node) or "").strip().splitlines()
        return Site(info.shown, node.lineno, key.owner, shortened(code[0]) if code else "")
    first = next((use for use in uses if _writes(use)), None) or (evidence[0][1] if evidence else uses[0])
    return first.site()


def _updates_in_place(use: Use) -> bool:
    if use.kind in ("augment", "store"):  # `buf += ...`, `buf.data = ...`, `buf[k] = ...`
        return True
    return use.kind == "method" and use.method is not None and updates_data_in_place(use.method)


def _writes(use: Use) -> bool:
    if use.kind in ("rebind", "store", "augment", "delete"):
        return True
    if use.kind == "method" and use.method is not None:
        return use.method.endswith("_") or use.method in CONTAINER_ADD or use.method in CONTAINER_REMOVE
    if use.kind == "argument":
        return use.callee is not None and use.callee.rpartition(".")[2] in COMMUNICATION_INTO
    return False


def conversion_only(holder: Holder, rules: Sequence[Rule]) -> bool:
    """A global of a checkpoint converter (`convert.py`, `convert_*.py`) that only its own module
    writes and reads, none imports and no rule names: conversion runs at load or offline, never in
    a training step, so recovery never meets what it keeps (MindSpeed-LLM's `convert_hf2mg`, which
    `training/checkpointing.py` calls when it loads Hugging Face weights)."""
    name = holder.name.module.rpartition(".")[2]
    if name != "convert" and not name.startswith("convert_"):
        return False
    named = (match for rule in rules for match in rule.matches if match.variable or match.variable_regex)  # not a frame's
    if any(match.names(holder.name) for match in named):
        return False
    home = holder.definition.file
    return not holder.importers and all(site.file == home for site in (*holder.evidence, *holder.writers, *holder.readers))


def named_by_rules(found: ScanFindings, holders: Sequence[Holder]) -> list[Holder]:
    """Globals of the audited modules that a rule names (by name or pattern, in a module or a module
    glob; module globals, and attributes of a class, its own or set on `self`) and the scan did not
    find: the knowledge base knows they hold device tensors, even where the code that fills them
    says nothing a scan can read (`CACHED_SEQ = opt_seq`, `self.inv_freq = ...` in a non-singleton)."""
    known = {holder.name for holder in holders}
    added: list[Holder] = []
    for _, holder in found.rule_named:
        if holder.name not in known:
            known.add(holder.name)
            added.append(holder)
    return added


def _named_by_rules_in(info: ModuleInfo, rules: Sequence[Rule]) -> list[Holder]:
    """What the rules name in one module, in the order of the rules and their blocks."""
    blocks = [
        block
        for rule in rules
        for block in rule.matches
        if block.module is not None and fnmatchcase(info.name, block.module) and _may_name(block, info.text)
    ]
    # by the block's class
    named: dict[str | None, list[tuple[GlobalName[str, str], ast.stmt | ast.expr | Span, HolderKind]]] = {}
    found: dict[GlobalName[str, str], Holder] = {}
    for block in blocks:
        if block.owner not in named:
            named[block.owner] = _named_in(info, block.owner)
        for key, node, kind in named[block.owner]:
            if key in found or not block.names(GlobalName(info.name, key.owner, key.variable)):
                continue
            code = (source_segment(info.text, node) or "").strip().splitlines()
            site = Site(info.shown, node.lineno, key.owner, shortened(code[0]) if code else key.variable)
            found[key] = Holder(kind, key, "unknown", site, (), (), (), ())
    return list(found.values())


def _may_name(block: RuleMatch, text: str) -> bool:
    """Whether the file spells a name the block could name: a global, attribute or buffer name is a
    word of its file, and a file that spells none is not read again for the block. (A pattern with an
    anchor or an escape is not tried on the text.)"""
    if block.variable is not None:
        return block.variable in text
    pattern = block.variable_regex
    if pattern is None or any(char in pattern for char in "^$\\"):
        return True
    # Unbounded first: a search that starts with `\b` tries every position, five times slower.
    return variable_pattern(pattern).search(text) is not None and variable_pattern(rf"\b(?:{pattern})\b").search(text) is not None


def _named_in(info: ModuleInfo, owner: str | None) -> list[tuple[GlobalName[str, str], ast.stmt | ast.expr | Span, HolderKind]]:
    """What a rule block could name in a module: its assigned globals (when the block names no
    class), and the attributes of its classes (of `owner` only, when the block names one)."""
    named: list[tuple[GlobalName[str, str], ast.stmt | ast.expr | Span, HolderKind]] = []
    if owner is None:
        for variable in sorted(info.names):
            span = info.spans.get(variable)  # None: an import, or only a function's `global` binds it
            if span is not None:
                named.append((GlobalName(info.name, None, variable), span, "module-global"))
    classes = [name for name in info.outlines if owner in (None, name)]  # the tree is read only for them
    for cls in (info.classes[name] for name in classes):
        attributes: dict[str, ast.stmt | ast.expr | Span] = dict(cls.attributes)
        for method in cls.methods.values():
            for assignment in _assignments(method):
                for target in assignment.targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                        attributes.setdefault(target.attr, assignment)
        attributes.update(cls.buffers)
        for variable, node in sorted(attributes.items()):
            kind: HolderKind = "buffer" if variable in cls.buffers else "class-attribute"
            named.append((GlobalName(info.name, cls.name, variable), node, kind))
    return named


def _assignments(function: ast.AST) -> list[ast.Assign]:
    """The assignments in a function, nested ones too, in `ast.walk`'s order (breadth first); only
    statements, handlers and cases are entered: no expression holds an assignment."""
    found: list[ast.Assign] = []
    pending = deque([function])
    while pending:
        node = pending.popleft()
        if isinstance(node, ast.Assign):
            found.append(node)
        pending.extend(child for child in child_nodes(node) if isinstance(child, _HOLD_STATEMENTS))
    return found


_HOLD_STATEMENTS = (ast.stmt, ast.excepthandler, ast.match_case)  # the nodes statements are found in
