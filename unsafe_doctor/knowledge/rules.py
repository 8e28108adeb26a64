"""The knowledge base. Rules, templates, conditions and adaptor profiles are data (YAML),
validated on load.

A rule says, for one global tensor (matched by name, module, owner class or culprit frame, and by
the run's loss scaling where a frame alone is ambiguous; a rule may list several such match
blocks), in which framework versions it holds, which scenario it is, in which recovery phase it is
fixed, the code that fixes it as a template over validated slots, and the replay probe that
builds its state. When several rules match, the most specific wins, then the higher `priority`;
two rules that could match one global with the same specificity and priority are refused, so file
order never decides. A template is the fix for a global no rule knows, chosen by the scenario and
by what the global is (a value, or an lru-cached function). A condition names the framework
argument that switches a feature on; its guard is rendered from it. Adaptor profiles describe each
generation of the recovery adaptor: where it lives, its rollback / send / receive functions and
which parameter holds each role (`PARAMETER_ROLES`, the one list of them).

`yaml_file` reads a file (lines kept, schema checked); `matching` fits rules to a global.
"""

from __future__ import annotations

import ast
import keyword
import re
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.yaml_file import line_of, parse, schema_problems
from unsafe_doctor.knowledge.matching import may_tie, names_global
from unsafe_doctor.log.recovery import LossScaling

Scenario = Literal[1, 2]
Phase = Literal["rollback", "repair"]
# What a global is, for choosing a template: a value (tensor, dict or list of them) or an lru-cached function.
GlobalKind = Literal["value", "lru-cache"]
# What MindIO passes the adaptor's repair functions; a profile names the parameter that holds each.
ParameterRole = Literal["src_ranks", "dest_ranks", "optim_idxs", "rank_list", "train_args", "need_rebuild"]
PARAMETER_ROLES: tuple[ParameterRole, ...] = get_args(ParameterRole)
REQUIRED_ROLES: tuple[ParameterRole, ...] = ("src_ranks", "dest_ranks")
# Roles that map onto the others (profile files and `--parameter`): `peer`, the one rank on the other
# side (the source where a function receives, the destination where it sends; ranks then are no
# lists); `group`, a parameter holding the repair group (instead of the profile's expression).
MAPPING_ROLES = ("peer", "group")
EVERY_ROLE = (*PARAMETER_ROLES, *MAPPING_ROLES)
# The names a scenario-2 template's $src and $dst render to; the fix binds them from the rank roles.
SOURCE_RANK = "src_rank"
DEST_RANK = "dest_rank"
# Probes the replay implements (replay/probes.py registers one class per name; a test holds the two equal).
PROBE_NAMES = frozenset({"megatron-layer-wise-tracker", "megatron-aux-losses-tracker", "megatron-router-expert-bias"})
# A condition's switch is one of Megatron's parsed arguments, read with getattr so that an argument
# a framework does not define reads as off.
SWITCH_IMPORTS = ("from megatron.training import get_args",)
SLOTS_SCENARIO_1 = frozenset({"module", "variable", "owner", "alias", "parent", "holder", "tensor"})
SLOTS_SCENARIO_2 = SLOTS_SCENARIO_1 | {"src", "dst", "group"}
KNOWLEDGE_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True, slots=True)
class RuleMatch:
    variable: str | None = None
    variable_regex: str | None = None
    module: str | None = None  # glob over the dotted module
    owner: str | None = None
    file: str | None = None  # glob over the culprit frame's path
    function: str | None = None  # glob over the culprit frame's function
    loss_scaling: LossScaling | None = None  # holds only for runs with this loss scaling


@dataclass(frozen=True, slots=True)
class FixTemplate:
    imports: tuple[str, ...] = ()
    code: str | None = None  # scenario 1: the re-initialisation
    send: str | None = None  # scenario 2: replica side
    recv: str | None = None  # scenario 2: faulty side


@dataclass(frozen=True)
class Rule:
    id: str
    title: str
    match: RuleMatch  # the first match block: it names the variable of a finding that names none
    framework: str | None  # distribution whose version `versions` constrains, e.g. "megatron-core"
    versions: SpecifierSet | None
    scenario: Scenario
    phase: Phase
    conditions: tuple[str, ...]
    fix: FixTemplate
    reason: str
    references: tuple[str, ...]
    origin: str  # "file:line" of the rule
    also_match: tuple[RuleMatch, ...] = ()  # further blocks of a `match:` list; any one block suffices
    probe: str | None = None  # the replay probe that builds this global's state (one of PROBE_NAMES)
    priority: int = 0  # between rules equally specific for one global, the higher wins

    @property
    def matches(self) -> tuple[RuleMatch, ...]:
        return (self.match, *self.also_match)


