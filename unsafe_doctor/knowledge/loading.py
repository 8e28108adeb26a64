"""Knowledge files -> one `KnowledgeBase`: the shipped folder (from its JSON snapshot), then the user's
files, each read and schema-checked (`yaml_file`), built into rules, templates, profiles and
conditions, and merged by id.

Every problem is one line with its file and line. What loading refuses: an unknown condition, slot
or probe, a duplicate id in one file, a kind of global no template covers, and two rules that could
tie for one global (`matching.ties`), so that file order never decides.
"""

from __future__ import annotations

import ast
import json
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar, get_args

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.matching import ties
from unsafe_doctor.knowledge.rules import (
    BASE_KINDS,
    EVERY_ROLE,
    MAPPING_ROLES,
    PARAMETER_ROLES,
    PROBE_NAMES,
    AdaptorProfile,
    Condition,
    FixTemplate,
    GlobalKind,
    KnowledgeBase,
    ParameterRole,
    PatternError,
    Rule,
    RuleMatch,
    Scenario,
    StepWritten,
    Template,
    map_parameters,
    size_problem,
    stray_dollar,
    template_slots,
    variable_pattern,
)
from unsafe_doctor.source.index import INDEX_FOLDER

REQUIRED_ROLES: tuple[ParameterRole, ...] = ("src_ranks", "dest_ranks")
# A condition's switch is one of Megatron's parsed arguments, read with getattr so that an argument
# a framework does not define reads as off.
SWITCH_IMPORTS = ("from megatron.training import get_args",)
SLOTS_SCENARIO_1 = frozenset({"module", "variable", "owner", "alias", "parent", "holder", "tensor"})
SLOTS_SCENARIO_2 = SLOTS_SCENARIO_1 | {"src", "dst", "group"}
KNOWLEDGE_SUFFIXES = (".yaml", ".yml")
# The globals of every indexed release that no rule claims, each reviewed (it needs none, or it is a hole
# still to get one): what tests/knowledge/test_coverage.py holds the audit's findings to. Validated with the
# knowledge files; no diagnose or audit reads it, so none parses it.
REVIEWED_FILE = "reviewed_globals.yaml"
# The shipped files' data and the lines their items start on, as JSON: what every run reads for the
# shipped files instead of their YAML (PyYAML's import and its building of Python objects were most
# of a small log's start-up; a user's --rules files are still YAML). `scripts/derive_snapshot.py`
# writes it with each YAML file's CRC-32, so that a YAML file edited since is read as YAML;
# tests/knowledge/test_knowledge_snapshot.py holds it to the YAML.
SNAPSHOT_FILE = "snapshot.json"
LineOf = Callable[[Sequence[str | int]], int]  # the 1-based line of the value at a path in one file


def shipped_knowledge_dir() -> Path:
    """Inside the package once installed; `knowledge_base/` beside the package in a checkout. The
    package's own copy is looked for first: beside an installed package lies site-packages."""
    installed = Path(str(resources.files("unsafe_doctor") / "knowledge_base"))
    return installed if installed.is_dir() else Path(__file__).resolve().parents[2] / "knowledge_base"


