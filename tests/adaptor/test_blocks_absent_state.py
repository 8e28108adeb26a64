"""Every generated block does nothing, without error, when its global is None, empty or never created.

A dense model has no MoE tracker, a rank may never build a cache, a feature that is off leaves its
global None: the block `fix` and `audit --fix` write must then leave it as it is. Each template and
each shipped rule (read from the knowledge base) is rendered through classify for a global in a
module made here (`$module` fixes; with a class attribute where the template or rule has an owner),
or in the framework module its fix names: megatron-core 0.16.1 as installed, monkeypatched, and a
bare stand-in module where MindSpeed or MindSpeed-LLM would be. The global is set to None, {}, []
or deleted, every live tensor is marked unsafe under the emulated backend, and the rendered block
runs (both sides of a scenario-2 fix). No process group exists and the repair group's stand-in
fails the test if called: no send or receive may be reached. A fix that calls a framework helper
whose module is not installed here is skipped, with its reason. Condition guards are left out:
they only narrow when the fix runs.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from unsafe_doctor.knowledge.classify import Classified, classify, classify_as, generic_template
from unsafe_doctor.knowledge.context import RunContext
from unsafe_doctor.knowledge.loading import load_knowledge
from unsafe_doctor.knowledge.render.template import FixPlan
from unsafe_doctor.knowledge.rules import DEST_RANK, SOURCE_RANK, Rule, RuleMatch, Template
from unsafe_doctor.knowledge.subject import Subject, TensorRef
from unsafe_doctor.knowledge.versions import Environment
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.log.tracebacks import Frame
from unsafe_doctor.npu.backend import EmulatedBackend, frozen_heap
from unsafe_doctor.source.workspace import Workspace

SHIPPED = load_knowledge()
# The guards read Megatron's parsed arguments; the fix under them is what is tested here.
KNOWLEDGE = dataclasses.replace(SHIPPED, rules=tuple(dataclasses.replace(rule, conditions=()) for rule in SHIPPED.rules))
PROFILE = KNOWLEDGE.profile("mindspeed-llm-26")
HOLDER = "absent_state_holder"  # the module made here for a global no framework defines
# Its source, for the kind of each global (what its module-level assignment shows): one global per kind.
KIND_GLOBALS = {"value": "STATE", "lru-cache": "STATE", "tensor": "STATE_TENSOR", "dict": "STATE_DICT", "list": "STATE_LIST"}
SOURCE_ROOT = Path(tempfile.mkdtemp(prefix="unsafe-doctor-absent-"))
(SOURCE_ROOT / f"{HOLDER}.py").write_text("import torch\nSTATE_TENSOR = torch.zeros(1)\nSTATE_DICT = {}\nSTATE_LIST = []\n")
WORKSPACE = Workspace((SOURCE_ROOT,))
CONTEXT = RunContext(KNOWLEDGE, WORKSPACE, Environment({}, {}, (), PROFILE, None))
ABSENT = object()
STATES: dict[str, Callable[[], object]] = {"none": lambda: None, "empty-dict": dict, "empty-list": list, "absent": lambda: ABSENT}
NOT_HOLDERS = {"torch", "gc"}  # what fixes import besides the framework: no global of theirs is set


@dataclass(frozen=True)
class Case:
    fixer: Rule | Template
    subject: Subject
    side: str  # "code" (scenario 1, or the receive side of scenario 2) or "peer_code" (the send side)
    state: str

    @property
    def id(self) -> str:
        owner = self.subject.tensor.name.owner if self.subject.tensor else None
        kind = "cached" if self.subject.tensor and self.subject.tensor.cached else ""
        variable = self.subject.tensor.name.variable if self.subject.tensor else None
        parts = (self.fixer.id, owner, kind, variable, self.side.replace("_code", ""), self.state)
        return "-".join(part for part in parts if part)


def concrete(glob: str | None, default: str) -> str:
    """A name a glob matches: each `*` stands for the holder's name."""
    return default if glob is None else glob.replace("*", HOLDER)


def regex_names(pattern: str) -> list[str]:
    """The names a match block's `a|b` or `prefix_(a|b)` regex stands for."""
    grouped = re.fullmatch(r"([^()]*)\(([^()]*)\)([^()]*)", pattern)
    names = [grouped[1] + part + grouped[3] for part in grouped[2].split("|")] if grouped else pattern.split("|")
    assert all(re.fullmatch(pattern, name) for name in names), pattern
    return names