@dataclass(frozen=True)
class StepWritten:
    """Tensors a training step writes before it reads them (a `copy_` into them, or a new binding):
    unsafe after a fault and harmless, so the sentinel names them apart and never stops a recovery for them."""

    id: str
    title: str
    matches: tuple[RuleMatch, ...]
    reason: str
    references: tuple[str, ...]
    origin: str

    def names(self, variable: str, module: str | None, owner: str | None) -> bool:
        return any(names_global(match, variable, module, owner) for match in self.matches)


@dataclass(frozen=True)
class Template:
    """The fix of a global that no rule knows, once heuristics or the user gave its scenario."""

    id: str
    title: str
    scenario: Scenario
    phase: Phase
    applies_to: tuple[GlobalKind, ...]
    fix: FixTemplate
    reason: str
    references: tuple[str, ...]
    origin: str


@dataclass(frozen=True)
class AdaptorProfile:
    id: str
    title: str
    framework: str | None
    versions: SpecifierSet | None
    files: tuple[str, ...]  # globs, relative to a source root or site-packages
    rollback: str
    send: str
    recv: str
    # MindIO's rollback callback, which calls `rollback` and then repairs more (the model's parameters
    # from the optimizer, the dataset, the log): its end is the end of the rollback, where the sentinel
    # goes. None: `rollback` is the end.
    rollback_callback: str | None
    # role -> the parameter that holds it, or its alternatives: a role the send and receive functions
    # hold under different names (`send_args.src_ranks`, `recv_args.src_ranks`) lists both, and each
    # function uses the one it has (`role_parameter`)
    parameters: dict[ParameterRole, tuple[str, ...]]
    ranks_are_lists: bool
    repair_group: str  # expression that yields the repair process group
    repair_group_imports: tuple[str, ...]
    origin: str


@dataclass(frozen=True)
class Condition:
    guard: str  # Python expression; the fix runs only when it is true
    imports: tuple[str, ...]
    description: str
    switch: str | None = None  # the framework argument the guard tests (rendered from it); None for a free guard


@dataclass(frozen=True)
class KnowledgeBase:
    rules: tuple[Rule, ...]
    profiles: tuple[AdaptorProfile, ...]
    conditions: dict[str, Condition]
    templates: tuple[Template, ...] = ()
    step_written: tuple[StepWritten, ...] = ()

    def written_by_the_step(self, variable: str, module: str | None, owner: str | None) -> StepWritten | None:
        return next((item for item in self.step_written if item.names(variable, module, owner)), None)

    def rule(self, rule_id: str) -> Rule | None:
        return next((rule for rule in self.rules if rule.id == rule_id), None)

    def template(self, template_id: str) -> Template | None:
        return next((template for template in self.templates if template.id == template_id), None)

    def template_for(self, scenario: Scenario, kind: GlobalKind) -> Template:
        """The template for a global of this kind in this scenario (exactly one: checked on load)."""
        return next(t for t in self.templates if t.scenario == scenario and kind in t.applies_to)

    def switches(self, rule: Rule) -> tuple[str, ...]:
        """The framework arguments the rule's conditions test: what must be on for its fix to run."""
        return tuple(switch for name in rule.conditions if (switch := self.conditions[name].switch) is not None)

    def profile(self, profile_id: str) -> AdaptorProfile | None:
        return next((profile for profile in self.profiles if profile.id == profile_id), None)


def shipped_knowledge_dir() -> Path:
    """`knowledge_base/` beside the package in a checkout; inside the package once installed."""
    checkout = Path(__file__).resolve().parents[2] / "knowledge_base"
    if checkout.is_dir():
        return checkout
    return Path(str(resources.files("unsafe_doctor") / "knowledge_base"))


def load_knowledge(extra: Sequence[Path] = ()) -> KnowledgeBase:
    """Shipped knowledge, then the user's files; a user's rule, template or profile replaces a shipped one by id."""
    problems: list[str] = []
    shipped = _knowledge_files([shipped_knowledge_dir()])
    merged = _FileKnowledge()
    for path in [*shipped, *_knowledge_files(extra)]:
        # The test suite holds the shipped files to the schema; checking them again costs every run.
        loaded = _load_file(path, problems, check_schema=path not in shipped)
        if loaded is not None:
            merged.add(loaded)
    for rule in merged.rules.values():
        problems.extend(
            f"{rule.origin}: rule {rule.id}: unknown condition '{name}'"
            for name in rule.conditions
            if name not in merged.conditions
        )
    problems.extend(merged.conflicts())
    problems.extend(merged.uncovered(", ".join(map(str, extra)) or str(shipped_knowledge_dir())))
    if problems:
        raise UsageError(problems[0] + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))
    return KnowledgeBase(
        tuple(merged.rules.values()),
        tuple(merged.profiles.values()),
        merged.conditions,
        tuple(merged.templates.values()),
        tuple(merged.step_written.values()),
    )


