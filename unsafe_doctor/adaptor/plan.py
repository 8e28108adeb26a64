"""Plan each finding's fix as blocks in the user's recovery adaptor, and plan taking them out again.

A fix becomes one block at the end of an adaptor function, before a trailing `return`: the rollback
function for scenario 1; for scenario 2 the send function (replica side) and the receive function
(faulty side), planned together so that their transfers pair up in the same order. A block reads

    # unsafe-doctor: begin <key>
    # <what it does>
    <the rule's code, in the function's own names; for scenario 2 inside a loop over the
     (source, destination) rank pairs>
    # unsafe-doctor: end <key>

The block is written inline, for the adaptor's maintainer to read (``knowledge.render.block``): it
reads the names the file already binds (its `torch`, its `dist`, its repair group or the getter it
imports), and imports only what the file lacks. A rule's `repair_with` adds the fixes of the state
the same step reads next, unless the adaptor's generation resets it itself.

`<key>` is the rule id, or `<rule id>:<module>.<variable>` when the rule is not about one named
variable, or `<template id>:<module>.<variable>` for the templates that heuristic verdicts use.
A function that already holds a block with the same key is left alone; a revert removes exactly the
marked lines. The sentinel's block (`sentinel_install`) is planned by the same code: it stays the
last block of its function, so a fix written later goes before it; `fix --revert` leaves it.

A plan reads files and writes none: `splice` places the blocks and checks that the result compiles,
`write` writes it. Nothing here prints or exits: refusals raise UsageError.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from unsafe_doctor.adaptor.code import (
    Adaptor,
    AdaptorFunction,
    BlockSite,
    adaptor_files,
    detached_site,
    read_adaptor_file,
    without_blocks,
)
from unsafe_doctor.adaptor.existing_reset import AlreadyReset, existing_reset
from unsafe_doctor.adaptor.splice import FileEdit, checked_edit, early_return_notes, has_block, insert_blocks, insertion_point
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.classify import (
    Classified,
    ClassifiedSubject,
    Unclassified,
    classify_with_rule,
    generic_template,
)
from unsafe_doctor.knowledge.context import RunContext
from unsafe_doctor.knowledge.render.block import marked_block, render
from unsafe_doctor.knowledge.render.template import FixPlan, NoFix
from unsafe_doctor.knowledge.rules import AdaptorProfile, KnowledgeBase, Rule, is_safe_dotted, map_parameters
from unsafe_doctor.knowledge.subject import Subject
from unsafe_doctor.knowledge.versions import Environment
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.recovery_code.model import Role
from unsafe_doctor.source.markers import SENTINEL_KEYS

if TYPE_CHECKING:
    from unsafe_doctor.recovery_code.coverage import AdaptorCoverage


@dataclass(frozen=True)
class Planned:
    """A finding whose fix is in the plan's edits, or already in the adaptor."""

    finding: int  # 1-based, in the order the findings were given
    key: str  # the marker key of its blocks


@dataclass(frozen=True)
class Skipped:
    """A finding with no fix to write."""

    finding: int
    reason: str
    suspect: int | None = None  # the suspect's number when a person chose it (`--suspect N`): how they know it

    def __str__(self) -> str:
        named = f"finding {self.finding}" if self.suspect is None else f"suspect {self.suspect}"
        return f"{named}: {self.reason}"


# A fix that must not be written (a log's name that is no Python name, an adaptor function missing or
# ambiguous, an edit that would not compile) is refused with UsageError: it stops the whole command
# before anything is shown or written.
FixOutcome = Planned | Skipped | AlreadyReset


@dataclass(frozen=True)
class Plan:
    edits: tuple[FileEdit, ...]  # files that change, each with every change for it
    present: tuple[str, ...]  # blocks the adaptor already holds
    outcomes: tuple[FixOutcome, ...]  # one per finding given
    notes: tuple[str, ...]
    profile: str | None = None  # the adaptor profile the blocks were written for, and why it
    profile_why: str | None = None

    @property
    def already_reset(self) -> tuple[AlreadyReset, ...]:
        return tuple(outcome for outcome in self.outcomes if isinstance(outcome, AlreadyReset))

    @property
    def skipped(self) -> tuple[Skipped | AlreadyReset, ...]:
        """The findings left without a new block."""
        return tuple(outcome for outcome in self.outcomes if not isinstance(outcome, Planned))

    def diff(self) -> str:
        return "".join(edit.diff() for edit in self.edits)


# --- planning a fix ------------------------------------------------------------------------------


