"""Stage 5: the knowledge base. Rules and adaptor profiles are data (YAML), validated on load.

A rule says, for one global tensor (matched by name, module, owner class or culprit frame, and by
the run's loss scaling where a frame alone is ambiguous; a rule may list several such match
blocks), in which framework versions it holds, which scenario it is, in which recovery phase it is
fixed, and the code that fixes it as a template over validated slots. Adaptor profiles describe
each generation of the recovery adaptor: where it lives, its rollback / send / receive functions
and their parameters.
"""

from __future__ import annotations

import ast
import json
import keyword
import re
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from unsafe_doctor.errors import UsageError
from unsafe_doctor.recovery import LossScaling

Scenario = Literal[1, 2]
Phase = Literal["rollback", "repair"]
SLOTS_SCENARIO_1 = frozenset({"module", "variable", "owner", "alias", "parent", "tensor"})
SLOTS_SCENARIO_2 = SLOTS_SCENARIO_1 | {"src", "dst", "group"}
KNOWLEDGE_SUFFIXES = (".yaml", ".yml")
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when PyYAML has it: 10x faster


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

    @property
    def matches(self) -> tuple[RuleMatch, ...]:
        return (self.match, *self.also_match)


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
    parameters: dict[str, str]  # role (src_ranks, dest_ranks, …) -> parameter name
    ranks_are_lists: bool
    repair_group: str  # expression that yields the repair process group
    repair_group_imports: tuple[str, ...]
    origin: str


@dataclass(frozen=True)
class Condition:
    guard: str  # Python expression; the fix runs only when it is true
    imports: tuple[str, ...]
    description: str


@dataclass(frozen=True)
class KnowledgeBase:
    rules: tuple[Rule, ...]
    profiles: tuple[AdaptorProfile, ...]
    conditions: dict[str, Condition]

    def rule(self, rule_id: str) -> Rule | None:
        return next((rule for rule in self.rules if rule.id == rule_id), None)

    def profile(self, profile_id: str) -> AdaptorProfile | None:
        return next((profile for profile in self.profiles if profile.id == profile_id), None)


def shipped_knowledge_dir() -> Path:
    """`knowledge_base/` beside the package in a checkout; inside the package once installed."""
    checkout = Path(__file__).resolve().parent.parent / "knowledge_base"
    if checkout.is_dir():
        return checkout
    return Path(str(resources.files("unsafe_doctor") / "knowledge_base"))


def load_knowledge(extra: Sequence[Path] = ()) -> KnowledgeBase:
    """Shipped knowledge, then the user's files; a user rule or profile replaces a shipped one by id."""
    problems: list[str] = []
    rules: dict[str, Rule] = {}
    profiles: dict[str, AdaptorProfile] = {}
    conditions: dict[str, Condition] = {}
    shipped = _knowledge_files([shipped_knowledge_dir()])
    for path in [*shipped, *_knowledge_files(extra)]:
        # The test suite holds the shipped files to the schema; checking them again costs every run.
        loaded = _load_file(path, problems, check_schema=path not in shipped)
        if loaded is None:
            continue
        file_rules, file_profiles, file_conditions = loaded
        rules.update((rule.id, rule) for rule in file_rules)
        profiles.update((profile.id, profile) for profile in file_profiles)
        conditions.update(file_conditions)
    for rule in rules.values():
        problems.extend(
            f"{rule.origin}: rule {rule.id}: unknown condition '{name}'" for name in rule.conditions if name not in conditions
        )
    if problems:
        raise UsageError(problems[0] + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))
    return KnowledgeBase(tuple(rules.values()), tuple(profiles.values()), conditions)


def validate_files(paths: Sequence[Path]) -> list[str]:
    """Every problem in these knowledge files, as 'file:line: what is wrong'."""
    problems: list[str] = []
    files = _knowledge_files(paths)
    if not files:
        return [f"{', '.join(map(str, paths))}: no .yaml knowledge files"]
    for path in files:
        _load_file(path, problems)
    return problems


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


# --- loading and validating one file ------------------------------------------------------------

_SCHEMA: dict[str, Any] | None = None


def _schema() -> dict[str, Any]:
    global _SCHEMA
    if _SCHEMA is None:
        _SCHEMA = json.loads((resources.files("unsafe_doctor") / "schemas" / "knowledge.schema.json").read_text())
    return _SCHEMA


