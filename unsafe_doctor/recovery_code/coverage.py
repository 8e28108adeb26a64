"""Coverage: what the adaptor's rollback, send and receive functions do to each holder, with the
helpers they call, judged by DESIGN.md's rules for code that runs on unsafe memory (rollback and
receive run on the faulty rank).

* safe, so the holder is *covered*: rebinding it (`= {}`, `= None`: *reset*; a new object or a
  fresh tensor: *rebuilt*), `.clear()`, `.cache_clear()`, storing fresh values into it, `copy_`
  from a fresh tensor (*repaired* in the receive function, when the send function sends it);
* unsafe: an in-place op other than `copy_` (`zero_()`, `fill_()`, `+=`), `copy_` from itself,
  a torch op or arithmetic on it (`zeros_like(t)`), `recv` straight into it (communication does not
  make memory safe), rebinding a holder another module imported by name (that module keeps the old
  object), a receive without the matching send or the reverse;
* anything else (metadata such as `.shape`, `isinstance`, iteration over a dict) is neither.

Buffers live in objects the adaptor reaches by walking modules, so `<anything>.expert_bias` counts
as the buffer when the function also names its class (`isinstance(m, TopKRouter)`)."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

from unsafe_doctor.knowledge.rules import AdaptorProfile
from unsafe_doctor.knowledge.versions import profile_files
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.recovery_code.flow_scope import FlowScope
from unsafe_doctor.recovery_code.index import Index, ModuleInfo
from unsafe_doctor.recovery_code.model import Coverage, Holder, HolderKind, How, Role, Site
from unsafe_doctor.recovery_code.names import Accessors
from unsafe_doctor.recovery_code.refs import FunctionRef
from unsafe_doctor.recovery_code.uses import Use, sites
from unsafe_doctor.recovery_code.vocabulary import COMMUNICATION_FROM, COMMUNICATION_INTO, RESETS
from unsafe_doctor.recovery_code.walk import Walker
from unsafe_doctor.source.files import ImportRoots
from unsafe_doctor.source.syntax import Function
from unsafe_doctor.source.workspace import Workspace

MAX_CALL_DEPTH = 4  # helper calls followed from an adaptor function
_HOW_ORDER = {"reset": 0, "rebuilt": 1, "repaired": 2}

Effect = tuple[How, None] | tuple[None, str]  # (how it covers, None), or (None, why it is unsafe)


class RecoveryReader(Walker):
    """Reads a recovery function, and the helpers it calls (up to MAX_CALL_DEPTH calls deep) as part
    of it: every use of a holder, and whether what it stores is computed from a holder's data."""

    def __init__(
        self,
        index: Index,
        accessors: Accessors,
        scope: FlowScope,
        uses: dict[GlobalName[str, str], list[Use]],
        *,
        via: tuple[str, ...] = (),
        seen: frozenset[tuple[Path, int, int]] = frozenset(),
    ):
        super().__init__(index, accessors, scope, via)
        self.uses = uses
        # the functions on the way here, by place: a module's tree read again has other nodes
        self.seen = seen | ({_place(scope.module, scope.function)} if scope.function is not None else set())

    def record(self, key: GlobalName[str, str], use: Use) -> None:
        self.uses.setdefault(key, []).append(use)

    def assigned_local(self, name: str, value: ast.expr) -> None:
        if self.names.reads_holder(value):
            self.scope.derived.add(name)

    def stored_from_holder(self, value: ast.expr) -> bool:
        return self.names.reads_holder(value)

    def calling(self, callee: FunctionRef) -> None:
        """Walk a helper the adaptor calls, as part of the calling function."""
        node = callee.node
        if len(self.via) >= MAX_CALL_DEPTH:
            return
        here = self.scope.module
        module = self.index.module(callee.module) if callee.module != here.name else here
        if module is None or _place(module, node) in self.seen:
            return
        nested = callee.module == here.name and node.name in self.scope.nested
        qualname = node.name if nested else f"{module.name.rpartition('.')[2]}.{node.name}"
        scope = FlowScope.of_function(module, node, callee.owner, node.name)
        via = self.via if nested else (*self.via, qualname)  # a nested helper (a fix block's) is part of its function
        try:
            RecoveryReader(self.index, self.accessors, scope, self.uses, via=via, seen=self.seen).run(node.body)
        except RecursionError:
            pass