def plan_fix(
    findings: Sequence[ClassifiedSubject],
    context: RunContext,
    functions: Mapping[Role, str] | None = None,
    parameters: Mapping[str, Sequence[str]] | None = None,
) -> Plan:
    """The edits that write the fix of each finding into the adaptor; reads files, writes nothing.

    `functions` names the adaptor functions per role where they differ from the profile's names;
    `parameters` the parameters that hold a role (`knowledge.map_parameters`: `peer`, `group` too).
    """
    for item in findings:
        _check_log_names(item.subject)
    environment = context.environment
    # The fixes were rendered with the profile's repair-group expression: a `group` parameter given
    # here replaces that expression in each block, as a group the function builds itself does.
    groups = (parameters or {}).get("group") or ()
    if len(groups) > 1:
        raise UsageError(f"--parameter group: one parameter, not {', '.join(groups)}")
    group = groups[0] if groups else None
    profile = map_parameters(environment.profile, {role: name for role, name in (parameters or {}).items() if role != "group"})
    requests: list[_Request] = []
    coverage: AdaptorCoverage | None = None  # the adaptor read once, when a finding has a fix
    outcomes: list[FixOutcome] = []
    notes: list[str] = []
    for number, item in enumerate(findings, 1):
        classification = item.classification
        if isinstance(classification, Unclassified):
            outcomes.append(
                Skipped(number, "unclassified: scenario 1 or 2 is not known, so there is no fix to write", item.suspect)
            )
        elif isinstance(classification.fix, NoFix):
            outcomes.append(Skipped(number, classification.fix.reason, item.suspect))
        elif (unresolved := _unresolved_module(item.subject)) is not None:
            outcomes.append(Skipped(number, unresolved, item.suspect))
        else:
            key = marker_key(item.subject, classification, context.knowledge)
            if coverage is None and environment.adaptor is not None:
                from unsafe_doctor.recovery_code.coverage import AdaptorCoverage  # the audit's walker: only with an adaptor

                coverage = AdaptorCoverage(environment.adaptor, environment.profile, context.workspace)
            existing = existing_reset(item.subject, classification, key, context, coverage)
            if isinstance(existing, AlreadyReset):
                outcomes.append(replace(existing, finding=number))
                continue
            outcomes.append(Planned(number, key))
            requests.extend(_requests(item.subject, key, classification.fix, dict(functions or {})))
            notes.extend(f"finding {number}: {note}" for note in (*classification.notes, *existing))
            for rule, companion, subject in _companions(item.subject, classification, context, findings):
                requests.extend(_requests(subject, rule.id, companion, dict(functions or {})))
                notes.append(
                    f"finding {number}: {rule.id} is repaired with it: {_tensor_name(subject)} is the state "
                    f"the same step reads next, and adaptor profile {environment.profile.id} does not "
                    "reset it"
                )
    if not requests:
        return Plan((), (), tuple(outcomes), ())
    blocks = plan_blocks(requests, environment, profile, group)
    return replace(
        blocks,
        outcomes=tuple(outcomes),
        notes=tuple(dict.fromkeys((*notes, *blocks.notes))),
        profile=profile.id,
        profile_why=environment.profile_why,
    )


def _unresolved_module(subject: Subject) -> str | None:
    """Why a fix cannot name the global's module: the log reads it through a name (`state._EMA`) that,
    with no source read, is only a guess at the module (`state` for `toytrain.state`)."""
    tensor = subject.tensor
    if tensor is None or tensor.name.module is None or subject.source_file is not None or tensor.runs_as_main:
        return None
    if tensor.expression.split(".")[0] != tensor.name.module.rpartition(".")[2]:
        return None
    return (
        f"the log reads {tensor.expression} through the name {tensor.name.module}, which without the job's source "
        f"is a guess at its module: give --source-root so that the fix imports the module that holds it"
    )