def validate_files(paths: Sequence[Path]) -> list[str]:
    """Every problem in these knowledge files, as 'file:line: what is wrong'."""
    problems: list[str] = []
    files = _knowledge_files(paths)
    if not files:
        return [f"{', '.join(map(str, paths))}: no .yaml knowledge files"]
    merged = _FileKnowledge()
    for path in files:
        loaded = _load_file(path, problems)
        if loaded is not None:
            merged.add(loaded)
    return problems + merged.conflicts()


def _knowledge_files(paths: Iterable[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.suffix in KNOWLEDGE_SUFFIXES and p.is_file()))
        elif path.exists():
            files.append(path)
        else:
            raise UsageError(f"{path}: no such knowledge file or folder")
    return files


@dataclass
class _FileKnowledge:
    """What one file holds, or several merged in order (a later item replaces an earlier one by id)."""

    rules: dict[str, Rule] = field(default_factory=dict)
    templates: dict[str, Template] = field(default_factory=dict)
    profiles: dict[str, AdaptorProfile] = field(default_factory=dict)
    conditions: dict[str, Condition] = field(default_factory=dict)
    step_written: dict[str, StepWritten] = field(default_factory=dict)

    def add(self, other: _FileKnowledge) -> None:
        self.rules.update(other.rules)
        self.step_written.update(other.step_written)
        self.templates.update(other.templates)
        self.profiles.update(other.profiles)
        self.conditions.update(other.conditions)

    def uncovered(self, where: str) -> list[str]:
        """Every scenario and kind of global needs a template: a verdict without a rule gets its fix."""
        return [
            f"{where}: no template for {kind} globals in scenario {scenario} (the shipped templates.yaml has one)"
            for scenario in get_args(Scenario)
            for kind in get_args(GlobalKind)
            if not any(t.scenario == scenario and kind in t.applies_to for t in self.templates.values())
        ]

    def conflicts(self) -> list[str]:
        """Choices the knowledge would leave to file order: two templates for one kind of global,
        two rules that could match one global with the same specificity and priority."""
        problems = []
        claimed: dict[tuple[Scenario, GlobalKind], Template] = {}
        for template in self.templates.values():
            for kind in template.applies_to:
                other = claimed.setdefault((template.scenario, kind), template)
                if other is not template:
                    problems.append(
                        f"{template.origin}: template {template.id}: scenario {template.scenario} for {kind} is "
                        f"already template {other.id}'s ({other.origin})"
                    )
        rules = list(self.rules.values())
        for index, rule in enumerate(rules):
            problems.extend(
                f"{rule.origin}: rule {rule.id}: ties with rule {other.id} ({other.origin}): both can match one global with "
                f"the same specificity and the same priority ({rule.priority}); give one a higher priority"
                for other in rules[:index]
                if may_tie(other, rule)
            )
        return problems


# --- building one file's knowledge ----------------------------------------------------------------


def _load_file(path: Path, problems: list[str], *, check_schema: bool = True) -> _FileKnowledge | None:
    """Parse, schema-check and build one file; every problem goes to `problems` with its line."""
    parsed = parse(path, problems)
    if parsed is None:
        return None
    node, data = parsed
    before = len(problems)
    if check_schema:
        problems.extend(schema_problems(path, node, data))
    if len(problems) > before:
        return None
    ids: set[str] = set()  # rules, templates and profiles share one id space per file
    loaded = _FileKnowledge(
        rules=_section(path, node, data, "rules", _rule, ids, problems),
        templates=_section(path, node, data, "templates", _template, ids, problems),
        profiles=_section(path, node, data, "profiles", _profile, ids, problems),
        step_written=_section(path, node, data, "step_written", _step_written, ids, problems),
    )
    for name, value in data.get("conditions", {}).items():
        loaded.conditions[name] = _condition(value)
        if not _is_expression(loaded.conditions[name].guard):
            line = line_of(node, ["conditions", name, "guard"])
            problems.append(f"{path}:{line}: condition {name}: guard is not a Python expression")
    return None if len(problems) > before else loaded