def _load_file(
    path: Path, problems: list[str], *, check_schema: bool = True
) -> tuple[list[Rule], list[AdaptorProfile], dict[str, Condition]] | None:
    """Parse, schema-check and build one file; every problem goes to `problems` with its line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        problems.append(f"{path}: cannot read ({error})")
        return None
    try:
        loader = SAFE_LOADER(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        problems.append(f"{path}{line}: invalid YAML: {getattr(error, 'problem', None) or error}")
        return None
    if node is None:
        problems.append(f"{path}:1: empty knowledge file")
        return None
    before = len(problems)
    if check_schema:
        problems.extend(_schema_problems(path, node, data))
    if len(problems) > before:
        return None
    rules = [_rule(item, f"{path}:{_line_of(node, ['rules', i])}", problems) for i, item in enumerate(data.get("rules", []))]
    profiles = [
        _profile(item, f"{path}:{_line_of(node, ['profiles', i])}", problems)
        for i, item in enumerate(data.get("profiles", []))
    ]
    seen: set[str] = set()
    for item in [*rules, *profiles]:
        if item is not None and item.id in seen:
            problems.append(f"{item.origin}: duplicate id '{item.id}' in this file")
        if item is not None:
            seen.add(item.id)
    conditions = {
        name: Condition(value["guard"], tuple(value.get("imports", ())), value["description"])
        for name, value in data.get("conditions", {}).items()
    }
    for name, condition in conditions.items():
        if not _is_expression(condition.guard):
            problems.append(f"{path}:{_line_of(node, ['conditions', name, 'guard'])}: condition {name}: guard is not a Python expression")
    if len(problems) > before:
        return None
    return [r for r in rules if r], [p for p in profiles if p], conditions


def _schema_problems(path: Path, node: yaml.Node, data: Any) -> list[str]:
    import jsonschema  # imported here: loading only the shipped, already-checked files needs none

    validator = jsonschema.Draft202012Validator(_schema())
    return [
        f"{path}:{_line_of(node, error.absolute_path)}: "
        f"{'.'.join(str(part) for part in error.absolute_path) or 'top level'}: {_best_message(error)}"
        for error in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
    ]


def _best_message(error: Any) -> str:
    """jsonschema's message for anyOf/oneOf is the whole instance; the deepest cause says more."""
    if error.context:
        deepest = max(error.context, key=lambda e: len(e.absolute_path))
        return deepest.message
    return error.message


def _line_of(node: yaml.Node, path: Iterable[Any]) -> int:
    """1-based line of the YAML node at a JSON path; the nearest existing parent when it is absent."""
    for part in path:
        if isinstance(node, yaml.MappingNode):
            child = next((value for key, value in node.value if key.value == str(part)), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            child = node.value[part]
        else:
            child = None
        if child is None:
            break
        node = child
    return node.start_mark.line + 1


def _specifier(text: str | None, origin: str, problems: list[str]) -> SpecifierSet | None:
    if text is None:
        return None
    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        problems.append(f"{origin}: versions '{text}' is not a PEP 440 specifier set (e.g. '>=0.8,<0.13')")
        return None


def _rule(item: dict[str, Any], origin: str, problems: list[str]) -> Rule | None:
    before = len(problems)
    blocks = item["match"] if isinstance(item["match"], list) else [item["match"]]
    matches = [RuleMatch(**block) for block in blocks]
    for match in matches:
        if match.variable_regex is not None:
            try:
                re.compile(match.variable_regex)
            except re.error as error:
                problems.append(f"{origin}: rule {item['id']}: variable_regex: {error}")
    framework = item.get("framework") or {}
    versions = _specifier(framework.get("versions"), origin, problems)
    fix = FixTemplate(
        imports=tuple(item["fix"].get("imports", ())),
        code=item["fix"].get("code"),
        send=item["fix"].get("send"),
        recv=item["fix"].get("recv"),
    )
    allowed = SLOTS_SCENARIO_2 if item["scenario"] == 2 else SLOTS_SCENARIO_1
    for part in (*fix.imports, fix.code, fix.send, fix.recv):
        if part is None:
            continue
        unknown = template_slots(part) - allowed
        if unknown:
            problems.append(f"{origin}: rule {item['id']}: unknown template slot(s) {', '.join(sorted(unknown))}")
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
    )


