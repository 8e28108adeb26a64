"""The sentinel's lines in a log -> findings: one per global (an lru-cached function included) with every rank that
named it, merged into the traceback findings that name the same global.

The sentinel runs in the training process at the end of the recovery and logs one line per global
still unsafe (`log.sentinel_lines`); a job whose first step has not died yet has no traceback at all.
A log is untrusted: a record that is damaged, names something that is no plain dotted Python name
(`knowledge.is_safe_dotted`, the fixer's own check), gives a count or rank no job has, or a backend
that is no plain word, is not read, only counted. Only what the record says happened is taken
(which global, ranks, backend, counts, healed, and from which replica); the scenario and rule it claims are not: `classify`
decides those from the knowledge base. Where the adaptor's block could not run the sentinel at all
(unsafe-doctor missing or broken in a rank), its one line is kept as a failure: no check vouches
for that rank. What a replica sent in the repair (mode heal) is kept as it was logged.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from unsafe_doctor.diagnose.locate import Finding, SentinelSeen
from unsafe_doctor.knowledge.rules import is_safe_dotted
from unsafe_doctor.knowledge.subject import TensorRef
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.log.lines import RANK_DIGITS, LogLine
from unsafe_doctor.log.sentinel_lines import SCHEMA, Failure, Record, Served, Summary, UnsafeGlobal, parse_failure, parse_line
from unsafe_doctor.log.sentinel_modes import MODES
from unsafe_doctor.source.workspace import Origin

MAX_RANK = 10**RANK_DIGITS  # past any rank a log line can name: a larger number is no rank
MAX_COUNT = 1 << 40  # tensors, entries, globals: a larger number is no count
MAX_PATHS = 8  # readable paths kept per global
MAX_TEXT = 300  # characters kept of a path, or of why a walk stopped early
_WORD = re.compile(r"[a-z][a-z0-9_-]{0,31}")  # a backend's name


@dataclass(frozen=True)
class SentinelLines:
    findings: tuple[Finding, ...]  # one per global, in the order the log first names them
    checks: tuple[Summary, ...]  # one per check logged (each once), with the line's rank when the record has none
    ignored: int  # lines with the sentinel's schema whose record is damaged or not safe to use
    failures: tuple[Failure, ...] = ()  # where the adaptor's block could not run it (each once), with the line's rank
    served: tuple[Served, ...] = ()  # what replicas sent faulty ranks in the repair (each once)


def read_sentinel_lines(lines: Iterable[LogLine]) -> SentinelLines:
    """The records of the sentinel's lines (`inputs.Scan.records`, split into lines)."""
    named: dict[tuple[bool, GlobalName[str | None, str]], list[UnsafeGlobal]] = {}
    checks: dict[Summary, None] = {}
    failures: dict[Failure, None] = {}
    served: dict[Served, None] = {}
    ignored = 0
    for line in lines:
        record = _checked(parse_line(line.text), line.rank)
        failure = _checked_failure(parse_failure(line.text), line.rank) if record is None else None
        if failure is not None:
            failures[failure] = None
        elif record is None:
            ignored += int(SCHEMA in line.text)  # a line of the sentinel, not read
        elif isinstance(record, Summary):
            checks[record] = None
        elif isinstance(record, Served):
            served[record] = None
        elif record.written_by_step is None:  # else harmless by the sentinel's knowledge: the step writes it first
            named.setdefault((record.cached, record.name), []).append(record)
    findings = tuple(_finding(records) for records in named.values())
    return SentinelLines(findings, tuple(checks), ignored, tuple(failures), tuple(served))


def merge(located: Sequence[Finding], sentinel: Sequence[Finding]) -> list[Finding]:
    """A traceback finding whose global the sentinel named too gets what it said, ranks united; a
    global no traceback names is a finding of its own, after the traceback findings."""
    merged = list(located)
    for seen in sentinel:
        same = [index for index, finding in enumerate(located) if _same_global(finding.tensor, seen.tensor)]
        for index in same:
            merged[index] = _united(merged[index], seen)
        if not same:
            merged.append(seen)
    return merged


# --- one record ------------------------------------------------------------------------------------