def _companions(
    subject: Subject, classification: Classified, context: RunContext, findings: Sequence[ClassifiedSubject]
) -> list[tuple[Rule, FixPlan, Subject]]:
    """The rules the finding's rule must be repaired with (its `repair_with`: the model's state the
    same step reads next), each with its fix for the same owner, where the generation neither
    rebuilds the model nor resets it, and no finding of the log names it already."""
    rule = context.knowledge.rule(classification.rule) if classification.rule else None
    if rule is None or subject.tensor is None or context.environment.profile.rebuilds_model:
        return []  # a generation that rebuilds the model gives its buffers back fresh
    named = {item.classification.rule for item in findings if isinstance(item.classification, Classified)}
    found: list[tuple[Rule, FixPlan, Subject]] = []
    for rule_id in rule.repair_with:
        companion = context.knowledge.rule(rule_id)
        if companion is None or rule_id in named or rule_id in context.environment.profile.resets:
            continue
        variable = companion.match.variable
        if variable is None:  # a rule for globals by pattern names no one state to repair
            continue
        name = GlobalName(companion.match.module or subject.tensor.name.module, subject.tensor.name.owner, variable)
        tensor = replace(subject.tensor, expression=variable, name=name)
        fixed = classify_with_rule(companion, replace(subject, tensor=tensor), context)
        if isinstance(fixed.fix, FixPlan):
            found.append((companion, fixed.fix, replace(subject, tensor=tensor)))
    return found


@dataclass(frozen=True)
class Preview:
    """A finding's block to paste, for `diagnose` to print under the finding where `fix` cannot write it."""

    function: str
    side: str  # "on the faulty rank" | "on the replica rank" | "" (a rollback)
    lines: tuple[str, ...]  # the block, markers included, at its function's indentation
    imports: tuple[str, ...] = ()  # what goes at the top of the file (an import in the function makes a local)


def preview(item: ClassifiedSubject, context: RunContext) -> tuple[Preview, ...]:
    """The finding's fix block by block (its companions' too), to paste at the end of a function with the
    profile's parameters, its imports apart, for the top of the file, where they make no local of the
    function. Empty where `fix` can write them into the adaptor it knows (its diff shows them where they
    go), and for a finding with no fix."""
    classification = item.classification
    if not isinstance(classification, Classified) or not isinstance(classification.fix, FixPlan):
        return ()
    requests = _requests(item.subject, marker_key(item.subject, classification, context.knowledge), classification.fix, {})
    for rule, companion, subject in _companions(item.subject, classification, context, [item]):
        requests += _requests(subject, rule.id, companion, {})
    environment, profile = context.environment, context.environment.profile
    sides = {"recv": "on the faulty rank", "send": "on the replica rank"}
    if environment.adaptor is not None:
        try:
            adaptor = Adaptor(adaptor_files(environment), environment.source_roots)
            for request in requests:
                adaptor.function(request.function, request.role)
            return ()
        except UsageError:
            pass  # what `fix` would say; the block below is still right at the end of the function
    parameters = sorted({name.split(".")[0] for names in profile.parameters.values() for name in names})
    previews = []
    for request in requests:
        lines, _ = request.block(detached_site(request.function, parameters), profile, None)
        imports = list(itertools.takewhile(lambda line: line.lstrip().startswith(("import ", "from ")), lines[2:]))
        body = (*lines[:2], *lines[2 + len(imports) :])
        previews.append(Preview(request.function, sides.get(request.role, ""), body, tuple(line.strip() for line in imports)))
    return tuple(previews)


class BlockRequest(Protocol):
    """One block to write into one adaptor function: a fix's (`_Request`) or the sentinel's."""

    @property
    def key(self) -> str: ...  # marker key

    @property
    def role(self) -> Role: ...

    @property
    def function(self) -> str: ...  # the adaptor function's name

    def block(self, site: BlockSite, profile: AdaptorProfile, group: str | None) -> tuple[list[str], tuple[str, ...]]:
        """The block's lines (markers included, indented for the site's function) and notes on how it was written."""
        ...


def plan_blocks(
    requests: Sequence[BlockRequest], environment: Environment, profile: AdaptorProfile, group: str | None = None
) -> Plan:
    """The edits that write each requested block into its adaptor function, once; a function that
    holds the block already is named in `present`. Reads files, writes nothing."""
    adaptor = Adaptor(adaptor_files(environment), environment.source_roots)
    insertions: dict[Path, list[tuple[int, AdaptorFunction, list[str], str]]] = {}
    present: list[str] = []
    notes: list[str] = []
    seen: set[tuple[Path, str, str]] = set()
    for request in requests:
        function = adaptor.function(request.function, request.role)
        place = (function.path, function.name, request.key)
        if place in seen:
            continue
        seen.add(place)
        source = adaptor.source(function.path)
        if has_block(source, function, request.key):
            present.append(f"{source.shown}: {request.key} already in {function.name}()")
            continue
        lines, adapted = request.block(adaptor.site(function), profile, group)
        _refuse_a_tie(lines, environment, profile)
        at = insertion_point(source, function, request.key)
        insertions.setdefault(function.path, []).append((at, function, lines, request.key))
        notes.extend((*adapted, *early_return_notes(source, function)))
    edits = tuple(insert_blocks(adaptor.source(path), items) for path, items in insertions.items())
    return Plan(edits, tuple(present), (), tuple(dict.fromkeys(notes)))