def _profile(item: dict[str, Any], origin: str, problems: list[str]) -> AdaptorProfile | None:
    framework = item.get("framework") or {}
    before = len(problems)
    versions = _specifier(framework.get("versions"), origin, problems)
    if not _is_expression(item["repair_group"]["expression"]):
        problems.append(f"{origin}: profile {item['id']}: repair_group.expression is not a Python expression")
    if len(problems) > before:
        return None
    return AdaptorProfile(
        id=item["id"],
        title=item["title"],
        framework=framework.get("package"),
        versions=versions,
        files=tuple(item["files"]),
        rollback=item["rollback"],
        send=item["send"],
        recv=item["recv"],
        parameters=dict(item["parameters"]),
        ranks_are_lists=item.get("ranks_are_lists", True),
        repair_group=item["repair_group"]["expression"],
        repair_group_imports=tuple(item["repair_group"].get("imports", ())),
        origin=origin,
    )


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


# --- matching -----------------------------------------------------------------------------------


def is_safe_dotted(name: str | None) -> bool:
    """A dotted Python name with no keywords and no dunder parts: safe to place in generated code."""
    if not name:
        return False
    return all(
        part.isidentifier() and not keyword.iskeyword(part) and not part.startswith("__") for part in name.split(".")
    )


def rule_matches(
    rule: Rule,
    variable: str | None,
    module: str | None,
    owner: str | None,
    file: str | None,
    function: str | None,
    loss_scaling: LossScaling | None = None,
) -> bool:
    """Whether one of the rule's match blocks fits the finding (see `matching_block`)."""
    return matching_block(rule, variable, module, owner, file, function, loss_scaling) is not None


def matching_block(
    rule: Rule,
    variable: str | None,
    module: str | None,
    owner: str | None,
    file: str | None,
    function: str | None,
    loss_scaling: LossScaling | None = None,
) -> RuleMatch | None:
    """The rule's first match block whose every field fits; None when no block does.

    A block that names the culprit frame may supply the variable. A block that names a loss scaling
    fits a run with that loss scaling, or one whose loss scaling is unknown (None).
    """
    return next(
        (block for block in rule.matches if _block_fits(block, variable, module, owner, file, function, loss_scaling)),
        None,
    )


def _block_fits(
    match: RuleMatch,
    variable: str | None,
    module: str | None,
    owner: str | None,
    file: str | None,
    function: str | None,
    loss_scaling: LossScaling | None,
) -> bool:
    if match.loss_scaling is not None and loss_scaling is not None and match.loss_scaling != loss_scaling:
        return False
    frame_named = match.file is not None and match.function is not None
    frame_ok = (match.file is None or (file is not None and fnmatchcase(file.replace("\\", "/"), match.file))) and (
        match.function is None or (function is not None and fnmatchcase(function, match.function))
    )
    if not frame_ok:
        return False
    if variable is None:
        return frame_named
    return names_global(match, variable, module, owner)


def names_global(match: RuleMatch, variable: str, module: str | None, owner: str | None) -> bool:
    """Whether a match block's variable, module and owner fields fit a global (its frame fields aside)."""
    if match.variable is not None and variable != match.variable:
        return False
    if match.variable_regex is not None and not re.fullmatch(match.variable_regex, variable):
        return False
    if match.module is not None and (module is None or not fnmatchcase(module, match.module)):
        return False
    if match.owner is not None and owner != match.owner:
        return False
    return True


def _is_glob(pattern: str) -> bool:
    return any(char in pattern for char in "*?[")


def specificity(rule: Rule, match: RuleMatch | None = None) -> int:
    """More named fields, more specific: the most specific matching rule wins.

    `match` is the block that matched (the rule's first by default).
    """
    match = match or rule.match
    return sum(
        weight
        for weight, present in (
            (4, match.variable is not None),
            (2, match.variable_regex is not None),
            (3, match.module is not None and not _is_glob(match.module)),
            (2, match.module is not None and _is_glob(match.module)),
            (2, match.owner is not None),
            (1, match.file is not None),
            (1, match.function is not None),
            (1, match.loss_scaling is not None),
        )
        if present
    )