def _place(module: ModuleInfo, function: Function) -> tuple[Path, int, int]:
    return module.path, function.lineno, function.col_offset


class CoverageJudge:
    """The uses the adaptor's rollback, send and receive functions make of each holder, and the
    verdict they add up to."""

    def __init__(self, index: Index, accessors: Accessors, adaptor: Path, profile: AdaptorProfile, notes: list[str]):
        self.profile = profile
        files = profile_files(profile, adaptor) or [adaptor.resolve()]
        if adaptor.resolve() not in files:
            files.insert(0, adaptor.resolve())
        self.files = files
        self.shown = {index.display(path) for path in files}  # the adaptor's files, as sites name them
        self.functions: dict[Role, str] = {}
        self.uses: dict[Role, dict[GlobalName[str, str], list[Use]]] = {}
        roles: tuple[tuple[Role, str], ...] = (("rollback", profile.rollback), ("send", profile.send), ("recv", profile.recv))
        for role, name in roles:
            found = [(info, info.functions[name]) for info in map(index.module_of_file, files) if info and name in info.functions]
            if not found:
                notes.append(f"{name}() ({role}) not found in {', '.join(index.display(f) for f in files)}")
                continue
            info, node = found[0]
            uses: dict[GlobalName[str, str], list[Use]] = {}
            RecoveryReader(index, accessors, FlowScope.of_function(info, node, None), uses).run(node.body)
            self.functions[role] = name
            self.uses[role] = uses

    def judge(self, holder: Holder) -> Coverage:
        safe: dict[Role, list[tuple[How, Use]]] = {"rollback": [], "recv": [], "send": []}
        sent = [use for use in self.uses.get("send", {}).get(holder.name, []) if _sends(use)]
        for role in self.functions:
            if role == "send":
                continue
            for use in self.uses[role].get(holder.name, []):
                verdict = _effect(use, holder, role)
                if verdict is None:
                    continue
                how, problem = verdict
                if problem is not None:
                    return Coverage("unsafe", None, self.functions[role], use.via, (use.site(),), problem)
                if how is not None:
                    safe[role].append((how, use))
        if safe["rollback"]:
            return self._covered(safe["rollback"], self.functions["rollback"])
        if safe["recv"]:
            return self._received(safe["recv"], sent)
        if sent:
            receiver = self.functions.get("recv", self.profile.recv)
            return Coverage(
                "unsafe",
                None,
                self.functions["send"],
                sent[0].via,
                (sent[0].site(),),
                f"sent by {self.functions['send']}() but never received in {receiver}(): the send has no partner and "
                "the faulty rank keeps its unsafe copy",
            )
        touched = ", ".join(f"{name}()" for name in self.functions.values()) or "the adaptor"
        return Coverage("uncovered", None, None, (), (), f"not reset, rebuilt or repaired by {touched}")

    def _received(self, received: list[tuple[How, Use]], sent: list[Use]) -> Coverage:
        if sent:
            return self._covered(received, self.functions["recv"], sent, self.functions["send"])
        sender = self.functions.get("send", self.profile.send)
        first = received[0][1]
        return Coverage(
            "unsafe",
            None,
            self.functions["recv"],
            first.via,
            (first.site(),),
            f"received in {self.functions['recv']}() but never sent by {sender}(): the receive would wait forever",
        )

    @staticmethod
    def _covered(effects: list[tuple[How, Use]], function: str, sent: Sequence[Use] = (), sender: str = "") -> Coverage:
        how = max((how for how, _ in effects), key=_HOW_ORDER.__getitem__)
        uses = [use for _, use in effects]
        via = tuple(dict.fromkeys(helper for use in uses for helper in use.via))
        through = f" via {' and '.join(f'{name}()' for name in via)}" if via else ""
        why = f"{how} in {function}(){through}"
        if sent:
            why += f", sent by the replica in {sender}()"
        return Coverage("covered", how, function, via, sites([*uses, *sent]), why)