def block_names(block: RuleMatch) -> list[str]:
    return [*([block.variable] if block.variable else []), *(regex_names(block.variable_regex) if block.variable_regex else [])]


def rule_subject(rule: Rule) -> Subject:
    """A global the rule's first match block matches; a module in the holder's name where it leaves it open."""
    block = rule.match
    variable = (block_names(block) or [None])[0]
    module = concrete(block.module, HOLDER)
    file = concrete(block.file, f"/src/{module.replace('.', '/')}.py")
    expression = ".".join(part for part in (block.owner, variable) if part)
    frame = Frame(file, 1, concrete(block.function, "step"), None)
    return Subject(TensorRef(expression, GlobalName(module, block.owner, variable)), frame, file)


def sides(scenario: int) -> tuple[str, ...]:
    return ("code",) if scenario == 1 else ("code", "peer_code")


def cases() -> Iterator[Case]:
    for template in KNOWLEDGE.templates:
        for kind in template.applies_to:
            typed = kind in ("tensor", "dict", "list")  # module-level assignments: never owned, never absent
            for owner in (None,) if typed else (None, "Holder"):
                file = str(SOURCE_ROOT / f"{HOLDER}.py")
                subject = Subject.of_global(GlobalName(HOLDER, owner, KIND_GLOBALS[kind]), file, 1, cached=kind == "lru-cache")
                for side in sides(template.scenario):
                    yield from (Case(template, subject, side, state) for state in STATES if not (typed and state == "absent"))
    for rule in KNOWLEDGE.rules:
        for side in sides(rule.scenario):
            yield from (Case(rule, rule_subject(rule), side, state) for state in STATES)


CASES = list(cases())


def rendered(case: Case) -> FixPlan:
    if isinstance(case.fixer, Template):
        assert generic_template(KNOWLEDGE, case.fixer.scenario, case.subject, WORKSPACE) == case.fixer
        classification = classify_as(case.subject, case.fixer.scenario, CONTEXT, ())
    else:
        classification = classify(case.subject, CONTEXT, case.fixer.match.loss_scaling)
        assert isinstance(classification, Classified) and classification.rule == case.fixer.id, classification
    assert isinstance(classification.fix, FixPlan), classification.fix
    return classification.fix


def install_stand_in(name: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """An empty module at `name` (and its parents) where the framework that has it is not installed."""
    try:
        return __import__(name, fromlist=["_"])
    except ImportError:
        parent, _, leaf = name.rpartition(".")
        module = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, module)
        if parent:
            monkeypatch.setattr(install_stand_in(parent, monkeypatch), leaf, module, raising=False)
        return module


def fail_if_called(*_args: object) -> None:
    pytest.fail("a send or receive was reached with no state to copy")


def imported_holders(plan: FixPlan, body: str, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, object], list[object]]:
    """The names the imports bind (with stand-ins for what is not installed), and the modules and
    classes among them that may hold the global. A helper the fix calls, from a module that is not
    installed, cannot be stood in for: the case is skipped."""
    group_names = {alias.asname or alias.name for line in PROFILE.repair_group_imports for alias in ast.parse(line).body[0].names}
    namespace: dict[str, object] = {}
    holders: list[object] = []
    for line in plan.imports:
        statement = ast.parse(line).body[0]
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                install_stand_in(alias.name, monkeypatch)
                exec(compile(line, "<import>", "exec"), namespace)
                if alias.name.split(".")[0] not in NOT_HOLDERS:
                    holders.append(sys.modules[alias.name])
            continue
        assert isinstance(statement, ast.ImportFrom) and statement.module
        module = install_stand_in(statement.module, monkeypatch)
        for alias in statement.names:
            bound = alias.asname or alias.name
            if not hasattr(module, alias.name):
                if bound in group_names:
                    monkeypatch.setattr(module, alias.name, fail_if_called, raising=False)
                elif re.search(rf"\b{bound}\(", body):
                    pytest.skip(f"the fix calls {alias.name} of {statement.module}, which is not installed here")
                elif alias.name[0].isupper():
                    monkeypatch.setattr(module, alias.name, type(alias.name, (), {}), raising=False)
                else:
                    install_stand_in(f"{statement.module}.{alias.name}", monkeypatch)
            namespace[bound] = getattr(module, alias.name)
            if bound not in group_names:
                holders.append(namespace[bound])
    return namespace, [holder for holder in holders if isinstance(holder, (type, types.ModuleType))]


