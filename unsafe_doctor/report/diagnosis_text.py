"""A Diagnosis as a rich renderable for a terminal (its JSON and SARIF: `diagnosis`). rich loads with this
module, when a report is rendered for people."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from unsafe_doctor.diagnose.locate import Finding, SentinelSeen
from unsafe_doctor.diagnose.pipeline import DiagnosedFinding, Diagnosis, Untraced
from unsafe_doctor.knowledge.classify import Classification
from unsafe_doctor.knowledge.generations import GenerationEvidence
from unsafe_doctor.knowledge.matching import finite_names
from unsafe_doctor.knowledge.render.template import FixPlan, NoFix
from unsafe_doctor.knowledge.rules import AdaptorProfile
from unsafe_doctor.knowledge.subject import TensorRef
from unsafe_doctor.log.recovery import CatchKind
from unsafe_doctor.log.sentinel_lines import Summary
from unsafe_doctor.log.tracebacks import Frame
from unsafe_doctor.report.common import counted, printable, rank_ranges
from unsafe_doctor.report.diagnosis import fault_said, healed_notes, untraced_reason
from unsafe_doctor.report.terminal import CodeToCopy, Hanging, PythonCode, stale_text, title
from unsafe_doctor.source.files import is_internal_file
from unsafe_doctor.source.workspace import Origin

if TYPE_CHECKING:  # for types only: a diagnosis without fixes loads no adaptor code, one with a traceback no suspects
    from unsafe_doctor.adaptor.plan import Preview
    from unsafe_doctor.diagnose.suspects import Suspect

SHORT_STACK = 6  # frames shown in a panel, innermost last
SUSPECT_NAMES = 4  # a suspect's pattern is shown as the names it matches up to this many, else as its rule's title


def diagnosis_text(
    diagnosis: Diagnosis, elapsed: float, previews: Sequence[tuple[Preview, ...]] = (), *, verbose: bool = False
) -> RenderableType:
    """`previews`: each finding's blocks as `fix` writes them (adaptor.plan.preview), printed under it;
    `verbose`: also the adaptor generation the log's lines show, and those lines."""
    parts: list[RenderableType] = []
    for number, item in enumerate(diagnosis.findings, 1):
        parts.append(_panel(number, item, diagnosis))
        parts.extend(_fix_code(previews[number - 1] if number <= len(previews) else ()))
    if diagnosis.stale:
        parts.append(stale_text(diagnosis.stale))
    if diagnosis.untraced:
        parts.append(_untraced(diagnosis.untraced))
    if not diagnosis.findings and not diagnosis.untraced_ranks:
        parts.append(_no_finding(diagnosis))
    if diagnosis.sentinel_checks or diagnosis.sentinel_lines_ignored or diagnosis.sentinel_failures or diagnosis.sentinel_served:
        parts.append(_sentinel_checks(diagnosis))
    if verbose and diagnosis.generation is not None:
        parts.append(_generation_text(diagnosis.generation, diagnosis.context.environment.possible))
    parts.append(_summary(diagnosis, elapsed))
    return Group(*parts)


