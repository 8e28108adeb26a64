"""Write each finding's fix into the user's recovery adaptor, and take it out again.

A fix becomes one block at the end of an adaptor function, before a trailing `return`: the rollback
function for scenario 1; for scenario 2 the send function (replica side) and the receive function
(faulty side), planned together so that their transfers pair up in the same order. A block reads

    # unsafe-doctor: begin <key>
    # <what it does>
    <the rule's code, in the function's own names; for scenario 2 inside a loop over the
     (source, destination) rank pairs>
    # unsafe-doctor: end <key>

The block is written inline, for the adaptor's maintainer to read (``adaptor.render``): it reads
the names the file already binds (its `torch`, its `dist`, its repair group or the getter it
imports), and imports only what the file lacks. A rule's `repair_with` adds the fixes of the state
the same step reads next, unless the adaptor's generation resets it itself.

`<key>` is the rule id, or `<rule id>:<module>.<variable>` when the rule is not about one named
variable, or `<template id>:<module>.<variable>` for the templates that heuristic verdicts use.
A function that already holds a block with the same key is left alone; a revert removes exactly the
marked lines. The sentinel's block (`sentinel_install`) is planned by the same code: it stays the
last block of its function, so a fix written later goes before it; `fix --revert` leaves it.

Edits are spliced into the original bytes at line boundaries, so every other byte stays as it was
(line endings, tabs, encoding); the result is parsed again and compiled before it may be written,
and a file that changed since it was read, or that another writer holds locked, is never
overwritten; each write keeps the file as it was in one backup beside it (`backup_of`). Nothing here
prints or exits: refusals raise UsageError.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import fcntl
import hashlib
import itertools
import keyword
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from unsafe_doctor.adaptor.code import (
    INDENT,
    ROLES,
    Adaptor,
    AdaptorFunction,
    AdaptorSource,
    BlockSite,
    Role,
    adaptor_files,
    block_spans,
    detached_site,
    read_adaptor_file,
    without_blocks,
)
from unsafe_doctor.adaptor.existing_reset import AlreadyReset, existing_reset
from unsafe_doctor.adaptor.render import render
from unsafe_doctor.errors import UsageError, os_reason
from unsafe_doctor.knowledge.classify import (
    Classified,
    ClassifiedSubject,
    FixPlan,
    NoFix,
    Unclassified,
    classify_with_rule,
    generic_template,
)
from unsafe_doctor.knowledge.context import RunContext
from unsafe_doctor.knowledge.rules import (
    EVERY_ROLE,
    AdaptorProfile,
    KnowledgeBase,
    Rule,
    is_safe_dotted,
    map_parameters,
)
from unsafe_doctor.knowledge.subject import Subject
from unsafe_doctor.knowledge.versions import Environment
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.source.files import shown_path, write_over
from unsafe_doctor.source.markers import MARKER_BEGIN, MARKER_END, SENTINEL_KEY

if TYPE_CHECKING:
    from unsafe_doctor.audit.coverage import AdaptorCoverage

BACKUP_SUFFIX = ".unsafe-doctor.bak"


@dataclass(frozen=True)
class Insertion:
    """Where a block went into the original file, so that SARIF can place it without a diff."""

    line: int  # 0-based index of the original line the text goes before; the line count: at the end of the file
    text: str  # what was spliced in there, line endings included


@dataclass(frozen=True)
class FileEdit:
    path: Path  # as shown to the user
    original: bytes
    updated: bytes
    encoding: str
    digest: str  # sha256 of `original`: the file must still hold it when the edit is written
    changes: tuple[str, ...]  # one line per block inserted or removed
    insertions: tuple[Insertion, ...] = ()  # the blocks a fix inserts, top to bottom; none for a revert

    def diff(self) -> str:
        """Unified diff of this file, lines ending as in the file, as `git apply` and `patch -p1` take it."""
        before = [line.decode(self.encoding, errors="replace") for line in self.original.splitlines(keepends=True)]
        after = [line.decode(self.encoding, errors="replace") for line in self.updated.splitlines(keepends=True)]
        name = patch_path(self.path)
        lines = difflib.unified_diff(before, after, fromfile=f"a/{name}", tofile=f"b/{name}")
        return "".join(line if line.endswith(("\n", "\r")) else line + "\n\\ No newline at end of file\n" for line in lines)


def patch_path(path: Path) -> str:
    """The file's path as a patch names it (after `a/` and `b/`): from the root of the git repository
    around the working folder, else from the working folder; a file outside it from `/`."""
    absolute = Path(os.path.abspath(path))
    folder = Path.cwd()
    base = next((parent for parent in (folder, *folder.parents) if (parent / ".git").exists()), folder)
    try:
        return absolute.relative_to(base).as_posix()
    except ValueError:
        return absolute.as_posix().lstrip("/")


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


@dataclass(frozen=True)
class Written:
    path: Path
    backup: Path  # the file as it was before this write (`backup_of`)
    links: int  # names the file has; above 1 it was written in place, so that they all see the fix
    in_place: bool  # written into the file, not renamed over it: other links, or an owner only the file could keep
    owner: tuple[int, int]  # the file's user and group id, kept
    backup_owner: tuple[int, int]  # the backup's: the file's, unless this user may not give them to a new file


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
            outcomes.append(Skipped(number, "unclassified: scenario 1 or 2 is not known, so there is no fix to write",
                                    item.suspect))
        elif isinstance(classification.fix, NoFix):
            outcomes.append(Skipped(number, classification.fix.reason, item.suspect))
        elif (unresolved := _unresolved_module(item.subject)) is not None:
            outcomes.append(Skipped(number, unresolved, item.suspect))
        else:
            key = marker_key(item.subject, classification, context.knowledge)
            if coverage is None and environment.adaptor is not None:
                from unsafe_doctor.audit.coverage import AdaptorCoverage  # the audit's walker: only with an adaptor

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
                notes.append(f"finding {number}: {rule.id} is repaired with it: {_tensor_name(subject)} is the state "
                             f"the same step reads next, and adaptor profile {environment.profile.id} does not "
                             "reset it")
    if not requests:
        return Plan((), (), tuple(outcomes), ())
    blocks = plan_blocks(requests, environment, profile, group)
    return replace(blocks, outcomes=tuple(outcomes), notes=tuple(dict.fromkeys((*notes, *blocks.notes))),
                   profile=profile.id, profile_why=environment.profile_why)


def _unresolved_module(subject: Subject) -> str | None:
    """Why a fix cannot name the global's module: the log reads it through a name (`state._EMA`) that,
    with no source read, is only a guess at the module (`state` for `toytrain.state`)."""
    tensor = subject.tensor
    if tensor is None or tensor.name.module is None or subject.source_file is not None or tensor.runs_as_main:
        return None
    if tensor.expression.split(".")[0] != tensor.name.module.rpartition(".")[2]:
        return None
    return (f"the log reads {tensor.expression} through the name {tensor.name.module}, which without the job's source "
            f"is a guess at its module: give --source-root so that the fix imports the module that holds it")


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
        body = (*lines[:2], *lines[2 + len(imports):])
        previews.append(Preview(request.function, sides.get(request.role, ""), body,
                                tuple(line.strip() for line in imports)))
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
        if _has_block(source, function, request.key):
            present.append(f"{source.shown}: {request.key} already in {function.name}()")
            continue
        lines, adapted = request.block(adaptor.site(function), profile, group)
        _refuse_a_tie(lines, environment, profile)
        at = _insertion_point(source, function, request.key)
        insertions.setdefault(function.path, []).append((at, function, lines, request.key))
        notes.extend((*adapted, *_early_return_notes(source, function)))
    edits = tuple(_insert(adaptor.source(path), items) for path, items in insertions.items())
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
        raise UsageError(f"{environment.adaptor} imports no repair-group getter and fits adaptor profiles {choices} equally "
                         f"well, which get it from different modules: name its generation with --profile ({choices})")


def parameter_roles(specs: Iterable[str]) -> dict[str, list[str]]:
    """`role=name` items of `--parameter` (comma-separated or repeated) -> {role: parameter names}; a
    role given twice has alternatives (the send and the receive function's names for it).
    `knowledge.map_parameters` checks the roles and names."""
    mapping: dict[str, list[str]] = {}
    for spec in specs:
        for item in filter(None, (part.strip() for part in spec.split(","))):
            role, equals, name = (part.strip() for part in item.partition("="))
            if not equals or role not in EVERY_ROLE:
                raise UsageError(f"--parameter {item!r}: write role=name, role one of {', '.join(EVERY_ROLE)}")
            mapping.setdefault(role, []).append(name)
    return mapping


def function_overrides(specs: Iterable[str]) -> dict[Role, str]:
    """`role=name` items (comma-separated or repeated) -> {role: function name}."""
    overrides: dict[Role, str] = {}
    for spec in specs:
        for item in filter(None, (part.strip() for part in spec.split(","))):
            role, equals, name = (part.strip() for part in item.partition("="))
            if not equals or role not in ROLES:
                raise UsageError(f"--function {item!r}: write role=name, role one of {', '.join(ROLES)}")
            if not name.isidentifier() or keyword.iskeyword(name):
                raise UsageError(f"--function {item!r}: {name!r} is not a Python function name")
            if overrides.get(role, name) != name:
                raise UsageError(f"--function names two functions for {role}: {overrides[role]} and {name}")
            overrides[role] = name
    return overrides


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
        return _block_lines(self, site, profile, group)


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
            _Request(key, "rollback", functions.get("rollback", fix.function),
                     f"scenario 1: re-initialise {what} after the rollback", fix.imports, fix.code, 1)
        ]
    return [
        _Request(key, "recv", functions.get("recv", fix.function),
                 f"scenario 2, faulty rank: receive {what} from the replica rank", fix.imports, fix.code, 2),
        _Request(key, "send", functions.get("send", fix.peer_function),
                 f"scenario 2, replica rank: send {what} to the faulty rank", fix.imports, fix.peer_code, 2),
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


# --- rendering a block ----------------------------------------------------------------------------


def _block_lines(
    request: _Request, site: BlockSite, profile: AdaptorProfile, group: str | None = None
) -> tuple[list[str], tuple[str, ...]]:
    """The block's lines, without line endings, indented for the function's body; notes on how it was written."""
    rendered = render(request.code, request.imports, request.scenario, site, profile, group, request.key)
    return marked_block(request.key, request.comment, rendered.lines, site.function), rendered.notes


def marked_block(key: str, comment: str, body: Sequence[str], function: AdaptorFunction) -> list[str]:
    """`body` (template indentation) between the markers of `key`, after a comment, indented for `function`."""
    lines = [MARKER_BEGIN + key, f"# {comment}", *body, MARKER_END + key]
    return [_reindent(line, function) for line in lines]


def _reindent(line: str, function: AdaptorFunction) -> str:
    """Template indentation (four spaces a level) -> the function's own (tabs, two spaces, ...)."""
    if not line:
        return ""
    stripped = line.lstrip(" ")
    levels, rest = divmod(len(line) - len(stripped), len(INDENT))
    return function.indent + function.unit * levels + " " * rest + stripped


# --- splicing and checking ------------------------------------------------------------------------


def _has_block(source: AdaptorSource, function: AdaptorFunction, key: str) -> bool:
    return any(span.key == key and function.first_line - 1 <= span.begin < function.last_line for span in block_spans(source))


def _insertion_point(source: AdaptorSource, function: AdaptorFunction, key: str) -> int:
    """The 0-based line a new block goes before: the end of the function's body (before a trailing
    `return`), after the blocks already there, and before the sentinel's block, which stays last."""
    at = function.insert_at
    assert at is not None, "Adaptor.function refuses a function whose body is on its `def` line"
    spans = [span for span in block_spans(source) if function.first_line - 1 <= span.begin < function.last_line]
    for span in spans:  # a block's end marker trails the body's last statement: the body ends after it
        if span.begin < at <= span.end:
            at = span.end + 1
    sentinel = next((span for span in spans if span.key == SENTINEL_KEY), None)
    if key != SENTINEL_KEY and sentinel is not None and sentinel.begin < at:
        at = sentinel.begin
    return at


def _early_return_notes(source: AdaptorSource, function: AdaptorFunction) -> list[str]:
    if not function.early_returns:
        return []
    lines = ", ".join(map(str, function.early_returns))
    return [
        f"{source.shown}: {function.name}() returns before its end (line {lines}): "
        "the block runs only on paths that reach the end"
    ]


def _insert(source: AdaptorSource, items: list[tuple[int, AdaptorFunction, list[str], str]]) -> FileEdit:
    """Every block for one file spliced in at once (one combined diff), each before its line; blocks
    for one place keep their planned order, so the send and receive sides of several fixes pair up."""
    lines = list(source.lines)
    newline = source.encode(source.newline)
    changes = []
    insertions = []
    # Bottom to top, so earlier positions stay valid; at one position, the last planned block first.
    for _, (at, function, block, key) in sorted(enumerate(items), key=lambda item: (item[1][0], item[0]), reverse=True):
        encoded = [source.encode(line) + newline for line in block]
        text = "".join(line + source.newline for line in block)
        if at == len(lines) and lines and not lines[-1].endswith((b"\n", b"\r")):
            lines[-1] += newline  # the file ended without a line ending after the function:
            encoded[-1] = encoded[-1][: -len(newline)]  # it still does, after the block
            text = source.newline + text[: -len(source.newline)]
        lines[at:at] = encoded
        changes.append(f"{source.shown}:{at + 1}: insert {key} at the end of {function.name}()")
        insertions.append(Insertion(at, text))
    changes.reverse()
    insertions.reverse()
    return _checked_edit(source, b"".join(lines), tuple(changes), tuple(insertions))


def _checked_edit(
    source: AdaptorSource, updated: bytes, changes: tuple[str, ...], insertions: tuple[Insertion, ...] = ()
) -> FileEdit:
    """The edit, once the new content parses and compiles."""
    try:
        compile(updated, str(source.path), "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        reason = f"{error.msg}, line {error.lineno}" if isinstance(error, SyntaxError) else str(error).splitlines()[0]
        raise UsageError(f"{source.shown}: the edited file would not compile ({reason}): nothing written") from None
    digest = hashlib.sha256(source.data).hexdigest()
    return FileEdit(source.path, source.data, updated, source.encoding, digest, changes, insertions)


# --- revert ---------------------------------------------------------------------------------------


def plan_revert(environment: Environment, *, sentinel: bool = False) -> Plan:
    """The edits that remove every fix block from the adaptor's files, or (`sentinel`) the sentinel's
    block alone: each is installed and taken out by its own command."""
    edits = []
    notes = []
    for path in adaptor_files(environment):
        source = read_adaptor_file(path)
        removed = without_blocks(source, lambda key: (key == SENTINEL_KEY) is sentinel)
        if removed is None:
            notes.append(f"{source.shown}: no {'sentinel block' if sentinel else 'unsafe-doctor fix blocks'}")
        else:
            edits.append(_checked_edit(source, *removed))
    return Plan(tuple(edits), (), (), tuple(notes))


# --- writing --------------------------------------------------------------------------------------


def backup_of(path: Path) -> Path:
    """Where a write keeps the file as it was just before it: `x.py.unsafe-doctor.bak` beside the file
    (symlinks resolved), one per file, which the next write replaces; one `.gitignore` line,
    `*.unsafe-doctor.bak`, keeps them all out of git."""
    target = path.resolve()
    return target.with_name(target.name + BACKUP_SUFFIX)


def apply(plan: Plan) -> tuple[Written, ...]:
    """Write every edit: each file's backup beside it, then its new content by an atomic rename, or in
    place where a rename would lose something (`_replace_all`); the file's owner, group, mode and
    extended attributes kept.

    Each file is locked (flock) from the last look at its content to its write, so a second writer
    (another fix, a sentinel install) is refused rather than interleaved. Refuses (before writing
    anything) a read-only file, and any file whose content is no longer what was read when the plan
    was made. Every backup and every new content is on disk before the first file is replaced, so a
    full disk leaves every file and backup as it was."""
    with contextlib.ExitStack() as locks:
        for edit in plan.edits:
            locks.enter_context(_locked(edit))
            _check_unchanged(edit)
            _check_writable(edit)
        staged: list[_Staged] = []
        try:
            for edit in plan.edits:
                staged.append(_stage(edit))
            for item in staged:
                _check_unchanged(item.edit)  # last look, right before the replace
        except BaseException:
            for item in staged:
                item.discard()
            raise
        return _replace_all(staged)


@contextlib.contextmanager
def _locked(edit: FileEdit) -> Iterator[None]:
    """The file locked (flock, an exclusive lock every unsafe-doctor that writes it takes) until the
    `with` ends; refused at once when another holds it: its write may be half done."""
    try:
        handle = os.open(edit.path.resolve(), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise UsageError(f"cannot read {edit.path} again: {os_reason(error)}") from None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                f"{edit.path} is being written by another command (it holds the file's lock): nothing written; "
                "run this one again once that one ends"
            ) from None
        yield
    finally:
        os.close(handle)


@dataclass(frozen=True)
class _Staged:
    """An edit on disk beside its file, not yet in its place: the backup and the new content."""

    edit: FileEdit
    target: Path  # the file itself, symlinks resolved
    owner: tuple[int, int]  # the file's user and group
    backup: Path  # temporary names, until `_replace_all`
    temporary: Path

    def discard(self) -> None:
        self.temporary.unlink(missing_ok=True)
        self.backup.unlink(missing_ok=True)


def _stage(edit: FileEdit) -> _Staged:
    """The backup first, whole; then the new content, whole; both beside the file under temporary names."""
    target = edit.path.resolve()
    try:
        status = target.stat()
        backup = _whole_file(target, edit.original, status)
        try:
            temporary = _whole_file(target, edit.updated, status)
        except BaseException:
            backup.unlink(missing_ok=True)
            raise
    except OSError as error:
        raise UsageError(f"cannot write {edit.path}: {error.strerror or error}: nothing written") from None
    return _Staged(edit, target, _owner(status), backup, temporary)


def _replace_all(staged: Sequence[_Staged]) -> tuple[Written, ...]:
    """Each backup, then each new content, renamed into its place (a rename needs no space). A file
    is written in place instead when a rename would lose something: the file's other hard links, or
    an owner or group this user cannot give a new file (a group member's fix keeps the file its
    owner's). Where a rename is refused (a sticky folder), that file and those after it are left as
    they were."""
    written: list[Written] = []
    for index, item in enumerate(staged):
        backup = backup_of(item.target)
        try:
            links = os.stat(item.target).st_nlink
            in_place = links > 1 or _owner(os.stat(item.temporary)) != item.owner
            os.replace(item.backup, backup)
            if in_place:
                _write_in_place(item.target, item.edit.updated)
                item.temporary.unlink()
            else:
                os.replace(item.temporary, item.target)
        except OSError as error:
            for other in staged[index:]:
                other.discard()
            done = "".join(f"; {earlier.path} was written (backup: {earlier.backup})" for earlier in written)
            raise UsageError(f"cannot replace {item.edit.path}: {error.strerror or error}: left as it was{done}") from None
        _sync_folder(item.target.parent)
        written.append(Written(item.edit.path, shown_path(backup), links, in_place, item.owner, _owner(os.stat(backup))))
    return tuple(written)


def _write_in_place(target: Path, data: bytes) -> None:
    """The new content written into the file (`write_over`): a full disk fails before a byte
    changes, and the backup is already on disk."""
    handle = os.open(target, os.O_WRONLY | os.O_CLOEXEC)
    try:
        write_over(handle, data)
    finally:
        os.close(handle)


def _owner(status: os.stat_result) -> tuple[int, int]:
    return status.st_uid, status.st_gid


def _check_writable(edit: FileEdit) -> None:
    target = edit.path.resolve()
    if not target.stat().st_mode & stat.S_IWUSR or not os.access(target, os.W_OK):
        raise UsageError(f"{edit.path} is read-only: nothing written")
    if not os.access(target.parent, os.W_OK):
        raise UsageError(f"{target.parent} is not writable (the backup is written beside the file): nothing written")


def _check_unchanged(edit: FileEdit) -> None:
    try:
        current = edit.path.resolve().read_bytes()
    except OSError as error:
        raise UsageError(f"cannot read {edit.path} again: {error.strerror or error}") from None
    if hashlib.sha256(current).hexdigest() != edit.digest:
        raise UsageError(f"{edit.path} changed since it was read: nothing written; run the command again")


def _whole_file(target: Path, data: bytes, status: os.stat_result) -> Path:
    """`data` in a new temporary file beside `target`, on disk (fsync), with its mode, and its owner
    and group where this user may give them: root both, a member of the file's group that group
    (`_replace_all` compares what it got)."""
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    temporary = Path(name)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        with contextlib.suppress(PermissionError):
            os.chown(temporary, status.st_uid if os.geteuid() == 0 else -1, status.st_gid)
        os.chmod(temporary, stat.S_IMODE(status.st_mode))  # after chown, which clears set-id bits
        _copy_attributes(target, temporary)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return temporary


def _copy_attributes(source: Path, copy: Path) -> None:
    """The file's extended attributes (its ACL and security label among them) on the copy; one that
    cannot be kept stops the write (OSError), as losing it silently would change who may read the file."""
    try:
        names = os.listxattr(source)
    except OSError as error:
        if error.errno in (errno.ENOTSUP, errno.ENOSYS):  # a file system without them
            return
        raise
    for name in names:
        os.setxattr(copy, name, os.getxattr(source, name))


def _sync_folder(folder: Path) -> None:
    """The rename itself on disk."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