def bare_instance(cls: type) -> object:
    """An object of the holder class built without its constructor: the fixes find them by class."""
    usable = type(cls.__name__, (cls,), {})
    usable.__abstractmethods__ = frozenset()  # type: ignore[attr-defined]
    instance = object.__new__(usable)
    if isinstance(instance, torch.nn.Module):
        torch.nn.Module.__init__(instance)
    return instance


def global_names(case: Case, body: str) -> list[str]:
    """The names the fix reads from its holders: the match blocks' and those it reads with getattr."""
    names = [name for block in getattr(case.fixer, "matches", ()) for name in block_names(block)]
    names += [case.subject.tensor.name.variable] if case.subject.tensor and case.subject.tensor.name.variable else []
    names += [
        node.args[1].value
        for node in ast.walk(ast.parse(body))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and isinstance(node.args[1], ast.Constant)
    ]
    return [name for name in dict.fromkeys(names) if re.search(rf"\b{re.escape(name)}\b", body)]


def set_state(holder: object, name: str, state: object, monkeypatch: pytest.MonkeyPatch) -> None:
    if state is ABSENT:
        if name in vars(holder):
            monkeypatch.delattr(holder, name)
    else:
        monkeypatch.setattr(holder, name, state, raising=False)


def assert_unchanged(holder: object, name: str, state: object) -> None:
    if state is ABSENT:
        assert name not in vars(holder), f"{holder}.{name} was created"
    else:
        assert vars(holder)[name] is state and state in (None, {}, []), f"{holder}.{name} is now {vars(holder)[name]!r}"


@pytest.fixture(scope="module", autouse=True)
def the_holder_module():
    """The module of the globals no framework defines, with the owner class the templates name."""
    module = types.ModuleType(HOLDER)
    module.Holder = type("Holder", (), {})  # type: ignore[attr-defined]
    sys.modules[HOLDER] = module
    yield module
    del sys.modules[HOLDER]


@pytest.fixture(scope="module", autouse=True)
def heap_frozen_while_here() -> Iterator[None]:
    """Each case marks every live tensor unsafe: with the worker's heap so far frozen (its tensors
    kept by the backend), that mark reads only what is newer, not the whole heap hundreds of times."""
    with frozen_heap():
        yield


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_block_does_nothing_on_absent_state(case, monkeypatch):
    plan = rendered(case)
    body = getattr(plan, case.side)
    namespace, holders = imported_holders(plan, body, monkeypatch)
    if isinstance(case.fixer, Template) and case.subject.tensor and case.subject.tensor.name.owner:
        holders.append(getattr(sys.modules[case.subject.tensor.name.module], case.subject.tensor.name.owner))
    holders += [bare_instance(holder) for holder in holders if isinstance(holder, type)]
    if "train_args" in body and all(isinstance(holder, (type, types.ModuleType, torch.nn.Module)) for holder in holders):
        holders.append(types.SimpleNamespace())  # the optimizer train_args hands a fix that imports no class for it
    names = global_names(case, body)
    assert names and holders, (names, holders)
    states = {(index, name): STATES[case.state]() for index in range(len(holders)) for name in names}
    for (index, name), state in states.items():
        set_state(holders[index], name, state, monkeypatch)
    modules = [holder for holder in holders if isinstance(holder, torch.nn.Module)]
    others = [holder for holder in holders if not isinstance(holder, (type, types.ModuleType, torch.nn.Module))]
    train_args = (None, [torch.nn.ModuleList(modules)], others[0] if others else None)
    namespace.update(train_args=train_args, **{SOURCE_RANK: 0, DEST_RANK: 1})

    backend = EmulatedBackend()
    with backend.activate():
        backend.set_check(enabled=True)
        backend.mark_all_unsafe()
        exec(compile(body, f"<{case.id}>", "exec"), namespace)
        backend.set_check(enabled=False)
    for (index, name), state in states.items():
        assert_unchanged(holders[index], name, state)


def test_every_template_and_rule_is_covered():
    covered = {case.fixer.id for case in CASES}
    assert covered == {fixer.id for fixer in (*SHIPPED.rules, *SHIPPED.templates)}