def _panel(number: int, item: DiagnosedFinding, diagnosis: Diagnosis) -> Panel:
    finding = item.finding
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="ellipsis")  # a word too long is cut with "…", never split over two lines
    tensor = finding.tensor
    grid.add_row("Tensor", _tensor_text(tensor))
    grid.add_row("Source", _origin_text(finding, guessed=tensor is not None))
    unsafe = finding.unsafe
    if unsafe is not None:
        error = Text(printable(f"{unsafe.exception_type}: {unsafe.message}"), style="red")
        if unsafe.error_code:
            error.append(f"  [{printable(unsafe.error_code)}]", style="dim")
        grid.add_row("Error", error)
    if finding.sentinel is not None:
        grid.add_row("Sentinel", _seen_text(finding.sentinel, also=unsafe is not None))
    grid.add_row("Phase", Text(_phase_text(item, diagnosis)))
    if finding.culprit is not None:
        grid.add_row("Culprit", _FrameText(finding.culprit))
        if finding.culprit.source:
            start = finding.culprit.line or 1
            grid.add_row("", PythonCode(finding.culprit.source, line_numbers=True, start_line=start, word_wrap=True))
    frames = unsafe.frames if unsafe else ()
    if frames:
        own = [frame for frame in frames if not is_internal_file(frame.file)] or list(frames)
        shown = own[-SHORT_STACK:]
        outer = len(frames) - len(shown)
        more = [Text(f"… {counted(outer, 'more frame')} (outer, or torch internals)", style="dim")] if outer else []
        grid.add_row("Stack", Group(*more, *map(_FrameText, shown)))
    if unsafe is not None and unsafe.truncated:
        grid.add_row("", Text("The traceback is cut short in the log; what is shown is what it holds.", style="yellow"))
    _add_classification(grid, item.classification)
    for note in (*finding.notes, *healed_notes(finding.sentinel), *item.classification.notes):
        grid.add_row("Note", Text(printable(note), style="dim"))
    ranks = f"rank{'s' if len(finding.ranks) != 1 else ''} {rank_ranges(finding.ranks) or 'unknown'}"
    return Panel(grid, title=title(f"Finding {number} · {ranks}"), title_align="left", border_style="red")


def _tensor_text(tensor: TensorRef | None) -> Text:
    if tensor is None:
        return Text("could not be resolved from the traceback", style="yellow")
    line = Text(printable(tensor.name.variable or tensor.expression), style="bold magenta")
    where = ".".join(part for part in (tensor.name.module, tensor.name.owner) if part)
    if where:
        line.append(f"  in {printable(where)}", style="cyan")
    if tensor.name.variable and tensor.expression != tensor.name.variable:
        line.append(f"\naccessed as {printable(tensor.expression)}", style="dim")
    return line


def _origin_text(finding: Finding, *, guessed: bool) -> Text:
    """One line on where the culprit's source came from: a tensor named from the log alone is a guess."""
    origin, source_file = finding.origin, finding.source_file
    if origin is Origin.SENTINEL:
        return Text("the training process itself: the sentinel's lines name the global (no traceback)")
    if origin is Origin.JOB:
        return Text(f"the job's source, {printable(short_path(source_file or ''))}")
    if origin is Origin.INDEX:
        return Text(f"the shipped index of {finding.release}")
    if origin is Origin.INSTALLED:
        return Text(f"a local installation, {printable(short_path(source_file or ''))}, whose lines agree with the log's")
    if guessed:
        return Text("the log's text alone: the tensor is a guess from the printed line", style="yellow")
    return Text("the log's text alone", style="yellow")


def _seen_text(seen: SentinelSeen, *, also: bool) -> Text:
    """What the sentinel said of the global, on which ranks, checked by which backend."""
    ranks = f"rank{'s' if len(seen.ranks) != 1 else ''} {rank_ranges(seen.ranks)}" if seen.ranks else "a rank it does not name"
    text = Text(f"{counted(seen.tensors, 'unsafe tensor')} behind it after the recovery, on {ranks}")
    text.append(f" ({_backends(seen.backends)})", style="dim")
    if also:
        text.append("\nthe sentinel named it too, before the traceback", style="dim")
    for path in seen.paths:
        text.append(f"\n{printable(path)}", style="dim")
    return text


def _backends(backends: tuple[str, ...]) -> str:
    """Which check ran: only the npu backend is torch_npu's own check on an NPU."""
    words = {"npu": "checked by torch_npu on the NPU", "emulated": "emulated backend, no NPU check"}
    return "; ".join(words.get(backend, f"{printable(backend)} backend") for backend in backends)