_Item = TypeVar("_Item", Rule, Template, AdaptorProfile, StepWritten)


def _section(
    path: Path,
    node: yaml.Node,
    data: dict[str, Any],
    section: str,
    build: Callable[[dict[str, Any], str, list[str]], _Item | None],
    ids: set[str],
    problems: list[str],
) -> dict[str, _Item]:
    built: dict[str, _Item] = {}
    for index, item in enumerate(data.get(section, [])):
        origin = f"{path}:{line_of(node, [section, index])}"
        one = build(item, origin, problems)
        if one is not None and one.id in ids:
            problems.append(f"{origin}: duplicate id '{one.id}' in this file")
        if one is not None:
            ids.add(one.id)
            built[one.id] = one
    return built


def _specifier(text: str | None, origin: str, problems: list[str]) -> SpecifierSet | None:
    if text is None:
        return None
    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        problems.append(f"{origin}: versions '{text}' is not a PEP 440 specifier set (e.g. '>=0.8,<0.13')")
        return None


def _fix(item: dict[str, Any], what: str, problems: list[str]) -> FixTemplate:
    """The fix of a rule or template; `what` names it in problems ('file:line: rule x')."""
    fix = FixTemplate(
        imports=tuple(item["fix"].get("imports", ())),
        code=item["fix"].get("code"),
        send=item["fix"].get("send"),
        recv=item["fix"].get("recv"),
    )
    allowed = SLOTS_SCENARIO_2 if item["scenario"] == 2 else SLOTS_SCENARIO_1
    for part in (*fix.imports, fix.code, fix.send, fix.recv):
        unknown = template_slots(part) - allowed if part is not None else set()
        if unknown:
            problems.append(f"{what}: unknown template slot(s) {', '.join(sorted(unknown))}")
    return fix


def _matches(item: dict[str, Any], what: str, problems: list[str]) -> list[RuleMatch]:
    blocks = item["match"] if isinstance(item["match"], list) else [item["match"]]
    matches = [RuleMatch(**block) for block in blocks]
    for match in matches:
        if match.variable_regex is not None:
            try:
                re.compile(match.variable_regex)
            except re.error as error:
                problems.append(f"{what}: variable_regex: {error}")
    return matches


def _step_written(item: dict[str, Any], origin: str, problems: list[str]) -> StepWritten | None:
    before = len(problems)
    matches = _matches(item, f"{origin}: step_written {item['id']}", problems)
    if len(problems) > before:
        return None
    reason = " ".join(item["reason"].split())
    return StepWritten(item["id"], item["title"], tuple(matches), reason, tuple(item.get("references", ())), origin)


def _rule(item: dict[str, Any], origin: str, problems: list[str]) -> Rule | None:
    before = len(problems)
    matches = _matches(item, f"{origin}: rule {item['id']}", problems)
    framework = item.get("framework") or {}
    versions = _specifier(framework.get("versions"), origin, problems)
    fix = _fix(item, f"{origin}: rule {item['id']}", problems)
    probe = item.get("probe")
    if probe is not None and probe not in PROBE_NAMES:
        known = ", ".join(sorted(PROBE_NAMES))
        problems.append(f"{origin}: rule {item['id']}: unknown probe '{probe}' (the replay has: {known})")
    if len(problems) > before:
        return None
    return Rule(
        id=item["id"],
        title=item["title"],
        match=matches[0],
        framework=framework.get("package"),
        versions=versions,
        scenario=item["scenario"],
        phase=item["phase"],
        conditions=tuple(item.get("conditions", ())),
        fix=fix,
        reason=" ".join(item["reason"].split()),
        references=tuple(item.get("references", ())),
        origin=origin,
        also_match=tuple(matches[1:]),
        probe=probe,
        priority=item.get("priority", 0),
    )


def _template(item: dict[str, Any], origin: str, problems: list[str]) -> Template | None:
    before = len(problems)
    fix = _fix(item, f"{origin}: template {item['id']}", problems)
    if len(problems) > before:
        return None
    return Template(
        id=item["id"],
        title=item["title"],
        scenario=item["scenario"],
        phase=item["phase"],
        applies_to=tuple(item["applies_to"]),
        fix=fix,
        reason=" ".join(item["reason"].split()),
        references=tuple(item.get("references", ())),
        origin=origin,
    )


