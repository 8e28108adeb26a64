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

from packaging.version import Version

from unsafe_doctor.knowledge.classify import Classified, Confidence, classify_with_rule
from unsafe_doctor.knowledge.loading import shipped_knowledge_dir
from unsafe_doctor.knowledge.rules import READ_STAGES, AdaptorProfile, Rule, RuleMatch
from unsafe_doctor.knowledge.subject import Subject, TensorRef
from unsafe_doctor.knowledge.writers import load_writers
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

    @property
    def block(self) -> RuleMatch:
        """The rule's match block that names the global (`tensor` is made from it)."""
        return _named_block(self.rule)


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


def shortlist(context: RunContext, arguments: RunArguments | None, loss_scaling: LossScaling | None) -> Shortlist:
    """The suspects of an untraced unsafe-data error, most likely first, for the generation and the
    releases the environment shows (`Environment.generation`, `Environment.job_releases`)."""
    environment = context.environment
    generation = environment.generation
    evidence = _Evidence(context, arguments, generation, loss_scaling, environment.job_releases())
    kept: list[_Kept] = []
    excluded: list[Excluded] = []
    for rule in context.knowledge.rules:
        if rule.first_read is None:
            continue
        reason = evidence.ruled_out(rule)
        if reason is not None:
            excluded.append(Excluded(rule.id, reason))
            continue
        kept.append(_Kept(rule, evidence.features_on(rule), len(context.knowledge.features(rule))))
    groups = _by_global(kept, evidence)
    ordered = sorted(groups, key=lambda group: _read_order(group[0], context))
    suspects = [_suspect(group, evidence) for group in ordered]
    return Shortlist(tuple(map(_ranked, suspects, range(len(suspects)))), tuple(excluded), arguments, generation)


@dataclass(frozen=True)
class _Kept:
    rule: Rule
    features: tuple[str, ...]  # the arguments that make its global exist, as printed
    specificity: int  # how many conditions it needs


@dataclass(frozen=True)
class _Evidence:
    context: RunContext
    arguments: RunArguments | None
    generation: AdaptorProfile | None
    loss_scaling: LossScaling | None
    # framework -> the releases the job may have run, and where that comes from; absent: unknown
    releases: dict[str, tuple[tuple[Version, ...], str]]

    def ruled_out(self, rule: Rule) -> str | None:
        """Why the rule's global cannot be the one, or None when the log leaves it possible."""
        if self.generation is not None and rule.id in self.generation.resets:
            return f"the {self.generation.id} adaptor's rollback and repair already reset it"
        found = self.releases.get(rule.framework or "")
        if found and rule.versions is not None and not any(rule.versions.contains(v, prereleases=True) for v in found[0]):
            return f"{rule.framework} {_listed(found[0])} ({found[1]}) is not {rule.versions}"
        if self.loss_scaling is not None and any(block.loss_scaling not in (None, self.loss_scaling) for block in rule.matches):
            return "the log shows another loss scaling"
        for name in self.context.knowledge.features(rule) if self.arguments is not None else ():
            condition = self.context.knowledge.conditions[name]
            if condition.switch is None:
                continue
            printed = self.arguments.get(condition.switch) if self.arguments else None
            if printed is None or not condition.holds_for(printed):
                return f"{condition.switch} is {printed if printed is not None else 'not in the arguments'}: {name} is off"
        return self.unwritten(rule)

    def unwritten(self, rule: Rule) -> str | None:
        """Why no code the step runs in this configuration writes the global (`knowledge.writers`)."""
        if self.arguments is None:
            return None
        releases = {framework: found[0] for framework, found in self.releases.items()}
        writers = load_writers(shipped_knowledge_dir())
        return writers.unwritten(rule.id, rule.versions, rule.framework, self.arguments.values, releases)

    def features_on(self, rule: Rule) -> tuple[str, ...]:
        if self.arguments is None:
            return ()
        conditions = self.context.knowledge.conditions
        switches = (conditions[name].switch for name in self.context.knowledge.features(rule))
        return tuple(f"{switch} = {self.arguments.get(switch)}" for switch in switches if switch is not None)

    def release_known(self, rule: Rule) -> bool:
        """One release of the rule's framework, or a rule that holds for all."""
        return rule.framework is None or rule.versions is None or len(self.releases.get(rule.framework, ((),))[0]) == 1