def _add_classification(grid: Table, verdict: Classification) -> None:
    if verdict.scenario is None:
        grid.add_row("Scenario", Text("unclassified: " + printable(verdict.reason), style="yellow"))
    else:
        what = {1: "re-initialise it in the rollback phase", 2: "rebuild it in the repair phase from the replica rank"}
        line = Text(f"{verdict.scenario} — {what[verdict.scenario]}", style="bold green")
        source = f"rule {verdict.rule}" if verdict.rule else f"source heuristics, {verdict.confidence} confidence"
        line.append(f"  ({source})", style="dim")
        grid.add_row("Scenario", line)
        grid.add_row("Why", Text(printable(verdict.reason)))
    for evidence in verdict.evidence:
        grid.add_row("Evidence", Text(printable(str(evidence)), style="dim"))
    if isinstance(verdict.fix, FixPlan):
        where = " and ".join(f"{function}()" for function, _, _ in _fix_blocks(verdict.fix))
        grid.add_row("Fix", Text(f"below the box: code for {where} ({verdict.fix.profile} adaptor)", style="bold"))


def _fix_blocks(fix: FixPlan) -> list[tuple[str, str, str]]:
    """(function, where it runs, code) for each block of a fix: one, or the receive and the send side."""
    if fix.peer_function is None or fix.peer_code is None:
        return [(fix.function, "", fix.code)]
    return [(fix.function, "on the faulty rank, ", fix.code), (fix.peer_function, "on the replica rank, ", fix.peer_code)]


def _fix_code(previews: tuple[Preview, ...]) -> list[RenderableType]:
    """A finding's fix printed outside its box, so that every line can be copied whole at any width:
    each block to paste at the end of its function (`fix` shows a diff of those it can write)."""
    parts: list[RenderableType] = []
    for block in previews:
        side = f"{block.side}, " if block.side else ""
        if block.imports:
            top = Text(
                f"# at the top of {block.function}()'s file, what it does not import yet:", style="bold", overflow="ignore"
            )
            parts.extend([top, CodeToCopy("\n".join(block.imports)), Text("")])
        heading = Text(f"# {side}at the end of {block.function}() (paste it):", style="bold", overflow="ignore")
        parts.extend([heading, CodeToCopy(textwrap.dedent("\n".join(block.lines))), Text("")])
    return parts


# What the phase line calls each kind of fault (`log.recovery.CatchKind`): a UCE or ECC error is the hardware fault.
_FAULT_WORDS: dict[CatchKind, str] = {
    "memory-fault": "hardware fault",
    "link-fault": "link fault",
    "precision-retry": "precision error",
}


def _phase_text(item: DiagnosedFinding, diagnosis: Diagnosis) -> str:
    context = diagnosis.recovery
    detail = []
    by_kind: dict[str, list[int]] = {}
    for rank, kind in sorted(context.fault_kinds().items()):
        by_kind.setdefault(_FAULT_WORDS[kind], []).append(rank)
    for words, ranks in by_kind.items():
        detail.append(f"{words} on rank{'s' if len(ranks) != 1 else ''} {rank_ranges(ranks)}")
    if context.step is not None:
        detail.append(f"recovery at step {context.step}")
    suffix = f" ({', '.join(detail)})" if detail else ""
    if item.finding.unsafe is None:
        return "left unsafe by the recovery, found by the sentinel before the first iteration read it" + suffix
    return {
        "after-recovery": "first iteration after recovery" + suffix,
        "rollback": "inside the rollback callback" + suffix,
        "repair": "inside the repair callback" + suffix,
        "none": "no MindIO recovery in the log" + suffix,
    }[item.phase]


class _FrameText:
    """`path:line in function`: the whole path where the width allows it, else its tail (`short_path`)."""

    def __init__(self, frame: Frame) -> None:
        self.whole, self.short = self._text(frame.file.replace("\\", "/"), frame), self._text(short_path(frame.file), frame)

    @staticmethod
    def _text(path: str, frame: Frame) -> Text:
        text = Text(printable(path), style="cyan")
        if frame.line is not None:
            text.append(f":{frame.line}", style="cyan")
        return text.append(f" in {printable(frame.function)}")

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.whole if self.whole.cell_len <= options.max_width else self.short

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(min(self.short.cell_len, options.max_width), min(self.whole.cell_len, options.max_width))


