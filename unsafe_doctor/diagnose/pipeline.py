"""The diagnose pipeline: inputs -> logs -> tracebacks -> locate (+ recovery, + the sentinel's lines) -> classify -> Diagnosis.

Ranks whose error MindIO logged without a traceback get a shortlist of suspects instead (`suspects`),
from the arguments dump, the releases and the adaptor generation the log shows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from unsafe_doctor.diagnose import sentinel_findings
from unsafe_doctor.diagnose.locate import Finding, is_unsafe_error, locate
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.classify import Classification, classify, classify_cache
from unsafe_doctor.knowledge.context import Groundwork, RunContext
from unsafe_doctor.knowledge.generations import (
    GenerationEvidence,
    needles,
    profile_messages,
    read_generation,
    shipped_messages,
)
from unsafe_doctor.knowledge.matching import frame_named
from unsafe_doctor.knowledge.subject import Subject
from unsafe_doctor.log import inputs, recovery
from unsafe_doctor.log import lines as logs
from unsafe_doctor.log.arguments import DUMP_MARKERS, RunArguments, read_arguments
from unsafe_doctor.log.inputs import BytesProgress, Excerpt, InputInfo, SkippedInput
from unsafe_doctor.log.lines import LogLine
from unsafe_doctor.log.recovery import FaultReading, LossScaling, MindioForm, RecoveryContext, RecoveryPhase
from unsafe_doctor.log.sentinel_lines import MARKER, Failure, Served, Summary
from unsafe_doctor.log.tracebacks import Traceback, parse_tracebacks

if TYPE_CHECKING:  # loaded when needed: an adaptor to check, an error without a traceback
    from unsafe_doctor.diagnose.suspects import Shortlist
    from unsafe_doctor.recovery_code.stale import StaleReset


@dataclass(frozen=True)
class DiagnosedFinding:
    finding: Finding
    phase: RecoveryPhase
    classification: Classification
    suspect: int | None = None  # the number of the suspect a person chose it as (fix/verify --suspect); None: the log names it

    @property
    def subject(self) -> Subject:
        return self.finding.subject


@dataclass(frozen=True)
class Untraced:
    """The ranks that reported the error with no traceback in the log, and what the log says instead."""

    ranks: tuple[int, ...]
    form: MindioForm | None  # the MindIO catch line's form; None: only the error's own message was seen
    shortlist: Shortlist

    def suspect_finding(self, number: int) -> DiagnosedFinding:
        """Suspect `number` (1-based, as the report numbers them) as a finding of these ranks: what
        `fix --suspect` writes the fix of, a person having chosen it."""
        suspects = self.shortlist.suspects
        if not 1 <= number <= len(suspects):
            raise UsageError(f"--suspect {number}: the log's shortlist has suspects 1 to {len(suspects)}")
        suspect = suspects[number - 1]
        finding = Finding(self.ranks, None, None, None, suspect.tensor, None, (f"suspect {number} of an untraced error, chosen",))
        return DiagnosedFinding(finding, "after-recovery", suspect.classification, number)


@dataclass(frozen=True)
class Diagnosis:
    inputs: tuple[InputInfo, ...]
    findings: tuple[DiagnosedFinding, ...]
    recovery: RecoveryContext
    ranks_seen: tuple[int, ...]  # ranks that printed lines in what was parsed or tagged a line anywhere, or named by file
    first_failed_rank: int | None  # None when failures come from several inputs (no common clock)
    hits: int  # unsafe-data messages in the log, with or without a traceback
    hits_not_parsed: int  # past the excerpt budget: counted, not parsed
    last_error: Traceback | None  # what the log ended with, when it has no unsafe-data error
    untraced_ranks: tuple[int, ...]  # ranks that reported the error (MindIO's catch line) with no traceback
    context: RunContext  # the knowledge, workspace and environment (versions, adaptor profile) the classification used
    stale: tuple[StaleReset, ...]  # resets in the adaptor's rollback naming symbols the framework lacks
    loss_scaling: LossScaling | None = None  # what the log shows of the run's loss scaling; it chose rules
    skipped: tuple[SkippedInput, ...] = ()  # inputs that could not be read (a truncated .gz, a core dump), with why
    sentinel_checks: tuple[Summary, ...] = ()  # the sentinel's summary of each check it logged (rank, backend, mode)
    sentinel_lines_ignored: int = 0  # its lines not read: damaged, unsafe names, or past the reading budget
    sentinel_failures: tuple[Failure, ...] = ()  # where the adaptor's block could not run the sentinel, and why
    sentinel_served: tuple[Served, ...] = ()  # what replicas sent faulty ranks in the repair (heal mode)
    mindio: MindioForm | None = None  # the form of MindIO's catch lines: tells the release, and whether it logs a traceback
    arguments: RunArguments | None = None  # the arguments dump the job printed at start-up
    untraced: Untraced | None = None  # present when untraced_ranks is not empty
    generation: GenerationEvidence | None = None  # the adaptor generation the log's own lines show, and those lines

    def chosen_suspects(self, numbers: Sequence[int]) -> tuple[DiagnosedFinding, ...]:
        """The suspects `--suspect N` chose (fix writes their fixes, verify proves them), each once."""
        if numbers and self.untraced is None:
            raise UsageError("--suspect: the log has no error without a traceback, so no shortlist of suspects")
        untraced = self.untraced
        return tuple(untraced.suspect_finding(number) for number in dict.fromkeys(numbers)) if untraced else ()


def diagnose(
    paths: Sequence[str],
    groundwork: Groundwork,
    *,
    adaptor: Path | None = None,
    stdin: BinaryIO | None = None,
    progress: BytesProgress | None = None,
) -> Diagnosis:
    """`groundwork`: the command's knowledge and workspace; the environment is detected here, from the log's frames."""
    profiles = groundwork.knowledge.profiles
    messages = (*shipped_messages(), *profile_messages(profiles))
    scan = inputs.scan(
        paths,
        (*recovery.MARKERS, *needles(messages)),  # the adaptor's own lines tell its generation
        fact_markers=recovery.LOSS_SCALING_MARKERS,
        record_markers=(MARKER,),
        dump_markers=DUMP_MARKERS,
        stdin=stdin,
        progress=progress,
    )
    order = {info.name: index for index, info in enumerate(scan.inputs)}
    window_lines = [_lines(excerpt) for excerpt in scan.windows]
    context_lines = [line for excerpt in scan.context for line in _lines(excerpt)]
    all_window_lines = [line for lines in window_lines for line in lines]
    context = recovery.read_recovery(sorted(context_lines + all_window_lines, key=lambda line: (order[line.source], line.offset)))
    loss_scaling = recovery.read_loss_scaling(line for excerpt in scan.facts for line in _lines(excerpt))
    tracebacks = _tracebacks(window_lines)
    unsafe = [tb for tb in tracebacks if any(is_unsafe_error(link) for link in tb.chain())]
    sentinel = sentinel_findings.read_sentinel_lines(line for excerpt in scan.records for line in _lines(excerpt))
    arguments = read_arguments(line for excerpt in scan.dumps for line in _lines(excerpt))
    switches = arguments.values if arguments else {}
    findings = sentinel_findings.merge(locate(unsafe, groundwork.workspace, switches), sentinel.findings)
    traced = [finding.unsafe for finding in findings if finding.unsafe]
    frames = [frame for traceback in traced for frame in traceback.frames]
    # the adaptor's lines (the logger each names: MindIO's `[PYH tft_rollback.py:52]`, a module's) and
    # the frames in its files tell its generation
    generation = read_generation(messages, (*context_lines, *all_window_lines), traced, profiles)
    logged = tuple(profile for profile in profiles if profile.id in generation.generations)
    run = groundwork.detect(frames, adaptor, logged, arguments.values.keys() if arguments else None)
    diagnosed = tuple(
        DiagnosedFinding(finding, _phase(finding, context), _classify(finding, run, loss_scaling)) for finding in findings
    )
    environment = run.environment
    stale = []
    if environment.adaptor:
        from unsafe_doctor.recovery_code.stale import stale_resets

        stale = stale_resets(environment.adaptor, environment.profile, environment, run.workspace, run.knowledge.rules)
    tail_lines = [_lines(excerpt) for excerpt in scan.tails]
    last_error = None
    if not findings:
        # torchrun's own ChildFailedError only repeats that a worker failed: the worker's error tells why.
        ended = [tb for tb in _tracebacks(tail_lines) if not tb.exception_type.endswith("ChildFailedError")]
        if ended:
            last_error = max(ended, key=lambda tb: (order[tb.source], tb.offset))
    located = {rank for finding in findings for rank in finding.ranks}
    untraced = {
        event.rank for event in context.events if event.kind == "caught" and event.rank is not None and event.rank not in located
    }
    seen = [info.rank_hint for info in scan.inputs]
    seen += [line.rank for lines in window_lines + tail_lines for line in lines]
    seen += [line.rank for line in context_lines]
    seen += [check.rank for check in sentinel.checks]
    seen += [failure.rank for failure in sentinel.failures]
    seen += [item.rank for item in sentinel.served]
    seen += scan.ranks_tagged  # counted over the whole of each input, not only what was parsed
    ranks = located | untraced | {rank for rank in seen if rank is not None}
    form = recovery.mindio_form(context)
    return Diagnosis(
        inputs=scan.inputs,
        findings=diagnosed,
        recovery=context,
        ranks_seen=tuple(sorted(ranks)),
        first_failed_rank=_first_failed_rank(unsafe),
        hits=scan.hits,
        hits_not_parsed=scan.hits_not_parsed,
        last_error=last_error,
        untraced_ranks=tuple(sorted(untraced)),
        context=run,
        stale=tuple(stale),
        loss_scaling=loss_scaling,
        skipped=scan.skipped,
        sentinel_checks=sentinel.checks,
        sentinel_lines_ignored=sentinel.ignored + scan.records_not_kept,
        sentinel_failures=sentinel.failures,
        sentinel_served=sentinel.served,
        mindio=form,
        arguments=arguments,
        untraced=_untraced(tuple(sorted(untraced)), form, run, arguments, loss_scaling, fault=recovery.read_fault(context))
        if untraced
        else None,
        generation=generation,
    )


def _untraced(
    ranks: tuple[int, ...],
    form: MindioForm | None,
    run: RunContext,
    arguments: RunArguments | None,
    loss_scaling: LossScaling | None,
    *,
    fault: FaultReading,
) -> Untraced:
    """The suspects, with the generations the job may have run and the fault the log shows."""
    from unsafe_doctor.diagnose.suspects import shortlist

    return Untraced(ranks, form, shortlist(run, arguments, loss_scaling, fault))


def _phase(finding: Finding, context: RecoveryContext) -> RecoveryPhase:
    """Where the error was raised; a global only the sentinel named is read by the first step after the recovery."""
    if finding.traceback is not None:
        return recovery.phase_of(finding.traceback, context)
    return "after-recovery" if context.seen else "none"


def _classify(finding: Finding, run: RunContext, loss_scaling: LossScaling | None) -> Classification:
    """The knowledge decides, never the log's own claim. A global only the sentinel named has no frame:
    a rule that knows it by the frame a log shows reading it takes that frame as given, as the audit
    does; an lru cache the sentinel found is one by its nature."""
    subject = finding.subject
    tensor = subject.tensor
    if finding.traceback is None and tensor is not None and tensor.name.variable is not None:
        named = (frame_named(rule, tensor.name, None) for rule in run.knowledge.rules)
        subject = replace(subject, frame=next((frame for frame in named if frame is not None), None))
    if finding.sentinel is not None and tensor is not None and tensor.cached:
        return classify_cache(subject, run, loss_scaling)
    return classify(subject, run, loss_scaling)


def _lines(excerpt: Excerpt) -> list[LogLine]:
    return logs.split_lines(excerpt.text, source=excerpt.source, base_offset=excerpt.start, rank_hint=excerpt.rank_hint)


def _tracebacks(excerpts_lines: list[list[LogLine]]) -> list[Traceback]:
    """Tracebacks of every rank in every excerpt, once each (windows of one input may overlap)."""
    found: dict[tuple[str, int, int | None], Traceback] = {}
    for lines in excerpts_lines:
        for rank_lines in logs.by_rank(lines).values():
            for traceback in parse_tracebacks(rank_lines):
                found.setdefault((traceback.source, traceback.offset, traceback.rank), traceback)
    return list(found.values())


def _first_failed_rank(unsafe: list[Traceback]) -> int | None:
    if not unsafe or len({tb.source for tb in unsafe}) > 1:
        return None
    first = min(unsafe, key=lambda tb: tb.offset)
    return first.rank if first.rank is not None else first.npu_rank