def _refuse_a_tie(lines: Sequence[str], environment: Environment, profile: AdaptorProfile) -> None:
    """A block that imports the profile's repair-group getter (the file has none of its own) when the
    adaptor fits other profiles, whose getters live elsewhere, as well: never pick one silently."""
    if environment.profile_from != "adaptor" or not environment.tied:
        return
    imported = set(profile.repair_group_imports) & {line.strip() for line in lines}
    others = [tied for tied in environment.tied if set(tied.repair_group_imports) != set(profile.repair_group_imports)]
    if imported and others:
        choices = ", ".join(item.id for item in (profile, *others))
        raise UsageError(
            f"{environment.adaptor} imports no repair-group getter and fits adaptor profiles {choices} equally "
            f"well, which get it from different modules: name its generation with --profile ({choices})"
        )


@dataclass(frozen=True)
class _Request:
    """A finding's fix for one adaptor function."""

    key: str  # marker key
    role: Role
    function: str
    comment: str
    imports: tuple[str, ...]
    code: str
    scenario: int

    def block(self, site: BlockSite, profile: AdaptorProfile, group: str | None) -> tuple[list[str], tuple[str, ...]]:
        """The block's lines, without line endings, indented for the function's body; notes on how it was written."""
        rendered = render(self.code, self.imports, self.scenario, site, profile, group=group, what=self.key)
        return marked_block(self.key, self.comment, rendered.lines, site.function), rendered.notes


def _check_log_names(subject: Subject) -> None:
    """Names from a log reach generated code and markers: each must be a plain dotted Python name."""
    tensor = subject.tensor
    if tensor is None:
        return
    for label, name in (("variable", tensor.name.variable), ("module", tensor.name.module), ("owner", tensor.name.owner)):
        if name is not None and not is_safe_dotted(name):
            shown = name if len(name) <= 60 else name[:57] + "..."
            raise UsageError(f"the log gives {label} {shown!r} where a Python name belongs: refusing to write it into code")


def _requests(subject: Subject, key: str, fix: FixPlan, functions: dict[Role, str]) -> list[_Request]:
    """One request per function the finding's fix goes into: rollback, or receive and send."""
    what = _tensor_name(subject) or key
    if fix.phase == "rollback" or fix.peer_function is None or fix.peer_code is None:
        return [
            _Request(
                key,
                "rollback",
                functions.get("rollback", fix.function),
                f"scenario 1: re-initialise {what} after the rollback",
                fix.imports,
                fix.code,
                1,
            )
        ]
    return [
        _Request(
            key,
            "recv",
            functions.get("recv", fix.function),
            f"scenario 2, faulty rank: receive {what} from the replica rank",
            fix.imports,
            fix.code,
            2,
        ),
        _Request(
            key,
            "send",
            functions.get("send", fix.peer_function),
            f"scenario 2, replica rank: send {what} to the faulty rank",
            fix.imports,
            fix.peer_code,
            2,
        ),
    ]


def marker_key(subject: Subject, classification: Classified, knowledge: KnowledgeBase) -> str:
    """The rule id, with the tensor's dotted name when the rule is not about one named variable."""
    if classification.rule is not None:
        rule = knowledge.rule(classification.rule)
        if rule is not None and rule.match.variable is not None:
            return rule.id
        key = classification.rule
    else:
        key = generic_template(knowledge, classification.scenario, subject).id
    name = _tensor_name(subject)
    return f"{key}:{name}" if name else key


def _tensor_name(subject: Subject) -> str | None:
    return subject.tensor.name.dotted if subject.tensor else None


# --- revert ---------------------------------------------------------------------------------------


def plan_revert(environment: Environment, *, sentinel: bool = False) -> Plan:
    """The edits that remove every fix block from the adaptor's files, or (`sentinel`) the sentinel's
    blocks alone (its rollback block, and mode heal's in the repair functions): each is installed and
    taken out by its own command."""
    edits = []
    notes = []
    for path in adaptor_files(environment):
        source = read_adaptor_file(path)
        removed = without_blocks(source, lambda key: (key in SENTINEL_KEYS) is sentinel)
        if removed is None:
            notes.append(f"{source.shown}: no {'sentinel block' if sentinel else 'unsafe-doctor fix blocks'}")
        else:
            edits.append(checked_edit(source, *removed))
    return Plan(tuple(edits), (), (), tuple(notes))
