"""Suspects: for an unsafe-data error logged without a traceback, the globals it most likely read.

Since mind-cluster v7.3.0 MindIO logs only the error's message, so no frame names the tensor. The
suspects follow the model written down in docs/diagnose.md (#how-suspects-are-ranked), step by step:

1. exists in this run: the arguments dump shows the features that make the rule's global exist
   (its conditions), and the releases the job ran name it (`Environment.job_releases`);
2. survives the recovery: not every generation the job may have run (`Environment.possible`) resets
   it (its profile's `resets`), and the fault the log shows marked memory unsafe (`read_fault`);
3. which one raised: after a UCE that marked only the blocks it hit, the more device memory a global
   holds (its rule's `device_bytes`, from the dump) the likelier it was hit; otherwise, and between
   equals, the step's first read (`first_read`) decides. The first three always carry the globals of
   the run's own switches (features that are not `common`), so a larger generic global cannot push
   them out;
4. confidence: "high" only for a lone survivor of a fault that marked every tensor; two or more, or a
   fault that marks only some blocks, are "medium" up to the third and "low" after; no dump, or a
   fault that marked nothing, "low".

What the log does not tell (no dump, no release, no generation, no fault kind) widens the list and
lowers the confidence; it is said, never guessed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from packaging.version import Version

from unsafe_doctor.knowledge.classify import Classified, Confidence, classify_with_rule
from unsafe_doctor.knowledge.loading import shipped_knowledge_dir
from unsafe_doctor.knowledge.rules import READ_STAGES, AdaptorProfile, Rule, RuleMatch, device_bytes
from unsafe_doctor.knowledge.subject import Subject, TensorRef
from unsafe_doctor.knowledge.writers import load_writers
from unsafe_doctor.log.arguments import RunArguments
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.log.recovery import FaultReading, LossScaling

if TYPE_CHECKING:
    from unsafe_doctor.knowledge.context import RunContext

SHORT = 3  # the suspects worth a fix first: the target puts the culprit among them


@dataclass(frozen=True)
class Suspect:
    rule: Rule
    tensor: TensorRef  # the global the rule names, as a finding's tensor would be
    classification: Classified  # the rule's scenario and its fix in the adaptor's generation
    why: tuple[str, ...]  # the evidence, one fact a line: which argument, which release, which generation
    confidence: Confidence
    alternatives: tuple[str, ...] = ()  # ids of the rules for the same global in other releases or modules (`_by_global`)

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
    fault: FaultReading = FaultReading("unknown")  # what the fault before the error marked unsafe
    generations: tuple[AdaptorProfile, ...] = ()  # the generations whose resets were weighed (`Environment.possible`)
    shown: tuple[AdaptorProfile, ...] = ()  # those the adaptor or the log's lines show: one, or a tie; none: not shown


def shortlist(
    context: RunContext, arguments: RunArguments | None, loss_scaling: LossScaling | None, fault: FaultReading
) -> Shortlist:
    """The suspects of an untraced unsafe-data error, most likely first, for the generations the job may
    have run, the releases the environment shows and the fault the log shows (`read_fault`)."""
    environment = context.environment
    generation = environment.generation
    generations = environment.possible or ((generation,) if generation is not None else ())
    evidence = _Evidence(context, arguments, generation, generations, loss_scaling, environment.job_releases(), fault)
    kept: list[_Kept] = []
    excluded: list[Excluded] = []
    for rule in context.knowledge.rules:
        if rule.first_read is None:
            continue
        reason = evidence.ruled_out(rule)
        if reason is not None:
            excluded.append(Excluded(rule.id, reason))
            continue
        kept.append(evidence.kept(rule))
    alternatives: dict[str, tuple[str, ...]] = {}
    chosen = []
    for group in _by_global(kept, evidence):
        newest = max(group, key=lambda item: _lowest_version(item.rule))  # release not known: the newest names it
        alternatives[newest.rule.id] = tuple(item.rule.id for item in group if item is not newest)
        chosen.append(newest)
    ordered = _with_own_switches(sorted(chosen, key=evidence.order))
    suspects = [_suspect(item, alternatives[item.rule.id], evidence) for item in ordered]
    ranked = tuple(
        evidence.ranked(suspect, own=item.own, position=position, count=len(suspects))
        for position, (suspect, item) in enumerate(zip(suspects, ordered, strict=True))
    )
    return Shortlist(ranked, tuple(excluded), arguments, generation, fault, generations, environment.shown_generations())


@dataclass(frozen=True)
class _Kept:
    rule: Rule
    features: tuple[str, ...]  # the arguments that make its global exist, as printed
    specificity: int  # how many conditions it needs
    size: float | None  # the device memory it holds, in bytes, from the dump; None: not known
    own: bool  # a switch of the run's own (a feature the dump shows on that is not `common`) creates it


@dataclass(frozen=True)
class _Evidence:
    context: RunContext
    arguments: RunArguments | None
    generation: AdaptorProfile | None
    generations: tuple[AdaptorProfile, ...]  # the generations the job may have run: a reset counts when all do it
    loss_scaling: LossScaling | None
    # framework -> the releases the job may have run, and where that comes from; absent: unknown
    releases: dict[str, tuple[tuple[Version, ...], str]]
    fault: FaultReading

    def ruled_out(self, rule: Rule) -> str | None:
        """Why the rule's global cannot be the one, or None when the log leaves it possible."""
        if self.generations and all(rule.id in profile.resets for profile in self.generations):
            return f"the {_either(self.generations)} adaptor's rollback and repair already reset it"
        found = self.releases.get(rule.framework or "")
        if found and rule.versions is not None and not any(rule.versions.contains(v, prereleases=True) for v in found[0]):
            return f"{rule.framework} {_listed(found[0])} ({found[1]}) is not {rule.versions}"
        if self.loss_scaling is not None and any(block.loss_scaling not in (None, self.loss_scaling) for block in rule.matches):
            return "the log shows another loss scaling"
        arguments = self.arguments.values if self.arguments is not None else {}
        for name in self.context.knowledge.features(rule) if self.arguments is not None else ():
            condition = self.context.knowledge.conditions[name]
            if condition.switches and not condition.on_in(arguments):
                read = (arguments.get(switch) for switch in condition.switches)
                printed = ", ".join(
                    f"{switch} is {value if value is not None else 'not in the arguments'}"
                    for switch, value in zip(condition.switches, read, strict=True)
                )
                return f"{printed}: {name} is off"
        return self.unwritten(rule)

    def unwritten(self, rule: Rule) -> str | None:
        """Why no code the step runs in this configuration writes the global (`knowledge.writers`)."""
        if self.arguments is None:
            return None
        releases = {framework: found[0] for framework, found in self.releases.items()}
        writers = load_writers(shipped_knowledge_dir())
        return writers.unwritten(rule.id, rule.versions, rule.framework, self.arguments.values, releases)

    def kept(self, rule: Rule) -> _Kept:
        """A rule the log leaves possible, with what the dump says of it."""
        knowledge = self.context.knowledge
        names = knowledge.features(rule)
        values = self.arguments.values if self.arguments is not None else None
        switches = (switch for name in names for switch in knowledge.conditions[name].on_in(values or {}))
        features = tuple(f"{switch} = {values.get(switch)}" for switch in switches) if values else ()
        size = device_bytes(rule.device_bytes, values) if rule.device_bytes and values is not None else None
        own = values is not None and any(not knowledge.conditions[name].common for name in names)
        return _Kept(rule, features, len(names), size, own)

    def order(self, kept: _Kept) -> tuple:
        """Step 3: after a UCE that marked only the blocks it hit, the larger global first (sizes not known
        after those known); then, and alone after any other fault, where the step first reads it; then
        the more specific features first; then knowledge order."""
        rule = kept.rule
        stage = READ_STAGES.index(rule.first_read or READ_STAGES[-1])
        read = (stage, -kept.specificity, self.context.knowledge.rules.index(rule))
        if self.fault.marking == "partial":
            return (kept.size is None, -(kept.size or 0), *read)
        return read

    def release_known(self, rule: Rule) -> bool:
        """One release of the rule's framework, or a rule that holds for all."""
        return rule.framework is None or rule.versions is None or len(self.releases.get(rule.framework, ((),))[0]) == 1

    def ranked(self, suspect: Suspect, *, own: bool, position: int, count: int) -> Suspect:
        """Step 4. "high": the only survivor, of a fault that marked every device tensor, created by a
        switch of the run's own (not one most runs of the stack turn on: a run whose state is in its own
        code has those too, and a log never rules that state out), with the dump, its release and the
        generation known; else "medium" up to the third and "low" after; "low" for all without a dump or
        when the fault marked nothing."""
        marking = self.fault.marking
        known = self.release_known(suspect.rule) and self.generation is not None and len(self.generations) == 1
        if self.arguments is None or marking == "none-marked":
            confidence: Confidence = "low"
        elif count == 1 and marking == "all-marked" and own and known:
            confidence = "high"
        else:
            confidence = "medium" if position < SHORT else "low"
        return replace(suspect, confidence=confidence)


