"""The diagnose pipeline: inputs -> logs -> tracebacks -> locate (+ recovery) -> classify -> Diagnosis."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from unsafe_doctor import inputs, logs, recovery
from unsafe_doctor.classify import Classification, classify
from unsafe_doctor.context import Groundwork, RunContext
from unsafe_doctor.inputs import Excerpt, InputInfo, Progress, SkippedInput
from unsafe_doctor.locate import Finding, is_unsafe_error, locate
from unsafe_doctor.logs import LogLine
from unsafe_doctor.recovery import LossScaling, Phase, RecoveryContext
from unsafe_doctor.stale import StaleReset, stale_resets
from unsafe_doctor.subject import Subject
from unsafe_doctor.tracebacks import Traceback, parse_tracebacks


@dataclass(frozen=True)
class DiagnosedFinding:
    finding: Finding
    phase: Phase
    classification: Classification

    @property
    def subject(self) -> Subject:
        return self.finding.subject


@dataclass(frozen=True)
class Diagnosis:
    inputs: tuple[InputInfo, ...]
    findings: tuple[DiagnosedFinding, ...]
    recovery: RecoveryContext
    ranks_seen: tuple[int, ...]  # ranks that printed lines in what was read, or named by file
    first_failed_rank: int | None  # None when failures come from several inputs (no common clock)
    hits: int  # unsafe-data messages in the log, with or without a traceback
    hits_not_parsed: int  # past the excerpt budget: counted, not parsed
    last_error: Traceback | None  # what the log ended with, when it has no unsafe-data error
    untraced_ranks: tuple[int, ...]  # ranks that reported the error (MindIO's catch line) with no traceback
    context: RunContext  # the knowledge, workspace and environment (versions, adaptor profile) the classification used
    stale: tuple[StaleReset, ...]  # resets in the adaptor's rollback naming symbols the framework lacks
    loss_scaling: LossScaling | None = None  # what the log shows of the run's loss scaling; it chose rules
    skipped: tuple[SkippedInput, ...] = ()  # inputs that could not be read (a truncated .gz, a core dump), with why


def diagnose(
    paths: Sequence[str],
    groundwork: Groundwork,
    *,
    adaptor: Path | None = None,
    stdin: BinaryIO | None = None,
    progress: Progress | None = None,
) -> Diagnosis:
    """`groundwork`: the command's knowledge and workspace; the environment is detected here, from the log's frames."""
    scan = inputs.scan(
        paths, recovery.MARKERS, fact_markers=recovery.LOSS_SCALING_MARKERS, stdin=stdin, progress=progress
    )
    order = {info.name: index for index, info in enumerate(scan.inputs)}
    window_lines = [_lines(excerpt) for excerpt in scan.windows]
    context_lines = [line for excerpt in scan.context for line in _lines(excerpt)]
    all_window_lines = [line for lines in window_lines for line in lines]
    context = recovery.read_recovery(
        sorted(context_lines + all_window_lines, key=lambda line: (order[line.source], line.offset))
    )
    loss_scaling = recovery.read_loss_scaling(line for excerpt in scan.facts for line in _lines(excerpt))
    tracebacks = _tracebacks(window_lines)
    unsafe = [tb for tb in tracebacks if any(is_unsafe_error(link) for link in tb.chain())]
    findings = locate(unsafe, groundwork.workspace)
    run = groundwork.detect([frame for finding in findings for frame in finding.unsafe.frames], adaptor)
    diagnosed = tuple(
        DiagnosedFinding(finding, recovery.phase_of(finding.traceback, context), classify(finding.subject, run, loss_scaling))
        for finding in findings
    )
    environment = run.environment
    stale = stale_resets(environment.adaptor, environment.profile, environment, run.workspace) if environment.adaptor else []
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
    ranks = located | untraced | {rank for rank in seen if rank is not None}
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
    )


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