def short_path(path: str) -> str:
    """A frame path as people read it: from the package on for installed code, the tail otherwise."""
    normal = path.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in normal:
            return normal.split(marker, 1)[1]
    parts = normal.split("/")
    return normal if len(parts) <= 5 else "…/" + "/".join(parts[-4:])


def _fix_place(suspect: Suspect, number: int) -> str:
    """Where a suspect's fix goes, and the option that writes it; or, in plain words, why none is shown."""
    fix = suspect.classification.fix
    if isinstance(fix, FixPlan):
        where = f"{fix.peer_function}() and {fix.function}()" if fix.peer_function else f"{fix.function}()"
        return f"in {where} ({fix.profile} adaptor), written by fix --suspect {number}"
    return fix.reason if isinstance(fix, NoFix) else "none shown"


def _suspect_name(suspect: Suspect) -> Text:
    """A suspect as a finding's Tensor row shows a tensor: its name, then where it lives. A rule that
    names its globals by a pattern shows the names the pattern matches (its title when they are many
    or not a plain list), and a module known only by a pattern is shown as that pattern."""
    block, tensor = suspect.block, suspect.tensor
    names = sorted(finite_names(block.variable_regex) or ()) if tensor.name.variable is None else [tensor.name.variable]
    if not names or len(names) > SUSPECT_NAMES:
        return Text(printable(suspect.rule.title), style="bold cyan")
    line = Text(printable(", ".join(names)), style="bold cyan")
    holder = ".".join(part for part in (block.module, block.owner) if part)
    if holder:
        line.append(f"  in {printable(holder)}", style="cyan")
    if block.module is None and block.file:  # no module: the file the rule knows it is read in
        line.append(f"{',' if holder else ' '} read in {printable(block.file.removeprefix('*/'))}", style="cyan")
    return line


def _untraced(untraced: Untraced) -> RenderableType:
    shortlist = untraced.shortlist
    parts: list[RenderableType] = [Text(untraced_reason(untraced) + ".", style="yellow")]
    parts.append(Text(printable(fault_said(shortlist.fault)) + "."))
    if not shortlist.suspects:
        parts.append(
            Text(
                "No framework global fits what the log shows of the job (its features, releases and adaptor): "
                "the tensor is likely a global of the job's own code. The sentinel names it at the next fault.",
                style="bold",
            )
        )
        return Group(*parts)
    basis = ["the arguments dump" if shortlist.arguments else "no arguments dump (features unknown)"]
    shown = " or ".join(profile.id for profile in shortlist.shown)
    basis.append(f"the {shown} adaptor" if shown else "adaptor generation unknown")
    parts.append(Text(f"Suspects, most likely first ({', '.join(basis)}):", style="bold"))
    width = len(f"{len(shortlist.suspects)}.")  # the numbers right-aligned, their lines under one column
    for number, suspect in enumerate(shortlist.suspects, 1):
        verdict = suspect.classification
        header = _suspect_name(suspect)
        header.append(f"  scenario {verdict.scenario}, rule {suspect.rule.id}, confidence {suspect.confidence}")
        indent = " " * (width + 3)
        parts.append(Hanging(f"  {f'{number}.':>{width}} ", header))
        parts.append(Hanging(f"{indent}why: ", Text(printable("; ".join(suspect.why)))))
        if suspect.alternatives:
            parts.append(Hanging(f"{indent}or, by release or module: ", Text(", ".join(suspect.alternatives))))
        parts.append(Hanging(f"{indent}fix: ", Text(printable(_fix_place(suspect, number)))))
    if len(shortlist.suspects) > 1:
        parts.append(
            Text(
                f"{len(shortlist.suspects)} suspects survive and the log cannot tell them apart: the sentinel "
                "names the one at the next fault (unsafe-doctor sentinel install)."
            )
        )
    return Group(*parts)