def _either(generations: tuple[AdaptorProfile, ...]) -> str:
    return _listed(profile.id for profile in generations)


def _listed(items: Iterable[object]) -> str:
    return " or ".join(map(str, items))


def _with_own_switches(ordered: list[_Kept]) -> list[_Kept]:
    """The most likely first, then the globals of the run's own switches up to the third place: a larger
    generic global (one every run of the stack has) leads, but never pushes them out of the first three."""
    if not ordered:
        return ordered
    own = [item for item in ordered[1:] if item.own][: SHORT - 1]
    return [ordered[0], *own, *(item for item in ordered[1:] if item not in own)]


def _by_global(kept: list[_Kept], evidence: _Evidence) -> list[list[_Kept]]:
    """Rules that name one global, together, so that it is listed once: rules for different releases
    (same framework, features and first read) when the release is not known to one, and rules for one
    name in two modules of a release (same name, features, first read and scenario: MindSpeed keeps
    AG_SHARED_EXPERTS_INPUTS in moe_utils and, for its features-manager path, in moe_common; a
    MindSpeed-LLM release imports both, so neither the log nor the index tells which the step read)."""
    groups: dict[tuple, list[_Kept]] = {}
    for item in kept:
        rule = item.rule
        shared = (rule.framework, evidence.context.knowledge.features(rule), rule.first_read, rule.scenario)
        variable = _named_block(rule).variable
        if not evidence.release_known(rule):
            key: tuple = ("release", *shared)
        elif variable is not None:
            key = ("name", variable, *shared)
        else:
            key = ("rule", rule.id)
        groups.setdefault(key, []).append(item)
    return list(groups.values())