def _listed(versions: tuple[Version, ...]) -> str:
    return " or ".join(map(str, versions))


def _ranked(suspect: Suspect, position: int) -> Suspect:
    """Confidence that this is the tensor, not only that it exists: the evidence's, capped by how many
    come before it (the step reads them first: had one been unsafe, it would have raised)."""
    cap: Confidence = "high" if position == 0 else "medium" if position < SHORT else "low"
    return replace(suspect, confidence=min(suspect.confidence, cap, key=_CONFIDENCES.index))


def _read_order(kept: _Kept, context: RunContext) -> tuple[int, int, int]:
    """Where the step first reads the global; then the more specific features first; then knowledge order."""
    rule = kept.rule
    return READ_STAGES.index(rule.first_read or READ_STAGES[-1]), -kept.specificity, context.knowledge.rules.index(rule)


def _by_global(kept: list[_Kept], evidence: _Evidence) -> list[list[_Kept]]:
    """Rules that name one global in different releases (same framework, features and first read),
    together: when the release is not known to one, they are one suspect, not several."""
    groups: dict[tuple, list[_Kept]] = {}
    for item in kept:
        rule = item.rule
        features = evidence.context.knowledge.features(rule)
        key = (rule.id,) if evidence.release_known(rule) else (rule.framework, features, rule.first_read, rule.scenario)
        groups.setdefault(key, []).append(item)
    return list(groups.values())


def _suspect(group: list[_Kept], evidence: _Evidence) -> Suspect:
    kept = max(group, key=lambda item: _lowest_version(item.rule))  # release not known: the newest names it
    rule = kept.rule
    why = list(kept.features)
    if evidence.arguments is None:
        why.append("no arguments dump in the log: whether the job ran this feature is not known")
    found = evidence.releases.get(rule.framework or "")
    if rule.framework is not None and rule.versions is not None:
        release = f"{_listed(found[0])} ({found[1]})" if found else f"release unknown: named as in {rule.versions}"
        why.append(f"{rule.framework} {release}")
    generation = evidence.generation
    why.append(f"not reset by the {generation.id} adaptor" if generation else "adaptor generation not shown by the log")
    complete = evidence.release_known(rule) and generation is not None
    confidence: Confidence = "low" if evidence.arguments is None else "high" if complete else "medium"
    tensor = _tensor(rule)
    verdict = classify_with_rule(rule, Subject(tensor, None, None), evidence.context)
    alternatives = tuple(item.rule.id for item in group if item.rule is not rule)
    return Suspect(rule, tensor, verdict, tuple(why), confidence, alternatives)


def _lowest_version(rule: Rule) -> tuple[int, ...]:
    """The lowest release a rule's specifier admits, for ordering rules of one global by release."""
    bounds = [spec.version for spec in rule.versions or () if spec.operator in (">=", ">", "==", "~=")]
    return max((tuple(int(part) for part in bound.split(".") if part.isdigit()) for bound in bounds), default=())


def _named_block(rule: Rule) -> RuleMatch:
    """A rule's first match block that names a variable, else its first."""
    return next((block for block in rule.matches if block.variable), rule.match)


def _tensor(rule: Rule) -> TensorRef:
    """The global a rule names (`_named_block`), with its module (when not a pattern) and owner; a
    block naming none gives its pattern as the expression."""
    block = _named_block(rule)
    module = block.module if block.module is not None and "*" not in block.module else None
    variable = block.variable
    expression = ".".join(part for part in (block.owner, variable) if part) or block.variable_regex or rule.title
    return TensorRef(expression, variable, module, block.owner)