def _profile(item: dict[str, Any], origin: str, problems: list[str]) -> AdaptorProfile | None:
    framework = item.get("framework") or {}
    before = len(problems)
    versions = _specifier(framework.get("versions"), origin, problems)
    if not _is_expression(item["repair_group"]["expression"]):
        problems.append(f"{origin}: profile {item['id']}: repair_group.expression is not a Python expression")
    parameters = item["parameters"]
    problems.extend(
        f"{origin}: profile {item['id']}: unknown parameter role '{role}' (roles: {', '.join(EVERY_ROLE)})"
        for role in parameters
        if role not in PARAMETER_ROLES and role not in MAPPING_ROLES
    )
    problems.extend(
        f"{origin}: profile {item['id']}: parameters: no parameter for the role {role} (or peer)"
        for role in REQUIRED_ROLES
        if role not in parameters and "peer" not in parameters
    )
    if len(problems) > before:
        return None
    profile = AdaptorProfile(
        id=item["id"],
        title=item["title"],
        framework=framework.get("package"),
        versions=versions,
        files=tuple(item["files"]),
        rollback=item["rollback"],
        rollback_callback=item.get("rollback_callback"),
        send=item["send"],
        recv=item["recv"],
        parameters={role: _alternatives(name) for role, name in parameters.items() if role in PARAMETER_ROLES},
        ranks_are_lists=item.get("ranks_are_lists", True),
        repair_group=item["repair_group"]["expression"],
        repair_group_imports=tuple(item["repair_group"].get("imports", ())),
        origin=origin,
    )
    mapping = {role: _alternatives(name) for role, name in parameters.items() if role in MAPPING_ROLES}
    return map_parameters(profile, mapping)


def _alternatives(names: str | list[str]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


def map_parameters(profile: AdaptorProfile, mapping: Mapping[str, Sequence[str]]) -> AdaptorProfile:
    """The profile with some roles held by other parameters (`--parameter`, or a profile file's
    `parameters`), `peer` and `group` included (see MAPPING_ROLES); a role may name alternatives."""
    parameters = dict(profile.parameters)
    lists, group, imports = profile.ranks_are_lists, profile.repair_group, profile.repair_group_imports
    for role, names in mapping.items():
        for name in names:
            if not is_safe_dotted(name):
                raise UsageError(f"parameter role {role}={name}: {name!r} is not a Python name")
        if role == "peer":
            parameters["src_ranks"] = parameters["dest_ranks"] = tuple(names)
            lists = False
        elif role == "group":
            if len(names) != 1:
                raise UsageError(f"parameter role group: one parameter, not {', '.join(names)}")
            group, imports = names[0], ()
        elif role in PARAMETER_ROLES:
            parameters[role] = tuple(names)
        else:
            raise UsageError(f"unknown parameter role {role!r} (roles: {', '.join(EVERY_ROLE)})")
    return replace(profile, parameters=parameters, ranks_are_lists=lists, repair_group=group, repair_group_imports=imports)


def role_parameter(profile: AdaptorProfile, role: ParameterRole, parameters: Iterable[str]) -> str | None:
    """What holds `role` in a function with these parameters: the first of the role's alternatives
    whose root is one of them; None when the profile names none for the role."""
    alternatives = profile.parameters.get(role, ())
    present = set(parameters)
    return next((name for name in alternatives if name.split(".")[0] in present), alternatives[0] if alternatives else None)


def _condition(item: dict[str, Any]) -> Condition:
    """A switch renders as `getattr(get_args(), "<switch>", <default>)`; a free guard stays as written."""
    switch = item.get("switch")
    if switch is None:
        return Condition(item["guard"], tuple(item.get("imports", ())), item["description"])
    guard = f'getattr(get_args(), "{switch}", {item.get("default", False)!r})'
    return Condition(guard, SWITCH_IMPORTS, item["description"], switch)


def template_slots(template: str) -> set[str]:
    return {
        named or braced
        for _, named, braced, _ in string.Template.pattern.findall(template)
        if named or braced
    }


def _is_expression(text: str) -> bool:
    try:
        ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    return True


def is_safe_dotted(name: str | None) -> bool:
    """A dotted Python name with no keywords and no dunder parts: safe to place in generated code.

    ASCII only: Python reads identifiers after NFKC normalisation, so `_\uff3fbuiltins__` (a
    full-width low line) is `__builtins__` to it and would pass a check made on the raw text; and a
    homoglyph (a Cyrillic `а` in `pаrallel_state`) shows one name while meaning another. Framework
    names are ASCII; a log that offers anything else is refused."""
    if not name or not name.isascii():
        return False
    return all(
        part.isidentifier() and not keyword.iskeyword(part) and not part.startswith("__") for part in name.split(".")
    )
