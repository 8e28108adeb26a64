"""Stage 5b: a finding -> scenario, rule or heuristic evidence, and the fix rendered for the adaptor.

A matching rule decides (confidence high). Among several, the framework version detected in the
user's tree filters them, then the most specific wins. With no rule, source heuristics decide when
they find evidence (medium or low). Otherwise the finding stays unclassified and says what to check.
"""

from __future__ import annotations

import string
import textwrap
from dataclasses import dataclass
from typing import Literal

from unsafe_doctor.knowledge import (
    AdaptorProfile,
    KnowledgeBase,
    Rule,
    Scenario,
    is_safe_dotted,
    rule_matches,
    specificity,
    template_slots,
)
from unsafe_doctor.locate import Finding
from unsafe_doctor.versions import Environment

Confidence = Literal["high", "medium", "low"]
GENERIC_RULES = {1: "generic.reinitialise", 2: "generic.replica-copy"}  # templates for heuristic verdicts


@dataclass(frozen=True)
class FixPlan:
    phase: Literal["rollback", "repair"]
    function: str  # the rollback function (scenario 1) or the receive function on the faulty rank
    code: str
    imports: tuple[str, ...]
    peer_function: str | None  # scenario 2: the send function on the replica rank
    peer_code: str | None
    profile: str  # adaptor profile whose names were used


@dataclass(frozen=True)
class Classification:
    scenario: Scenario | None
    rule: str | None  # None when heuristics decided or nothing did
    confidence: Confidence | None
    reason: str
    evidence: tuple[str, ...]  # "file:line: what was seen", for heuristic verdicts
    fix: FixPlan | None
    notes: tuple[str, ...]


def classify(finding: Finding, knowledge: KnowledgeBase, environment: Environment) -> Classification:
    notes: list[str] = []
    rule = _choose_rule(finding, knowledge, environment, notes)
    if rule is not None:
        fix = _render(rule, finding, knowledge, environment.profile, notes)
        return Classification(rule.scenario, rule.id, "high", rule.reason, (), fix, tuple(notes))
    from unsafe_doctor.heuristics import judge  # only when no rule matched: it costs start-up time

    verdict = judge(finding, environment.source_roots)
    if verdict.scenario is None:
        return Classification(None, None, None, verdict.reason, verdict.evidence, None, tuple(notes))
    generic = knowledge.rule(GENERIC_RULES[verdict.scenario])
    fix = _render(generic, finding, knowledge, environment.profile, notes) if generic else None
    return Classification(verdict.scenario, None, verdict.confidence, verdict.reason, verdict.evidence, fix, tuple(notes))


def classify_as(
    finding: Finding, scenario: Scenario, knowledge: KnowledgeBase, environment: Environment, evidence: tuple[str, ...]
) -> Classification:
    """The user's answer for a finding nothing could classify: the generic fix for that scenario."""
    notes: list[str] = []
    generic = knowledge.rule(GENERIC_RULES[scenario])
    fix = _render(generic, finding, knowledge, environment.profile, notes) if generic else None
    return Classification(scenario, None, None, "scenario given by the user", evidence, fix, tuple(notes))


def _choose_rule(finding: Finding, knowledge: KnowledgeBase, environment: Environment, notes: list[str]) -> Rule | None:
    tensor, culprit = finding.tensor, finding.culprit
    candidates = [
        rule
        for rule in knowledge.rules
        if rule.id not in GENERIC_RULES.values()
        and rule_matches(
            rule,
            tensor.variable if tensor else None,
            tensor.module if tensor else None,
            tensor.owner if tensor else None,
            culprit.file if culprit else None,
            culprit.function if culprit else None,
        )
    ]
    if not candidates:
        return None
    fitting = []
    for rule in candidates:
        version = environment.versions.get(rule.framework) if rule.framework else None
        if rule.versions is None or version is None or rule.versions.contains(version, prereleases=True):
            fitting.append(rule)
    if not fitting:
        chosen = max(candidates, key=specificity)
        version = environment.versions[chosen.framework]
        notes.append(
            f"the log's symbol belongs to {chosen.framework} {chosen.versions}, but {environment.origins[chosen.framework]} "
            f"has {chosen.framework} {version}: the log comes from another version than the one found here"
        )
        return chosen
    chosen = max(fitting, key=specificity)
    if chosen.framework and chosen.framework not in environment.versions:
        notes.append(f"{chosen.framework} version unknown here; rule chosen by the symbol in the log")
    return chosen


def _slots(rule: Rule, finding: Finding, profile: AdaptorProfile) -> dict[str, str]:
    """The slot values this finding can fill, each a plain Python name: a log is untrusted input.

    A slot whose value is unknown or unsafe is left out; a template that needs it is not rendered.
    """
    tensor = finding.tensor
    variable = rule.match.variable or (tensor.variable if tensor else None)
    module = tensor.module if tensor else None
    owner = tensor.owner if tensor else None
    slots: dict[str, str] = {}
    if is_safe_dotted(variable):
        slots["variable"] = variable
    if is_safe_dotted(owner):
        slots["owner"] = owner
    if is_safe_dotted(module):
        parent, _, alias = module.rpartition(".")
        slots.update(module=module, alias=alias, parent=parent)
        if "variable" in slots and (owner is None or "owner" in slots):
            slots["tensor"] = ".".join(part for part in (alias, owner, variable) if part)
    if rule.scenario == 2:
        slots.update(src="src_rank", dst="dest_rank", group=profile.repair_group)
    return slots


def _render(
    rule: Rule, finding: Finding, knowledge: KnowledgeBase, profile: AdaptorProfile, notes: list[str]
) -> FixPlan | None:
    slots = _slots(rule, finding, profile)
    templates = [*rule.fix.imports, *(part for part in (rule.fix.code, rule.fix.send, rule.fix.recv) if part)]
    missing = set().union(*(template_slots(template) for template in templates)) - set(slots)
    if missing:
        notes.append(f"no fix rendered: the log does not give a plain Python name for {', '.join(sorted(missing))}")
        return None
    fill = string.Template
    imports = [_import_line(fill(line).substitute(slots)) for line in rule.fix.imports]
    guards = []
    for name in rule.conditions:
        condition = knowledge.conditions[name]
        guards.append(condition.guard)
        imports.extend(condition.imports)
    if rule.scenario == 1:
        code = _guarded(fill(rule.fix.code).substitute(slots), guards)
        return FixPlan("rollback", profile.rollback, code, tuple(dict.fromkeys(imports)), None, None, profile.id)
    imports.extend(profile.repair_group_imports)
    recv = _guarded(fill(rule.fix.recv).substitute(slots), guards)
    send = _guarded(fill(rule.fix.send).substitute(slots), guards)
    return FixPlan("repair", profile.recv, recv, tuple(dict.fromkeys(imports)), profile.send, send, profile.id)


def _import_line(line: str) -> str:
    """`from $parent import $alias` for a top-level module renders as `import alias`."""
    return "import " + line.removeprefix("from  import ") if line.startswith("from  import ") else line


def _guarded(code: str, guards: list[str]) -> str:
    code = textwrap.dedent(code).strip("\n") + "\n"
    if not guards:
        return code
    return f"if {' and '.join(guards)}:\n" + textwrap.indent(code, "    ")
