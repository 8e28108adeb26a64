"""Suspects: for an unsafe-data error logged without a traceback, the globals it most likely read.

Since mind-cluster v7.3.0 MindIO logs only the error's message, so no frame names the tensor. What
the log still tells narrows it down: the arguments dump says which features the job ran (each rule
says, through its conditions, which features make its global exist), the framework releases say
which of a global's names and modules the job had, and the adaptor generation that ran says what
its rollback and repair already reset (its profile's `resets`). A rule is a suspect when its global
exists in such a job and nothing resets it; suspects come in the order a step first reads them
(`first_read`: the first unsafe read is the one that raises), the more specific features first
within a stage. What the log does not tell (no dump, no release, no generation) widens the list
and lowers the confidence; it is said, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from unsafe_doctor.knowledge.classify import Classified, Confidence, classify_with_rule
from unsafe_doctor.knowledge.rules import READ_STAGES, AdaptorProfile, Rule
from unsafe_doctor.knowledge.subject import Subject, TensorRef
from unsafe_doctor.log.arguments import RunArguments
from unsafe_doctor.log.recovery import LossScaling

if TYPE_CHECKING:
    from unsafe_doctor.knowledge.context import RunContext

SHORT = 3  # the suspects worth a fix first: the target puts the culprit among them
_CONFIDENCES: tuple[Confidence, ...] = ("low", "medium", "high")


@dataclass(frozen=True)
class Suspect:
    rule: Rule
    tensor: TensorRef  # the global the rule names, as a finding's tensor would be
    classification: Classified  # the rule's scenario and its fix in the adaptor's generation
    why: tuple[str, ...]  # the evidence, one fact a line: which argument, which release, which generation
    confidence: Confidence
    alternatives: tuple[str, ...] = ()  # ids of the rules for the same global in other releases (release unknown)


@dataclass(frozen=True)
class Excluded:
    rule: str
    why: str


@dataclass(frozen=True)
class Shortlist:
    suspects: tuple[Suspect, ...]
    excluded: tuple[Excluded, ...]  # rules with a first read that the evidence ruled out, each with why
    arguments: RunArguments | None  # the dump read; None: the features are unknown
    generation: AdaptorProfile | None  # the adaptor generation the log shows; None: it does not tell


def shortlist(
    context: RunContext,
    arguments: RunArguments | None,
    generation: AdaptorProfile | None,
    loss_scaling: LossScaling | None,
) -> Shortlist:
    """The suspects of an untraced unsafe-data error, most likely first."""
    kept: list[tuple[Rule, tuple[str, ...], int]] = []
    excluded: list[Excluded] = []
    for rule in context.knowledge.rules:
        if rule.first_read is None:
            continue
        reason = _ruled_out(rule, context, arguments, generation, loss_scaling)
        if reason is not None:
            excluded.append(Excluded(rule.id, reason))
            continue
        why = _features_on(rule, context, arguments)
        kept.append((rule, why, len(context.knowledge.features(rule))))
    groups = _by_global(kept, context)
    ordered = sorted(groups, key=lambda group: _read_order(group[0][0], group[0][2], context))
    suspects = [_suspect(group, context, arguments, generation) for group in ordered]
    return Shortlist(tuple(map(_ranked, suspects, range(len(suspects)))), tuple(excluded), arguments, generation)


def _ranked(suspect: Suspect, position: int) -> Suspect:
    """Confidence that this is the tensor, not only that it exists: the evidence's, capped by how many
    come before it (the step reads them first: had one been unsafe, it would have raised)."""
    cap: Confidence = "high" if position == 0 else "medium" if position < SHORT else "low"
    return replace(suspect, confidence=min(suspect.confidence, cap, key=_CONFIDENCES.index))


def _ruled_out(
    rule: Rule,
    context: RunContext,
    arguments: RunArguments | None,
    generation: AdaptorProfile | None,
    loss_scaling: LossScaling | None,
) -> str | None:
    """Why the rule's global cannot be the one, or None when the log leaves it possible."""
    if generation is not None and rule.id in generation.resets:
        return f"the {generation.id} adaptor's rollback and repair already reset it"
    environment = context.environment
    version = environment.versions.get(rule.framework) if rule.framework else None
    if version is not None and rule.versions is not None and not rule.versions.contains(version, prereleases=True):
        return f"{rule.framework} {version} ({environment.origins[rule.framework or '']}) is not {rule.versions}"
    if loss_scaling is not None and any(block.loss_scaling not in (None, loss_scaling) for block in rule.matches):
        return "the log shows another loss scaling"
    if arguments is None:
        return None
    for name in context.knowledge.features(rule):
        condition = context.knowledge.conditions[name]
        if condition.switch is None:
            continue
        printed = arguments.get(condition.switch)
        if printed is None or not condition.holds_for(printed):
            return f"{condition.switch} is {printed if printed is not None else 'not in the arguments'}: {name} is off"
    return None