def _checked(record: Record | None, line_rank: int | None) -> Record | None:
    """The record with the line's rank when it gives none and its texts cut short; None when unsafe to use."""
    if record is None:
        return None
    if record.rank is None:
        record = replace(record, rank=line_rank)
    if not (record.rank is None or 0 <= record.rank < MAX_RANK) or not _WORD.fullmatch(record.backend):
        return None
    if isinstance(record, Summary):
        return _checked_summary(record)
    if isinstance(record, Served):
        return _checked_served(record)
    names = (record.name.module, record.name.owner)
    if not is_safe_dotted(record.name.variable) or not all(name is None or is_safe_dotted(name) for name in names):
        return None
    flags_ok = isinstance(record.healed, bool) and isinstance(record.cached, bool)
    if not _count(record.tensors) or not flags_ok or not isinstance(record.written_by_step, str | None):
        return None
    if record.healed_from is not None and not 0 <= record.healed_from < MAX_RANK:
        return None
    return replace(record, paths=tuple(path[:MAX_TEXT] for path in record.paths[:MAX_PATHS]))


def _checked_failure(failure: Failure | None, line_rank: int | None) -> Failure | None:
    """The failure with the line's rank when it gives none, its error cut short; None past MAX_RANK."""
    if failure is None:
        return None
    rank = failure.rank if failure.rank is not None else line_rank
    return Failure(rank, failure.error[:MAX_TEXT]) if rank is None or rank < MAX_RANK else None


def _checked_summary(summary: Summary) -> Summary | None:
    counts = (summary.tensors_checked, summary.unsafe_tensors, summary.unsafe_globals, summary.not_walked)
    seconds = summary.seconds
    timed = type(seconds) in (int, float) and math.isfinite(seconds) and seconds >= 0
    early = summary.stopped_early
    if summary.mode not in MODES or not all(map(_count, counts)) or not timed or not isinstance(early, str | None):
        return None
    return replace(
        summary,
        stopped_early=early[:MAX_TEXT] if early is not None else None,
        not_walked_first=tuple(path[:MAX_TEXT] for path in summary.not_walked_first[:MAX_PATHS]),
    )


def _checked_served(served: Served) -> Served | None:
    if not 0 <= served.peer < MAX_RANK or not _count(served.sent):
        return None
    if served.dotted is not None and not is_safe_dotted(served.dotted):
        return None
    return replace(served, refused=served.refused[:MAX_TEXT] if served.refused is not None else None)


def _count(value: object) -> bool:
    return type(value) is int and 0 <= value < MAX_COUNT


# --- one global ------------------------------------------------------------------------------------


def _finding(records: Sequence[UnsafeGlobal]) -> Finding:
    """Every rank's record of one global, as one finding; its tensor is the global itself."""
    first = records[0]
    ranks = tuple(sorted({record.rank for record in records if record.rank is not None}))
    healed = [record for record in records if record.healed]
    seen = SentinelSeen(
        ranks=ranks,
        backends=tuple(dict.fromkeys(record.backend for record in records)),
        tensors=max(record.tensors for record in records),
        paths=tuple(dict.fromkeys(path for record in records for path in record.paths))[:MAX_PATHS],
        healed_ranks=tuple(sorted({record.rank for record in healed if record.rank is not None})),
        healed_everywhere=len(healed) == len(records),
        healed_from=tuple(sorted({record.healed_from for record in healed if record.healed_from is not None})),
    )
    tensor = TensorRef(first.name.qualname, first.name, cached=first.cached)
    return Finding(ranks, None, None, None, tensor, None, (), origin=Origin.SENTINEL, sentinel=seen)


def _same_global(located: TensorRef | None, named: TensorRef | None) -> bool:
    """The traceback's tensor is the sentinel's global: the same name and kind, and the same module
    and owner where the traceback tells them (a log read without source may not)."""
    if located is None or named is None:
        return False
    return (
        located.name.variable == named.name.variable
        and located.cached == named.cached
        and located.name.module in (None, named.name.module)
        and located.name.owner in (None, named.name.owner)
    )


def _united(finding: Finding, seen: Finding) -> Finding:
    """The traceback's finding (frames, culprit, source) with the sentinel's ranks and word; the
    module or owner the traceback could not tell is the sentinel's."""
    assert finding.tensor is not None and seen.tensor is not None and seen.sentinel is not None
    known, named = finding.tensor, seen.tensor
    name = replace(known.name, module=known.name.module or named.name.module, owner=known.name.owner or named.name.owner)
    tensor = replace(known, name=name)
    notes = finding.notes
    if tensor != finding.tensor:
        notes = (*notes, f"{tensor.name.dotted}: named so by the sentinel's lines, which the traceback alone could not tell")
    ranks = tuple(sorted({*finding.ranks, *seen.ranks}))
    return replace(finding, ranks=ranks, tensor=tensor, notes=notes, sentinel=seen.sentinel)