def load_knowledge(extra: Sequence[Path] = ()) -> KnowledgeBase:
    """Shipped knowledge, then the user's files; a user's rule, template or profile replaces a shipped one by id."""
    problems: list[str] = []
    merged = _FileKnowledge()
    for loaded in _shipped_knowledge(problems):
        merged.add(loaded)
    for path in _knowledge_files(extra):
        if (mine := _load_file(path, problems)) is not None:
            merged.add(mine)
    for rule in merged.rules.values():
        problems.extend(
            f"{rule.origin}: rule {rule.id}: unknown condition '{name}'"
            for name in (*rule.conditions, *rule.exists_when)
            if name not in merged.conditions
        )
    rule_ids = set(merged.rules)
    for rule in merged.rules.values():
        problems.extend(
            f"{rule.origin}: rule {rule.id}: repair_with names an unknown rule '{rule_id}'"
            for rule_id in rule.repair_with
            if rule_id not in rule_ids
        )
    for profile in merged.profiles.values():
        problems.extend(
            f"{profile.origin}: profile {profile.id}: resets an unknown rule '{rule_id}'"
            for rule_id in profile.resets
            if rule_id not in rule_ids
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


def shipped_files() -> list[Path]:
    """The shipped knowledge files load_knowledge reads (not the reviewed globals: no run reads them)."""
    return [path for path in _knowledge_files([shipped_knowledge_dir()]) if path.name != REVIEWED_FILE]


def snapshot(files: Sequence[Path]) -> dict[str, Any]:
    """The snapshot of these (shipped, valid) files: each one's data and the lines `_build` names.
    Raises ValueError when a file has a problem or a value JSON would not give back as it is."""
    from unsafe_doctor.knowledge.yaml_file import line_of, parse

    entries = []
    for path in files:
        problems: list[str] = []
        parsed = parse(path, problems)
        if parsed is None:
            raise ValueError(problems[0])
        node, data = parsed
        try:
            same = repr(json.loads(json.dumps(data))) == repr(data)
        except TypeError:  # a date, a set, bytes: no JSON value at all
            same = False
        if not same:
            raise ValueError(f"{path}: a value JSON does not give back as YAML read it (a date, a non-string key)")
        lines = {"/".join(map(str, parts)): line_of(node, parts) for parts in _line_paths(data)}
        entries.append(
            {
                "file": path.relative_to(shipped_knowledge_dir()).as_posix(),
                "crc32": zlib.crc32(path.read_bytes()),
                "lines": lines,
                "data": data,
            }
        )
    return {"generated_by": "python scripts/derive_snapshot.py (from the YAML beside it; do not edit)", "files": entries}


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
    """The YAML files given and under the folders given, less the framework index's folder (its pinned
    release list, `index/sources.yaml`, is the index's data, not knowledge)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(
                sorted(
                    p
                    for p in path.rglob("*")
                    if p.suffix in KNOWLEDGE_SUFFIXES and p.is_file() and p.relative_to(path).parts[0] != INDEX_FOLDER.name
                )
            )
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
            for kind in BASE_KINDS
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
        problems.extend(
            f"{rule.origin}: rule {rule.id}: ties with rule {other.id} ({other.origin}): both can match one global with "
            f"the same specificity and the same priority ({rule.priority}); give one a higher priority"
            for rule, other in ties(list(self.rules.values()))
        )
        return problems


# --- building one file's knowledge ----------------------------------------------------------------


def _shipped_knowledge(problems: list[str]) -> list[_FileKnowledge]:
    """The shipped files, built from the snapshot; from their YAML when the snapshot is missing,
    unreadable (a broken install) or older than a YAML file (edited in a checkout). The test suite
    holds the shipped files to the schema and the alias bound, so neither is checked again here (the
    alias check alone was a third of their parsing)."""
    before = len(problems)
    try:
        return snapshot_knowledge(problems)
    except (OSError, ValueError, LookupError, TypeError, AttributeError):
        del problems[before:]
        built = [_load_file(path, problems, trusted=True) for path in shipped_files()]
        return [loaded for loaded in built if loaded is not None]


def snapshot_knowledge(problems: list[str]) -> list[_FileKnowledge]:
    """The shipped files as the snapshot gives them; ValueError when it does not hold the YAML files
    there now, each as it is."""
    folder = shipped_knowledge_dir()
    entries = json.loads((folder / SNAPSHOT_FILE).read_bytes())["files"]
    if [folder / entry["file"] for entry in entries] != shipped_files():
        raise ValueError("the snapshot holds other files than the YAML beside it")
    for entry in entries:
        if zlib.crc32((folder / entry["file"]).read_bytes()) != entry["crc32"]:
            raise ValueError(f"{entry['file']} was edited since the snapshot was made")
    built = [_build(folder / entry["file"], entry["data"], _recorded(entry["lines"]), problems) for entry in entries]
    return [loaded for loaded in built if loaded is not None]


def _recorded(lines: dict[str, int]) -> LineOf:
    """A snapshot's line lookup: the line recorded for the path, or for its nearest recorded parent."""

    def line(parts: Sequence[str | int]) -> int:
        keys = ("/".join(map(str, parts[:end])) for end in range(len(parts), 0, -1))
        return next((lines[key] for key in keys if key in lines), 1)

    return line


def _line_paths(data: dict[str, Any]) -> list[tuple[str | int, ...]]:
    """Every path `_build` may ask the line of: each item of a section, each condition's guard."""
    sections = ("rules", "templates", "profiles", "step_written")
    return [
        *((section, index) for section in sections for index in range(len(data.get(section, [])))),
        *(("conditions", name, "guard") for name in data.get("conditions", {})),
    ]


def _load_file(path: Path, problems: list[str], *, trusted: bool = False) -> _FileKnowledge | None:
    """Parse, schema-check (unless `trusted`) and build one file; every problem goes to `problems` with its line."""
    from unsafe_doctor.knowledge.yaml_file import line_of, parse, schema_problems

    parsed = parse(path, problems, bound_aliases=not trusted)
    if parsed is None:
        return None
    node, data = parsed
    before = len(problems)
    if not trusted:
        problems.extend(schema_problems(path, node, data))
    if len(problems) > before:
        return None
    return _build(path, data, lambda parts: line_of(node, parts), problems)


def _build(path: Path, data: dict[str, Any], line_of: LineOf, problems: list[str]) -> _FileKnowledge | None:
    """One checked file's knowledge; None when building it found a problem (each in `problems`, with its line)."""
    before = len(problems)
    ids: set[str] = set()  # rules, templates and profiles share one id space per file
    loaded = _FileKnowledge(
        rules=_section(path, line_of, data, "rules", _rule, ids=ids, problems=problems),
        templates=_section(path, line_of, data, "templates", _template, ids=ids, problems=problems),
        profiles=_section(path, line_of, data, "profiles", _profile, ids=ids, problems=problems),
        step_written=_section(path, line_of, data, "step_written", _step_written, ids=ids, problems=problems),
    )
    for name, value in data.get("conditions", {}).items():
        loaded.conditions[name] = _condition(value)
        if not _is_expression(loaded.conditions[name].guard):
            line = line_of(["conditions", name, "guard"])
            problems.append(f"{path}:{line}: condition {name}: guard is not a Python expression")
    return None if len(problems) > before else loaded


_Item = TypeVar("_Item", Rule, Template, AdaptorProfile, StepWritten)


def _section(
    path: Path,
    line_of: LineOf,
    data: dict[str, Any],
    section: str,
    build: Callable[[dict[str, Any], str, list[str]], _Item | None],
    *,
    ids: set[str],
    problems: list[str],
) -> dict[str, _Item]:
    built: dict[str, _Item] = {}
    for index, item in enumerate(data.get(section, [])):
        origin = f"{path}:{line_of([section, index])}"
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
        if part is None:
            continue
        if (stray := stray_dollar(part)) is not None:
            problems.append(f"{what}: a '$' that starts no slot in {stray!r} (write $$ for a dollar sign)")
        elif unknown := template_slots(part) - allowed:
            problems.append(f"{what}: unknown template slot(s) {', '.join(sorted(unknown))}")
    return fix


def _matches(item: dict[str, Any], what: str, problems: list[str]) -> list[RuleMatch]:
    blocks = item["match"] if isinstance(item["match"], list) else [item["match"]]
    matches = [RuleMatch(**block) for block in blocks]
    for match in matches:
        if match.variable_regex is not None:
            try:
                variable_pattern(match.variable_regex)
            except PatternError as error:
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
    size = item.get("device_bytes")
    if size is not None and (problem := size_problem(size)) is not None:
        problems.append(f"{origin}: rule {item['id']}: device_bytes {size!r}: {problem}")
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
        exists_when=tuple(item.get("exists_when", ())),
        first_read=item.get("first_read"),
        device_bytes=item.get("device_bytes"),
        repair_with=tuple(item.get("repair_with", ())),
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
        rebuilds_model=item.get("rebuilds_model", True),
        repair_group=item["repair_group"]["expression"],
        repair_group_imports=tuple(item["repair_group"].get("imports", ())),
        origin=origin,
        resets=tuple(item.get("resets", ())),
        log_evidence=tuple(item.get("log_evidence", ())),
        pairs_with={name: tuple(Version(str(v)) for v in versions) for name, versions in item.get("pairs_with", {}).items()},
    )
    mapping = {role: _alternatives(name) for role, name in parameters.items() if role in MAPPING_ROLES}
    return map_parameters(profile, mapping)


def _alternatives(names: str | list[str]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


def _condition(item: dict[str, Any]) -> Condition:
    """A switch renders as `getattr(get_args(), "<switch>", <default>)`, compared with its `values` or
    `above` when it has them; `any_of` switches render as an `or` of such reads; a free guard stays as
    written."""
    switches = (item["switch"],) if "switch" in item else tuple(item.get("any_of", ()))
    if not switches:
        return Condition(item["guard"], tuple(item.get("imports", ())), item["description"])
    values, above = tuple(item.get("values", ())), item.get("above")
    reads = []
    for switch in switches:
        read = f'getattr(get_args(), "{switch}", {item.get("default", False)!r})'
        if values:
            read = f"str({read}) in {values!r}"
        elif above is not None:
            read = f"({read} or 0) > {above}"
        reads.append(read)
    return Condition(" or ".join(reads), SWITCH_IMPORTS, item["description"], switches, values, above, item.get("common", False))


def _is_expression(text: str) -> bool:
    try:
        ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    return True