def _suspect(kept: _Kept, alternatives: tuple[str, ...], evidence: _Evidence) -> Suspect:
    rule = kept.rule
    why = list(kept.features)
    if evidence.arguments is None:
        why.append("no arguments dump in the log: whether the job ran this feature is not known")
    found = evidence.releases.get(rule.framework or "")
    if rule.framework is not None and rule.versions is not None:
        release = f"{_listed(found[0])} ({found[1]})" if found else f"release unknown: named as in {rule.versions}"
        why.append(f"{rule.framework} {release}")
    why.append(_survives(rule, evidence))
    if evidence.fault.marking == "partial" and evidence.arguments is not None:  # no dump: no size, said above
        why.append(_size_said(kept))
    tensor = _tensor(rule)
    verdict = classify_with_rule(rule, Subject(tensor, None, None), evidence.context)
    return Suspect(rule, tensor, verdict, tuple(why), "low", alternatives)  # its confidence: `_Evidence.ranked`


def _survives(rule: Rule, evidence: _Evidence) -> str:
    """Step 2 in words: the generations weighed that leave the global unsafe, and which were weighed."""
    generations = evidence.generations
    if not generations:
        return "adaptor generation not shown by the log"
    keep = tuple(profile for profile in generations if rule.id not in profile.resets)
    considered = ", ".join(profile.id for profile in generations)
    if len(generations) == 1:
        said = f"not reset by the {generations[0].id} adaptor"
    elif keep == generations:
        said = f"not reset by any generation the job may have run ({considered})"
    else:
        said = f"not reset by the {_either(keep)} adaptor, which the job may have run (generations considered: {considered})"
    shown = evidence.context.environment.shown_generations()  # one decided, or a tie of the log's lines
    return said if shown else f"adaptor generation not shown by the log: {said}"


def _size_said(kept: _Kept) -> str:
    """Step 3's weight in words: the device memory the global holds, or that it is not known."""
    expression = kept.rule.device_bytes
    if kept.size is None:
        why = f"{expression} not in the dump" if expression else "the rule gives no size"
        return f"device memory it holds not known ({why}): ranked after those whose size is known"
    return f"holds about {_bytes(kept.size)} of device memory ({expression})"


def _bytes(size: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


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
    name = GlobalName(module, block.owner, block.variable)
    return TensorRef(name.qualname or block.variable_regex or rule.title, name)