def _generation_text(read: GenerationEvidence, possible: Sequence[AdaptorProfile]) -> RenderableType:
    """The decision, then each message of a generation still possible that the log shows, by its first line."""
    matched = ", ".join(f"{generation} {count}" for generation, count in read.counts.items() if count)
    decision = {
        "decided": f"the log's adaptor lines show {read.generations[0]}",
        "tie": f"the log's adaptor lines tie between {', '.join(read.generations)}",
        "none": "the log holds no line an adaptor generation logs",
    }[read.decision]
    parts: list[RenderableType] = [
        Text(printable(f"Adaptor generation: {decision}" + (f" (messages matched: {matched})" if matched else "")), style="bold")
    ]
    for first, count in read.shown([profile.id for profile in possible]):
        more = f" (and {counted(count - 1, 'more line')})" if count > 1 else ""
        parts.append(Hanging("  ", Text(printable(f"{first.source}:{first.offset}  {first.line.strip()}{more}"))))
        logged_by = ", ".join(first.message.generations)
        parts.append(
            Hanging(
                "    message: ",
                Text(printable(f"{first.message.text}  ({first.message.where}; logged by {logged_by})"), style="dim"),
            )
        )
    return Group(*parts)


def _no_finding(diagnosis: Diagnosis) -> RenderableType:
    if diagnosis.hits:
        return Text(
            f"The unsafe-data error appears {counted(diagnosis.hits, 'time')}, but no traceback came with it "
            "(the log may be cut or filtered): the tensor cannot be located.",
            style="yellow",
        )
    text = Text("No 'There is unsafe data in the input tensor' error in the log.", style="green")
    error = diagnosis.last_error
    if error is not None:
        rank = f" on rank {error.rank}" if error.rank is not None else ""
        text.append(f"\nThe log ends with another error{rank}: ", style="default")
        first = error.message.splitlines()[0] if error.message else ""
        text.append(printable(f"{error.exception_type}: {first}"), style="red")
    return text


def _sentinel_checks(diagnosis: Diagnosis) -> Text:
    """Per rank, what the sentinel checked, with which backend, and whether its walk stopped early;
    where the adaptor's block could not run it, and why."""
    groups: dict[tuple[str, str, str | None], list[Summary]] = {}
    for check in diagnosis.sentinel_checks:
        groups.setdefault((check.backend, check.mode, check.stopped_early), []).append(check)
    text = Text("Sentinel checks:", style="bold")
    for (backend, mode, early), checks in groups.items():
        who = _who([check.rank for check in checks])
        counts = sorted(check.tensors_checked for check in checks)
        checked = f"{counts[0]:,}" if counts[0] == counts[-1] else f"{counts[0]:,}–{counts[-1]:,}"
        unsafe = max(check.unsafe_globals for check in checks)
        found = f"up to {counted(unsafe, 'unsafe global')}" if unsafe else "clean"
        if not unsafe and counts[0] == 0:  # a check of no tensor vouches for nothing
            found = "safety unknown" if counts[-1] == 0 else "clean on the ranks that checked any"
        gaps = [f"stopped early: {printable(early)}, so globals past it were not checked"] if early else []
        unread = max(check.not_walked for check in checks)
        if unread:
            named = next((check.not_walked_first[0] for check in checks if check.not_walked_first), None)
            first = f", the first {printable(named)}" if named else ""
            gaps.append(f"could not walk up to {counted(unread, 'object')}{first}")
        text.append(f"\n  {who}: {checked} tensors checked ({_backends((backend,))}), mode {printable(mode)}, {found}; ")
        text.append("; ".join(gaps) or "walk complete", style="yellow" if gaps else "default")
    failed: dict[str, list[int | None]] = {}
    for failure in diagnosis.sentinel_failures:
        failed.setdefault(failure.error, []).append(failure.rank)
    for error, where in failed.items():
        text.append(f"\n  the sentinel could not run on {_who(where)}: {printable(error)}", style="yellow")
    for item in diagnosis.sentinel_served:  # the replica's side of the repair's heal
        what = f"sent {counted(item.sent, 'tensor')} of {printable(item.dotted)}" if item.dotted else "heal stopped"
        refused = f"; not sent: {printable(item.refused)}" if item.refused else ""
        text.append(
            f"\n  {_who([item.rank])} {what} to rank {item.peer} in the repair{refused}", style="yellow" if refused else "default"
        )
    if diagnosis.sentinel_lines_ignored:
        text.append(
            f"\n  {counted(diagnosis.sentinel_lines_ignored, 'sentinel line')} not read: damaged, naming no plain Python "
            "name, or past the reading budget",
            style="yellow",
        )
    return text