def _sends(use: Use) -> bool:
    return use.kind == "argument" and (use.callee or "").rpartition(".")[2] in COMMUNICATION_FROM


def _effect(use: Use, holder: Holder, role: Role) -> Effect | None:
    """(how it covers, None) for a safe reset or rebuild; (None, why) for an unsafe one; None when the
    use neither covers nor harms (metadata, a dict iterated, an isinstance check)."""
    where = f"{use.function}()" if use.function else "the adaptor"
    fresh: How = "repaired" if role == "recv" else "rebuilt"
    name = holder.name.variable
    if use.kind == "rebind" and not use.element:
        return _rebound(use, holder, where, fresh)
    if use.kind in ("rebind", "store"):
        if use.value_reads_holder:
            return None, f"{where} stores a value computed from {name}'s unsafe data"
        return fresh, None
    if use.kind == "augment":
        return None, f"{where} updates {name} in place (`+=` reads the unsafe tensor)"
    if use.kind == "method":
        return _method_effect(use, name, where, fresh)
    if use.kind == "argument":
        return _passed(use, name, where)
    if use.kind == "read" and use.reads_data:
        return None, f"{where} computes with {name}, reading the unsafe tensor"
    return None


def _rebound(use: Use, holder: Holder, where: str, fresh: How) -> Effect:
    name = holder.name.variable
    if use.value_reads_holder:
        return None, f"{where} rebuilds {name} from its own unsafe data"
    if holder.importers:
        first = holder.importers[0]
        return None, (
            f"{where} rebinds {name}, but {first.file}:{first.line} imported it by name: that module keeps the "
            f"old object; empty or refresh it in place instead (.clear(), copy_)"
        )
    return ("reset" if use.empty else fresh), None


def _method_effect(use: Use, name: str, where: str, fresh: How) -> Effect | None:
    if use.method in RESETS:
        return "reset", None
    if use.method == "copy_":
        if use.value_reads_holder:
            return None, f"{where} copies {name} from its own unsafe data"
        return fresh, None
    if use.reads_data:
        return None, (
            f"{where} calls {use.method}() on {name}, which reads the unsafe tensor; "
            "rebuild it from its metadata or copy_ fresh values in"
        )
    return None


def _passed(use: Use, name: str, where: str) -> Effect | None:
    if (use.callee or "").rpartition(".")[2] in COMMUNICATION_INTO:
        return None, (
            f"{where} receives into {name} with {use.callee}(): communication does not make unsafe memory safe; "
            "receive into a fresh tensor and copy_ it in"
        )
    if use.reads_data:
        return None, f"{where} passes {name} to {use.callee}(), which reads the unsafe tensor"
    return None


class AdaptorCoverage:
    """How the adaptor's recovery functions handle a global, judged as `audit` judges it; for `fix`,
    which must not write a second reset of a global the adaptor already resets. The adaptor is
    read once. `workspace`: the diagnosis's, so that framework names resolve in the log's release."""

    def __init__(self, adaptor: Path, profile: AdaptorProfile, workspace: Workspace):
        import_roots = ImportRoots()
        files = profile_files(profile, adaptor) or [adaptor.resolve()]
        roots = list(dict.fromkeys(import_roots.of(path) for path in [adaptor.resolve(), *files]))
        index = Index([adaptor], roots, workspace.over(roots))
        self.adaptor = adaptor
        self.judge = CoverageJudge(index, Accessors(index), adaptor, profile, [])

    def of(self, key: GlobalName[str, str]) -> Coverage:
        kind: HolderKind = "module-global" if key.owner is None else "class-attribute"
        definition = Site(str(self.adaptor), 1, None, key.variable)  # not shown: coverage names the adaptor's sites
        return self.judge.judge(Holder(kind, key, "device", definition, (), (), (), ()))