def _features_on(rule: Rule, context: RunContext, arguments: RunArguments | None) -> tuple[str, ...]:
    """The arguments that make the global exist, as the dump printed them."""
    if arguments is None:
        return ()
    switches = (context.knowledge.conditions[name].switch for name in context.knowledge.features(rule))
    return tuple(f"{switch} = {arguments.get(switch)}" for switch in switches if switch is not None)


def _read_order(rule: Rule, features: int, context: RunContext) -> tuple[int, int, int]:
    """Where the step first reads the global; then the more specific features first; then knowledge order."""
    return READ_STAGES.index(rule.first_read or READ_STAGES[-1]), -features, context.knowledge.rules.index(rule)


def _by_global(
    kept: list[tuple[Rule, tuple[str, ...], int]], context: RunContext
) -> list[list[tuple[Rule, tuple[str, ...], int]]]:
    """Rules that name one global in different releases (same framework, features and first read),
    together: when the release is unknown they are one suspect, not several."""
    groups: dict[tuple, list[tuple[Rule, tuple[str, ...], int]]] = {}
    for item in kept:
        rule = item[0]
        known = rule.framework is None or rule.versions is None or rule.framework in context.environment.versions
        key = (rule.id,) if known else (rule.framework, context.knowledge.features(rule), rule.first_read, rule.scenario)
        groups.setdefault(key, []).append(item)
    return list(groups.values())


def _suspect(
    group: list[tuple[Rule, tuple[str, ...], int]],
    context: RunContext,
    arguments: RunArguments | None,
    generation: AdaptorProfile | None,
) -> Suspect:
    newest = max(group, key=lambda item: _lowest_version(item[0]))  # release unknown: the newest names it
    rule, features, _ = newest
    why = list(features)
    if arguments is None:
        why.append("no arguments dump in the log: whether the job ran this feature is not known")
    environment = context.environment
    known = rule.framework is not None and rule.framework in environment.versions
    if known:
        framework = rule.framework or ""
        why.append(f"{framework} {environment.versions[framework]} ({environment.origins[framework]})")
    elif rule.framework is not None and rule.versions is not None:
        why.append(f"{rule.framework} release unknown: named as in {rule.versions}")
    why.append(
        f"not reset by the {generation.id} adaptor" if generation is not None else "adaptor generation not shown by the log"
    )
    complete = (known or rule.versions is None) and generation is not None
    confidence: Confidence = "low" if arguments is None else "high" if complete else "medium"
    tensor = _tensor(rule)
    subject = Subject(tensor, None, None)
    alternatives = tuple(item[0].id for item in group if item[0] is not rule)
    return Suspect(rule, tensor, classify_with_rule(rule, subject, context), tuple(why), confidence, alternatives)


def _lowest_version(rule: Rule) -> tuple[int, ...]:
    """The lowest release a rule's specifier admits, for ordering rules of one global by release."""
    bounds = [spec.version for spec in rule.versions or () if spec.operator in (">=", ">", "==", "~=")]
    return max((tuple(int(part) for part in bound.split(".") if part.isdigit()) for bound in bounds), default=())


def _tensor(rule: Rule) -> TensorRef:
    """The global a rule names: its first match block that names a variable (else its first), with its
    module (when not a pattern) and owner; a block naming none gives its pattern as the expression."""
    block = next((block for block in rule.matches if block.variable), rule.match)
    module = block.module if block.module is not None and "*" not in block.module else None
    variable = block.variable
    expression = ".".join(part for part in (block.owner, variable) if part) or block.variable_regex or rule.title
    return TensorRef(expression, variable, module, block.owner)