def _who(ranks: Sequence[int | None]) -> str:
    known = sorted({rank for rank in ranks if rank is not None})
    return f"rank{'s' if len(known) != 1 else ''} {rank_ranges(known)}" if known else "a process with no rank"


def _summary(diagnosis: Diagnosis, elapsed: float) -> Text:
    ranks = {rank for item in diagnosis.findings for rank in item.finding.ranks}
    ranks |= set(diagnosis.untraced.ranks if diagnosis.untraced else ())
    size = sum(info.bytes for info in diagnosis.inputs)
    pieces = [_findings_count(diagnosis)]
    if ranks:
        pieces[0] += f" on {counted(len(ranks), 'rank')}"
    if diagnosis.ranks_seen:
        pieces.append(f"{counted(len(diagnosis.ranks_seen), 'rank')} seen")
    if diagnosis.first_failed_rank is not None:
        pieces.append(f"first failure: rank {diagnosis.first_failed_rank}")
    pieces += _releases(diagnosis)
    if diagnosis.hits_not_parsed:
        pieces.append(f"{counted(diagnosis.hits_not_parsed, 'more unsafe-data message')} counted, not parsed")
    pieces.append(f"{counted(len(diagnosis.inputs), 'input')}, {_size(size)}")
    pieces.append(f"{elapsed:.2f} s")
    return Text(printable(" · ".join(pieces)), style="bold")


def _releases(diagnosis: Diagnosis) -> list[str]:
    """The releases the report reasons with (the suspects and stale resets too), each with how it
    is known: the log's frames, the adaptor generation's pairing, or only this machine's install;
    then the frames' releases that name no version (a branch, master), as the findings' sources name them."""
    fingerprinted = diagnosis.context.workspace.releases
    environment = diagnosis.context.environment
    pieces = []
    job_releases = environment.job_releases()
    for name, (versions, origin) in job_releases.items():
        if name in fingerprinted:
            pieces.append(fingerprinted[name].describe())
            continue
        dumped = environment.dumped_release(name)
        if dumped is not None:
            pieces.append(dumped.describe())
            continue
        shown = f"{name} {', '.join(map(str, versions))}"
        if origin == "installed":
            shown += " (installed here)"
        elif origin != environment.origins.get(name):  # not read anywhere: the generation's pairing
            shown += f" ({origin})"
        pieces.append(shown)
    return pieces + [match.describe() for name, match in fingerprinted.items() if name not in job_releases]


def _findings_count(diagnosis: Diagnosis) -> str:
    """The findings the JSON lists: the located ones, and one for the ranks whose error came with no
    traceback, which names no tensor: suspects at most."""
    located = len(diagnosis.findings)
    if diagnosis.untraced is None:
        return counted(located, "finding")
    kind = "suspects only, no traceback" if diagnosis.untraced.shortlist.suspects else "no traceback, no suspect"
    return f"1 finding ({kind})" if not located else f"{counted(located + 1, 'finding')} (1 with {kind})"


def _size(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    scaled = float(count)
    for unit in ("KB", "MB", "GB"):
        scaled /= 1024
        if scaled < 1024 or unit == "GB":
            break
    return f"{scaled:.1f} {unit}"
