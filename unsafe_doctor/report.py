"""Stage 6: a Diagnosis -> JSON (versioned contract), SARIF, or rich renderables for a terminal.

Nothing here prints: the CLI decides where the output goes.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from unsafe_doctor import __version__
from unsafe_doctor.classify import Classification, FixPlan, NoFix
from unsafe_doctor.diagnosis import DiagnosedFinding, Diagnosis
from unsafe_doctor.knowledge import KnowledgeBase, Rule
from unsafe_doctor.source.files import is_internal_file
from unsafe_doctor.tracebacks import Frame

if TYPE_CHECKING:
    from unsafe_doctor.verify import Verification  # verify loads libcst: diagnose's output does without it

SCHEMA = "unsafe-doctor/diagnosis/v1"
SHORT_STACK = 6  # frames shown in a panel, innermost last


def to_json(diagnosis: Diagnosis) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "inputs": [{"name": info.name, "bytes": info.bytes} for info in diagnosis.inputs],
        "findings": [_finding_json(item, diagnosis) for item in diagnosis.findings],
        "summary": {
            "ranks_seen": list(diagnosis.ranks_seen),
            "first_failed_rank": diagnosis.first_failed_rank,
            "unsafe_messages": diagnosis.hits,
            "unsafe_messages_not_parsed": diagnosis.hits_not_parsed,
            "last_error": _last_error_json(diagnosis),
            "untraced_ranks": list(diagnosis.untraced_ranks),
            "loss_scaling": diagnosis.loss_scaling,  # "none", "grad-scaler", or null when the log does not say
            "frameworks": {
                name: {"version": str(version), "from": diagnosis.context.environment.origins[name]}
                for name, version in diagnosis.context.environment.versions.items()
            },
            "adaptor": {
                "file": str(diagnosis.context.environment.adaptor) if diagnosis.context.environment.adaptor else None,
                "profile": diagnosis.context.environment.profile.id,
            },
            "stale_resets": [
                {"file": str(item.file), "line": item.line, "statement": item.statement, "why": item.why}
                for item in diagnosis.stale
            ],
        },
    }


def _finding_json(item: DiagnosedFinding, diagnosis: Diagnosis) -> dict[str, Any]:
    finding, context, verdict = item.finding, diagnosis.recovery, item.classification
    tensor = finding.tensor
    return {
        "ranks": list(finding.ranks),
        "message": finding.unsafe.message,
        "error_code": finding.unsafe.error_code,
        "recovery": {
            "seen": context.seen,
            "fault_ranks": list(context.fault_ranks),
            "step": context.step,
            "phase": item.phase,
        },
        "culprit": _frame_json(finding.culprit) if finding.culprit else None,
        "frames": [_frame_json(frame) for frame in finding.unsafe.frames],
        "tensor": None
        if tensor is None
        else {"expression": tensor.expression, "variable": tensor.variable, "module": tensor.module, "owner": tensor.owner},
        "truncated": finding.unsafe.truncated,
        "notes": [*finding.notes, *verdict.notes],
        "scenario": verdict.scenario,
        "rule": verdict.rule,
        "confidence": verdict.confidence,
        "reason": verdict.reason,
        "evidence": [str(evidence) for evidence in verdict.evidence],
        "fix": _fix_json(verdict.fix),
    }


def _fix_json(fix: FixPlan | NoFix | None) -> dict[str, Any] | None:
    if not isinstance(fix, FixPlan):
        return None
    peer = {"function": fix.peer_function, "code": fix.peer_code} if fix.peer_function else None
    return {
        "phase": fix.phase,
        "function": fix.function,
        "code": fix.code,
        "imports": list(fix.imports),
        "peer": peer,
        "profile": fix.profile,
    }


def _frame_json(frame: Frame) -> dict[str, Any]:
    return {"file": frame.file, "line": frame.line, "function": frame.function, "source": frame.source}


def _last_error_json(diagnosis: Diagnosis) -> dict[str, Any] | None:
    error = diagnosis.last_error
    if error is None:
        return None
    return {"rank": error.rank, "type": error.exception_type, "message": error.message, "input": error.source}


def to_sarif(diagnosis: Diagnosis) -> dict[str, Any]:
    """SARIF 2.1.0: one result per finding, located at its culprit line."""
    results = []
    for item in diagnosis.findings:
        finding = item.finding
        tensor = finding.tensor
        what = tensor.variable or tensor.expression if tensor else "a tensor"
        result: dict[str, Any] = {
            "ruleId": "unsafe-data-after-recovery",
            "level": "error",
            "message": {"text": f"{what} is read while still marked unsafe (ranks {_ranks(finding.ranks)})"},
        }
        if finding.culprit is not None:
            region = {"startLine": finding.culprit.line} if finding.culprit.line else {}
            result["locations"] = [
                {"physicalLocation": {"artifactLocation": {"uri": finding.culprit.file}, "region": region}}
            ]
        results.append(result)
    return _sarif_log({"unsafe-data-after-recovery": "Global tensor left unsafe by process-level online recovery"}, results)


def _sarif_log(rules: dict[str, str], results: list[dict[str, Any]]) -> dict[str, Any]:
    """A SARIF 2.1.0 log of one run of unsafe-doctor: its rules (id -> description) and results."""
    driver = {
        "name": "unsafe-doctor",
        "version": __version__,
        "rules": [{"id": rule_id, "shortDescription": {"text": text}} for rule_id, text in rules.items()],
    }
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{"tool": {"driver": driver}, "results": results}],
    }


def to_text(diagnosis: Diagnosis, elapsed: float) -> RenderableType:
    parts: list[RenderableType] = []
    for number, item in enumerate(diagnosis.findings, 1):
        parts.append(_panel(number, item, diagnosis))
    if diagnosis.stale:
        parts.append(_stale(diagnosis))
    if diagnosis.untraced_ranks:
        parts.append(_untraced(diagnosis))
    if not diagnosis.findings and not diagnosis.untraced_ranks:
        parts.append(_no_finding(diagnosis))
    parts.append(_summary(diagnosis, elapsed))
    return Group(*parts)


def _panel(number: int, item: DiagnosedFinding, diagnosis: Diagnosis) -> Panel:
    finding = item.finding
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    tensor = finding.tensor
    if tensor is not None:
        line = Text(tensor.variable or tensor.expression, style="bold magenta")
        where = ".".join(part for part in (tensor.module, tensor.owner) if part)
        if where:
            line.append(f"  in {where}", style="cyan")
        if tensor.variable and tensor.expression != tensor.variable:
            line.append(f"\naccessed as {tensor.expression}", style="dim")
        grid.add_row("Tensor", line)
    else:
        grid.add_row("Tensor", Text("could not be resolved from the traceback", style="yellow"))
    error = Text(f"{finding.unsafe.exception_type}: {finding.unsafe.message}", style="red")
    if finding.unsafe.error_code:
        error.append(f"  [{finding.unsafe.error_code}]", style="dim")
    grid.add_row("Error", error)
    grid.add_row("Phase", _phase_text(item, diagnosis))
    if finding.culprit is not None:
        grid.add_row("Culprit", _frame_text(finding.culprit))
        if finding.culprit.source:
            start = finding.culprit.line or 1
            grid.add_row("", Syntax(finding.culprit.source, "python", line_numbers=True, start_line=start, word_wrap=True))
    frames = finding.unsafe.frames
    if frames:
        own = [frame for frame in frames if not is_internal_file(frame.file)] or list(frames)
        shown = own[-SHORT_STACK:]
        stack = Text()
        if len(frames) > len(shown):
            stack.append(f"… {len(frames) - len(shown)} more frames (outer, or torch internals)\n", style="dim")
        stack.append(Text("\n").join(_frame_text(frame) for frame in shown))
        grid.add_row("Stack", stack)
    if finding.unsafe.truncated:
        grid.add_row("", Text("The traceback is cut short in the log; what is shown is what it holds.", style="yellow"))
    _add_classification(grid, item.classification)
    for note in (*finding.notes, *item.classification.notes):
        grid.add_row("Note", Text(note, style="dim"))
    title = f"Finding {number} · rank{'s' if len(finding.ranks) != 1 else ''} {_ranks(finding.ranks) or 'unknown'}"
    return Panel(grid, title=title, title_align="left", border_style="red")


def _add_classification(grid: Table, verdict: Classification) -> None:
    if verdict.scenario is None:
        grid.add_row("Scenario", Text("unclassified: " + verdict.reason, style="yellow"))
    else:
        what = {1: "re-initialise it in the rollback phase", 2: "rebuild it in the repair phase from the replica rank"}
        line = Text(f"{verdict.scenario} — {what[verdict.scenario]}", style="bold green")
        source = f"rule {verdict.rule}" if verdict.rule else f"source heuristics, {verdict.confidence} confidence"
        line.append(f"  ({source})", style="dim")
        grid.add_row("Scenario", line)
        grid.add_row("Why", verdict.reason)
    for evidence in verdict.evidence:
        grid.add_row("Evidence", Text(str(evidence), style="dim"))
    fix = verdict.fix
    if not isinstance(fix, FixPlan):
        return
    blocks = [(fix.function, fix.code)] + ([(fix.peer_function, fix.peer_code)] if fix.peer_function else [])
    for function, code in blocks:
        where = "on the faulty rank, " if fix.peer_function and function == fix.function else ""
        where = "on the replica rank, " if fix.peer_function and function == fix.peer_function else where
        grid.add_row("Fix", Text(f"{where}at the end of {function}() ({fix.profile} adaptor):", style="bold"))
        grid.add_row("", Syntax("\n".join([*fix.imports, "", code.rstrip()]), "python", word_wrap=True))


def _phase_text(item: DiagnosedFinding, diagnosis: Diagnosis) -> str:
    context = diagnosis.recovery
    detail = []
    if context.fault_ranks:
        detail.append(f"hardware fault on rank {_ranks(context.fault_ranks)}")
    if context.step is not None:
        detail.append(f"recovery at step {context.step}")
    suffix = f" ({', '.join(detail)})" if detail else ""
    return {
        "after-recovery": "first iteration after recovery" + suffix,
        "rollback": "inside the rollback callback" + suffix,
        "repair": "inside the repair callback" + suffix,
        "none": "no MindIO recovery in the log" + suffix,
    }[item.phase]


def _frame_text(frame: Frame) -> Text:
    text = Text(short_path(frame.file), style="cyan")
    if frame.line is not None:
        text.append(f":{frame.line}", style="cyan")
    text.append(f" in {frame.function}")
    return text


def short_path(path: str) -> str:
    """A frame path as people read it: from the package on for installed code, the tail otherwise."""
    normal = path.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in normal:
            return normal.split(marker, 1)[1]
    parts = normal.split("/")
    return normal if len(parts) <= 5 else "…/" + "/".join(parts[-4:])


def _stale(diagnosis: Diagnosis) -> Text:
    text = Text("Stale resets in the adaptor's rollback:\n", style="bold yellow")
    for item in diagnosis.stale:
        text.append(f"  {item.file}:{item.line}  ", style="cyan")
        text.append(f"{item.statement}\n    {item.why}\n")
    return text


def _untraced(diagnosis: Diagnosis) -> Text:
    ranks = diagnosis.untraced_ranks
    return Text(
        f"Rank{'s' if len(ranks) != 1 else ''} {_ranks(ranks)} reported the unsafe-data error (MindIO caught it and "
        "logged only its message), with no traceback in this log: the tensor cannot be located from it. "
        "Look for the traceback in the rank's own stderr or per-rank log.",
        style="yellow",
    )


def _no_finding(diagnosis: Diagnosis) -> RenderableType:
    if diagnosis.hits:
        return Text(
            f"The unsafe-data error appears {diagnosis.hits} time(s), but no traceback came with it "
            "(the log may be cut or filtered): the tensor cannot be located.",
            style="yellow",
        )
    text = Text("No 'There is unsafe data in the input tensor' error in the log.", style="green")
    error = diagnosis.last_error
    if error is not None:
        rank = f" on rank {error.rank}" if error.rank is not None else ""
        text.append(f"\nThe log ends with another error{rank}: ", style="default")
        text.append(f"{error.exception_type}: {error.message.splitlines()[0] if error.message else ''}", style="red")
    return text


def _summary(diagnosis: Diagnosis, elapsed: float) -> Text:
    ranks = {rank for item in diagnosis.findings for rank in item.finding.ranks}
    size = sum(info.bytes for info in diagnosis.inputs)
    pieces = [f"{len(diagnosis.findings)} finding{'s' if len(diagnosis.findings) != 1 else ''}"]
    if ranks:
        pieces[0] += f" on {len(ranks)} rank{'s' if len(ranks) != 1 else ''}"
    if diagnosis.ranks_seen:
        pieces.append(f"{len(diagnosis.ranks_seen)} ranks seen")
    if diagnosis.first_failed_rank is not None:
        pieces.append(f"first failure: rank {diagnosis.first_failed_rank}")
    for name, version in diagnosis.context.environment.versions.items():
        pieces.append(f"{name} {version}")
    if diagnosis.hits_not_parsed:
        pieces.append(f"{diagnosis.hits_not_parsed} more unsafe-data messages counted, not parsed")
    pieces.append(f"{len(diagnosis.inputs)} input{'s' if len(diagnosis.inputs) != 1 else ''}, {_size(size)}")
    pieces.append(f"{elapsed:.2f} s")
    return Text(" · ".join(pieces), style="bold")


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(str(rank) for rank in ranks)


def _size(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    for unit in ("KB", "MB", "GB"):
        count /= 1024
        if count < 1024 or unit == "GB":
            break
    return f"{count:.1f} {unit}"



VERIFY_SCHEMA = "unsafe-doctor/verification/v1"
_OUTCOME_STYLE = {"proven": "green", "failed": "red", "no-fix": "red", "not-modelled": "yellow"}


def verification_json(verification: Verification) -> dict[str, Any]:
    return {
        "schema": VERIFY_SCHEMA,
        "backend": verification.backend,
        "transport": verification.transport,
        "mode": verification.mode,
        "ranks": verification.world_size,
        "faulty_rank": verification.faulty,
        "replica_rank": verification.replica,
        "seconds": round(verification.seconds, 3),
        "phase_seconds": {phase: round(value, 4) for phase, value in verification.phase_seconds.items()},
        "exit_code": verification.exit_code,
        "verdicts": [
            {
                "global": verdict.target.label,
                "scenario": verdict.target.scenario,
                "rule": verdict.target.rule,
                "fix_key": verdict.target.key,
                "outcome": verdict.outcome,
                "unpatched": verdict.unpatched,
                "patched": verdict.patched,
                "problems": list(verdict.problems),
            }
            for verdict in verification.verdicts
        ],
        "skipped": list(verification.skipped),
        "notes": list(verification.notes),
    }


def verification_text(verification: Verification) -> RenderableType:
    device = "CPU" if verification.backend == "emulated" else "NPU"
    footer = (
        f"backend: {verification.backend} ({device}, {verification.transport}) · {verification.mode} mode · "
        f"{verification.world_size} ranks (fault on rank {verification.faulty}, replica rank {verification.replica}) · "
        f"{verification.seconds:.1f} s"
    )
    parts: list[RenderableType] = []
    for verdict in verification.verdicts:
        style = _OUTCOME_STYLE[verdict.outcome]
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        grid.add_row("unpatched", verdict.unpatched)
        if verdict.patched is not None:
            grid.add_row("patched", Text(verdict.patched, style=style))
        for problem in verdict.problems[1:]:
            grid.add_row("", Text(problem, style=style))
        title = f"{verdict.outcome.upper()} · {verdict.target.label} · scenario {verdict.target.scenario}"
        parts.append(Panel(grid, title=title, title_align="left", border_style=style))
    for line in (*verification.skipped, *verification.notes):
        parts.append(Text(f"note: {line}", style="dim"))
    parts.append(Text(footer, style="dim"))
    return Group(*parts)


def rule_json(rule: Rule) -> dict[str, Any]:
    blocks = [{key: value for key, value in asdict(match).items() if value is not None} for match in rule.matches]
    return {
        "id": rule.id,
        "title": rule.title,
        "match": blocks[0],
        "also_match": blocks[1:],  # further match blocks, any one of which suffices
        "framework": {"package": rule.framework, "versions": str(rule.versions)} if rule.framework else None,
        "scenario": rule.scenario,
        "phase": rule.phase,
        "conditions": list(rule.conditions),
        "fix": {key: value for key, value in asdict(rule.fix).items() if value},
        "reason": rule.reason,
        "references": list(rule.references),
        "origin": rule.origin,
    }


def rules_table(knowledge: KnowledgeBase) -> Table:
    """id, scenario and versions on one line, the title under the id: readable in 80 columns."""
    table = Table(box=None, header_style="bold")
    table.add_column("rule", ratio=1, overflow="fold")
    table.add_column("scenario", justify="center")
    table.add_column("versions", no_wrap=True)
    for rule in sorted(knowledge.rules, key=lambda rule: rule.id):
        versions = f"{rule.framework} {rule.versions}" if rule.framework else "any"
        table.add_row(Text(rule.id, style="bold").append(f"\n  {rule.title}", style="dim"), str(rule.scenario), versions)
    return table


def rule_panel(rule: Rule, knowledge: KnowledgeBase) -> Panel:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    grid.add_row("Title", rule.title)
    blocks = [", ".join(f"{key}={value}" for key, value in asdict(match).items() if value) for match in rule.matches]
    grid.add_row("Matches", "\nor ".join(blocks))
    grid.add_row("Versions", f"{rule.framework} {rule.versions}" if rule.framework else "any")
    grid.add_row("Scenario", f"{rule.scenario}, fixed in the {rule.phase} phase")
    if rule.conditions:
        grid.add_row("Only when", "; ".join(knowledge.conditions[name].description for name in rule.conditions))
    grid.add_row("Why", rule.reason)
    for label, template in (("Fix", rule.fix.code), ("Receive", rule.fix.recv), ("Send", rule.fix.send)):
        if template:
            grid.add_row(label, Syntax("\n".join([*rule.fix.imports, "", template.rstrip()]), "python", word_wrap=True))
    for reference in rule.references:
        grid.add_row("See", reference)
    grid.add_row("Defined", Text(rule.origin, style="dim"))
    return Panel(grid, title=rule.id, title_align="left")


# --- audit ---------------------------------------------------------------------------------------

if TYPE_CHECKING:
    from collections.abc import Mapping

    from unsafe_doctor.audit import Audit, AuditedHolder, Site
    from unsafe_doctor.fix import FileEdit, Plan

AUDIT_SCHEMA = "unsafe-doctor/audit/v1"
AUDIT_SARIF_RULES = {
    "uncovered-global-tensor": "Global that holds device tensors and that no recovery step resets, rebuilds or repairs",
    "unsafe-reset": "Recovery code that touches a global tensor in a way that fails on unsafe memory",
    "stale-reset": "Reset in the adaptor's rollback of a name the framework no longer has",
}
_STATUS_STYLE = {"uncovered": "bold red", "unsafe": "bold yellow", "covered": "green"}
SARIF_RELATED = 10  # writers listed with each result
_PLACEMENT_TEXT = {"device": "on the device", "unknown": "device unknown"}


def audit_to_json(audit: Audit) -> dict[str, Any]:
    environment = audit.context.environment
    return {
        "schema": AUDIT_SCHEMA,
        "paths": [str(path) for path in audit.paths],
        "files": audit.files,
        "unreadable": list(audit.unreadable),
        "adaptor": {"file": str(environment.adaptor) if environment.adaptor else None, "profile": environment.profile.id},
        "frameworks": {
            name: {"version": str(version), "from": environment.origins[name]} for name, version in environment.versions.items()
        },
        "holders": [_holder_json(item) for item in audit.holders],
        "stale_resets": [
            {"file": str(item.file), "line": item.line, "statement": item.statement, "kind": item.kind, "why": item.why}
            for item in audit.stale
        ],
        "notes": list(audit.notes),
        "summary": _audit_counts(audit),
    }


def _audit_counts(audit: Audit) -> dict[str, int]:
    statuses = [item.coverage.status for item in audit.holders]
    return {
        "holders": len(statuses),
        "uncovered": statuses.count("uncovered"),
        "unsafe": statuses.count("unsafe"),
        "covered": statuses.count("covered"),
        "fixable": len(audit.fixable),
    }


def _site_json(site: Site) -> dict[str, Any]:
    return {"file": site.file, "line": site.line, "function": site.function, "code": site.code}


def _holder_json(item: AuditedHolder) -> dict[str, Any]:
    holder, coverage, verdict = item.holder, item.coverage, item.classification
    return {
        "name": holder.name,
        "kind": holder.kind,
        "module": holder.module,
        "owner": holder.owner,
        "variable": holder.variable,
        "placement": holder.placement,
        "definition": _site_json(holder.definition),
        "tensors": [_site_json(site) for site in holder.evidence],
        "writers": [_site_json(site) for site in holder.writers],
        "readers": [_site_json(site) for site in holder.readers],
        "imported_by": [_site_json(site) for site in holder.importers],
        "coverage": {
            "status": coverage.status,
            "how": coverage.how,
            "function": coverage.function,
            "via": list(coverage.via),
            "sites": [_site_json(site) for site in coverage.sites],
            "why": coverage.why,
        },
        "scenario": verdict.scenario if verdict else None,
        "rule": verdict.rule if verdict else None,
        "confidence": verdict.confidence if verdict else None,
        "reason": verdict.reason if verdict else None,
        "evidence": [str(evidence) for evidence in verdict.evidence] if verdict else [],
        "notes": list(verdict.notes) if verdict else [],
        "fix": _fix_json(verdict.fix) if verdict else None,
    }


def audit_to_sarif(audit: Audit, fixes: Mapping[str, Plan]) -> dict[str, Any]:
    """SARIF 2.1.0: each holder not covered is a result at its definition, with its fix (one
    insertion per adaptor function) where one exists; each stale reset a result in the adaptor."""
    results = []
    for item in audit.uncovered:
        holder, coverage, verdict = item.holder, item.coverage, item.classification
        scenario = f"; scenario {verdict.scenario} ({verdict.rule or 'heuristics'})" if verdict and verdict.scenario else ""
        if coverage.status == "unsafe":
            text = f"{holder.name} ({holder.kind}, {_PLACEMENT_TEXT[holder.placement]}): {coverage.why}"
        else:
            text = f"{holder.name} ({holder.kind}, {_PLACEMENT_TEXT[holder.placement]}) is not reset, rebuilt or repaired by recovery{scenario}"
        result: dict[str, Any] = {
            "ruleId": "unsafe-reset" if coverage.status == "unsafe" else "uncovered-global-tensor",
            "level": "error",
            "message": {"text": text},
            "locations": [_sarif_location(holder.definition)],
            "relatedLocations": [
                {**_sarif_location(site), "message": {"text": f"written in {site.function or 'module body'}"}}
                for site in holder.writers[:SARIF_RELATED]
            ],
            "properties": {
                "kind": holder.kind,
                "placement": holder.placement,
                "scenario": verdict.scenario if verdict else None,
                "rule": verdict.rule if verdict else None,
                "confidence": verdict.confidence if verdict else None,
            },
        }
        plan = fixes.get(holder.name)
        if plan is not None and plan.edits:
            result["fixes"] = [
                {
                    "description": {"text": f"unsafe-doctor fix for {holder.name} ({verdict.rule or 'generic'})"},
                    "artifactChanges": [_sarif_change(edit) for edit in plan.edits],
                }
            ]
        results.append(result)
    for stale in audit.stale:
        results.append(
            {
                "ruleId": "stale-reset",
                "level": "warning",
                "message": {"text": f"{stale.statement}: {stale.why}"},
                "locations": [_sarif_location_of(str(stale.file), stale.line)],
            }
        )
    return _sarif_log(AUDIT_SARIF_RULES, results)


def _sarif_uri(file: str) -> str:
    path = Path(file)
    return path.as_uri() if path.is_absolute() else path.as_posix()


def _sarif_location_of(file: str, line: int) -> dict[str, Any]:
    return {"physicalLocation": {"artifactLocation": {"uri": _sarif_uri(file)}, "region": {"startLine": line}}}


def _sarif_location(site: Site) -> dict[str, Any]:
    return _sarif_location_of(site.file, site.line)


def _sarif_change(edit: FileEdit) -> dict[str, Any]:
    """The edit as SARIF replacements: each inserted run of lines at its place in the original."""
    before = edit.original.decode(edit.encoding, errors="replace").splitlines(keepends=True)
    after = edit.updated.decode(edit.encoding, errors="replace").splitlines(keepends=True)
    offsets = [0]
    for line in before:
        offsets.append(offsets[-1] + len(line))
    replacements = []
    for tag, first, last, new_first, new_last in difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        region: dict[str, Any] = {"charOffset": offsets[first], "charLength": offsets[last] - offsets[first]}
        if tag == "insert" and first < len(before):
            region.update(startLine=first + 1, startColumn=1, endLine=first + 1, endColumn=1)
        replacements.append({"deletedRegion": region, "insertedContent": {"text": "".join(after[new_first:new_last])}})
    return {"artifactLocation": {"uri": _sarif_uri(str(edit.path))}, "replacements": replacements}


def audit_to_text(audit: Audit, elapsed: float) -> RenderableType:
    parts: list[RenderableType] = []
    if audit.holders:
        table = Table(header_style="bold", show_lines=True)
        table.add_column("global", overflow="fold", ratio=4)
        table.add_column("written · read", overflow="fold", ratio=2)
        table.add_column("recovery", overflow="fold", ratio=3)
        table.add_column("scenario", overflow="fold", ratio=3)
        for item in audit.holders:
            table.add_row(*_holder_cells(item))
        parts.append(table)
    else:
        parts.append(Text("No global that holds device tensors was found.", style="green"))
    if audit.stale:
        text = Text("Stale resets in the adaptor's rollback:\n", style="bold yellow")
        for item in audit.stale:
            text.append(f"  {item.file}:{item.line}  ", style="cyan")
            text.append(f"{item.statement}\n    {item.why}\n")
        parts.append(text)
    for note in audit.notes:
        parts.append(Text(f"note: {note}", style="yellow"))
    parts.append(_audit_summary(audit, elapsed))
    return Group(*parts)


def _holder_cells(item: AuditedHolder) -> tuple[Text, Text, Text, Text]:
    holder, coverage, verdict = item.holder, item.coverage, item.classification
    name = Text(holder.name, style="bold magenta")
    name.append(f"\n{holder.kind}, {_PLACEMENT_TEXT[holder.placement]}", style="dim")
    name.append(f"\ndefined {_site_text(holder.definition)}", style="cyan")
    uses = Text()
    for label, sites in (("w", holder.writers), ("r", holder.readers)):
        shown = [site for site in sites if site != holder.definition]
        if shown:
            more = f" +{len(shown) - 1}" if len(shown) > 1 else ""
            uses.append(f"{label} {_site_text(shown[0])}{more}\n", style="cyan")
    if holder.importers:
        uses.append(f"imported by name: {_site_text(holder.importers[0])}", style="dim")
    status = Text(coverage.status, style=_STATUS_STYLE[coverage.status])
    if coverage.status != "uncovered":
        status.append(f"\n{coverage.why}")
    scenario = Text()
    if verdict is None:
        scenario.append("—", style="dim")
    elif verdict.scenario is None:
        scenario.append("unclassified", style="yellow")
    else:
        scenario.append(str(verdict.scenario), style="bold green")
        scenario.append(f" {verdict.rule}" if verdict.rule else f" heuristics, {verdict.confidence}", style="dim")
        if coverage.status == "uncovered" and isinstance(verdict.fix, FixPlan):
            peer = f" + {verdict.fix.peer_function}()" if verdict.fix.peer_function else ""
            scenario.append(f"\nfix: {verdict.fix.function}(){peer}")
    return name, uses, status, scenario


def _site_text(site: Site) -> str:
    """The file's name and line: the global's dotted name already says which package."""
    return f"{site.file.replace(chr(92), '/').rpartition('/')[2]}:{site.line}"


def _audit_summary(audit: Audit, elapsed: float) -> Text:
    counts = _audit_counts(audit)
    environment = audit.context.environment
    pieces = [
        f"{counts['holders']} global{'s' if counts['holders'] != 1 else ''}: {counts['uncovered']} uncovered, "
        f"{counts['unsafe']} unsafe, {counts['covered']} covered"
    ]
    if counts["fixable"]:
        pieces.append(f"{counts['fixable']} with a fix (--fix)")
    pieces.append(f"{audit.files} file{'s' if audit.files != 1 else ''}")
    if environment.adaptor is not None:
        pieces.append(f"adaptor {environment.adaptor} ({environment.profile.id})")
    for name, version in environment.versions.items():
        pieces.append(f"{name} {version}")
    pieces.append(f"{elapsed:.2f} s")
    return Text(" · ".join(pieces), style="bold")
