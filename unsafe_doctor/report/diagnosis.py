"""A Diagnosis as JSON (the versioned contract) or SARIF; for a terminal, `diagnosis_text`. No rich here:
a JSON or SARIF report loads no renderer."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from unsafe_doctor.diagnose.locate import Finding, SentinelSeen
from unsafe_doctor.diagnose.pipeline import DiagnosedFinding, Diagnosis, Untraced
from unsafe_doctor.log.recovery import MINDIO_RELEASES, UNTRACED_FORMS, FaultReading, RecoveryContext, RecoveryPhase
from unsafe_doctor.log.sentinel_lines import Summary
from unsafe_doctor.log.tracebacks import Frame
from unsafe_doctor.report.common import adaptor_json, fix_plan_json, frameworks_json, rank_ranges
from unsafe_doctor.report.sarif import file_uri, location, path_reference, sarif_log
from unsafe_doctor.source.workspace import Origin

if TYPE_CHECKING:  # for types only: a diagnosis with a traceback loads no suspects
    from unsafe_doctor.diagnose.suspects import Suspect

SCHEMA = "unsafe-doctor/diagnosis/v1"


def diagnosis_json(diagnosis: Diagnosis) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "inputs": [{"name": info.name, "bytes": info.bytes} for info in diagnosis.inputs],
        "skipped_inputs": [{"name": item.name, "reason": item.reason} for item in diagnosis.skipped],
        "findings": [
            *(_finding_json(item, diagnosis) for item in diagnosis.findings),
            *([_untraced_json(diagnosis.untraced, diagnosis)] if diagnosis.untraced else []),
        ],
        "sentinel": [_check_json(check) for check in diagnosis.sentinel_checks],
        "sentinel_failures": [{"rank": failure.rank, "error": failure.error} for failure in diagnosis.sentinel_failures],
        "sentinel_served": [
            {"rank": item.rank, "peer": item.peer, "global": item.dotted, "sent": item.sent, "refused": item.refused}
            for item in diagnosis.sentinel_served
        ],
        "summary": {
            "ranks_seen": list(diagnosis.ranks_seen),
            "first_failed_rank": diagnosis.first_failed_rank,
            "unsafe_messages": diagnosis.hits,
            "unsafe_messages_not_parsed": diagnosis.hits_not_parsed,
            "last_error": _last_error_json(diagnosis),
            "untraced_ranks": list(diagnosis.untraced_ranks),
            "mindio": _mindio_json(diagnosis),
            "arguments_dump": None if diagnosis.arguments is None else diagnosis.arguments.title,
            "sentinel_lines_ignored": diagnosis.sentinel_lines_ignored,
            "loss_scaling": diagnosis.loss_scaling,  # "none", "grad-scaler", or null when the log does not say
            "frameworks": frameworks_json(diagnosis.context.environment),
            "adaptor": adaptor_json(diagnosis.context.environment),
            "generation": _generation_json(diagnosis),
            "stale_resets": [
                {"file": str(item.file), "line": item.line, "statement": item.statement, "why": item.why}
                for item in diagnosis.stale
            ],
        },
    }


def _generation_json(diagnosis: Diagnosis) -> dict[str, Any] | None:
    """The generation the log's adaptor lines show, and the messages of those still possible that it shows."""
    read = diagnosis.generation
    if read is None:
        return None
    possible = [profile.id for profile in diagnosis.context.environment.possible]
    return {
        "decision": read.decision,
        "read": list(read.generations),
        "messages_matched": {generation: count for generation, count in read.counts.items() if count},
        "possible": possible,
        "evidence": [  # each message once: its first line, how many lines show it, the generations that log it
            {
                "message": item.message.text,
                "generations": list(item.message.generations),
                "from": item.message.where,
                "line": item.line,
                "source": item.source,
                "offset": item.offset,
                "lines": count,
            }
            for item, count in read.shown(possible)
        ],
    }


def _finding_json(item: DiagnosedFinding, diagnosis: Diagnosis) -> dict[str, Any]:
    finding, context, verdict = item.finding, diagnosis.recovery, item.classification
    tensor, unsafe = finding.tensor, finding.unsafe
    return {
        "ranks": list(finding.ranks),
        "message": unsafe.message if unsafe else None,
        "error_code": unsafe.error_code if unsafe else None,
        "recovery": _recovery_json(context, item.phase),
        "culprit": _frame_json(finding.culprit) if finding.culprit else None,
        "frames": [_frame_json(frame) for frame in unsafe.frames] if unsafe else [],
        "tensor": None
        if tensor is None
        else {
            "expression": tensor.expression,
            "variable": tensor.name.variable,
            "module": tensor.name.module,
            "owner": tensor.name.owner,
        },
        "source_from": finding.origin.value,
        "source_release": finding.release,
        "source_confidence": finding.origin.confidence,
        "truncated": unsafe.truncated if unsafe else False,
        "alternatives": [{"variable": each.variable, "module": each.module, "how": each.how} for each in finding.alternatives],
        "notes": [*finding.notes, *healed_notes(finding.sentinel), *verdict.notes],
        "scenario": verdict.scenario,
        "rule": verdict.rule,
        "confidence": verdict.confidence,
        "reason": verdict.reason,
        "evidence": [str(evidence) for evidence in verdict.evidence],
        "fix": fix_plan_json(verdict.fix),
        "found_by": [*(["traceback"] if unsafe else []), *(["sentinel"] if finding.sentinel else [])],
        "sentinel": _seen_json(finding.sentinel) if finding.sentinel else None,
        "suspects": [],
    }


def _recovery_json(context: RecoveryContext, phase: RecoveryPhase | None) -> dict[str, Any]:
    """MindIO's recovery as a finding's JSON gives it: `faults` names each fault rank's kind, as the text's
    phase line does (`fault_ranks`, the same ranks, stays for readers of the first contract)."""
    return {
        "seen": context.seen,
        "fault_ranks": list(context.fault_ranks),
        "faults": [{"rank": rank, "kind": kind} for rank, kind in sorted(context.fault_kinds().items())],
        "step": context.step,
        "phase": phase,
    }


def _untraced_json(untraced: Untraced, diagnosis: Diagnosis) -> dict[str, Any]:
    """The ranks that reported the error with no traceback: a finding with no tensor, and its suspects."""
    context = diagnosis.recovery
    return {
        "ranks": list(untraced.ranks),
        "message": "There is unsafe data in the input tensor.",
        "error_code": None,
        "recovery": _recovery_json(context, None),
        "culprit": None,
        "frames": [],
        "tensor": None,
        "source_from": None,
        "source_release": None,
        "source_confidence": None,
        "truncated": False,
        "alternatives": [],
        "notes": [untraced_reason(untraced), fault_said(untraced.shortlist.fault)],
        "scenario": None,
        "rule": None,
        "confidence": None,
        "reason": "no traceback: the tensor is not named in the log",
        "evidence": [],
        "fix": None,
        "found_by": ["mindio-catch" if untraced.form else "message"],
        "sentinel": None,
        "suspects": [_suspect_json(suspect) for suspect in untraced.shortlist.suspects],
    }


def _suspect_json(suspect: Suspect) -> dict[str, Any]:
    tensor, verdict = suspect.tensor, suspect.classification
    return {
        "variable": tensor.name.variable or tensor.expression,
        "module": tensor.name.module,
        "owner": tensor.name.owner,
        "rule": suspect.rule.id,
        "scenario": verdict.scenario,
        "why": list(suspect.why),
        "confidence": suspect.confidence,
        "alternatives": list(suspect.alternatives),
        "fix": fix_plan_json(verdict.fix),
    }


def _mindio_json(diagnosis: Diagnosis) -> dict[str, Any] | None:
    form = diagnosis.mindio
    if form is None:
        return None
    return {"form": form, "release": MINDIO_RELEASES[form], "logs_traceback": form not in UNTRACED_FORMS}


def _seen_json(seen: SentinelSeen) -> dict[str, Any]:
    return {
        "ranks": list(seen.ranks),
        "backends": list(seen.backends),
        "tensors": seen.tensors,
        "paths": list(seen.paths),
        "healed": seen.healed_everywhere,
        "healed_ranks": list(seen.healed_ranks),
    }


def _check_json(check: Summary) -> dict[str, Any]:
    """A check as the sentinel logged it: its record's fields, less the event."""
    return {key: value for key, value in asdict(check).items() if key != "event"}


def _frame_json(frame: Frame) -> dict[str, Any]:
    return {"file": frame.file, "line": frame.line, "function": frame.function, "source": frame.source}


def _last_error_json(diagnosis: Diagnosis) -> dict[str, Any] | None:
    error = diagnosis.last_error
    if error is None:
        return None
    return {"rank": error.rank, "type": error.exception_type, "message": error.message, "input": error.source}


def diagnosis_sarif(diagnosis: Diagnosis) -> dict[str, Any]:
    """SARIF 2.1.0: one result per finding, located at its culprit line: in the job's own file read
    through --source-root (relative to the working folder when under it, so that a CI annotation
    lands on the pull request's line), else at the path the log gives."""
    results = []
    for item in diagnosis.findings:
        finding = item.finding
        tensor = finding.tensor
        what = tensor.name.variable or tensor.expression if tensor else "a tensor"
        state = "is read while still marked unsafe" if finding.unsafe else "is still marked unsafe after the recovery"
        result: dict[str, Any] = {
            "ruleId": "unsafe-data-after-recovery",
            "level": "error",
            "message": {"text": f"{what} {state} (ranks {rank_ranges(finding.ranks)})"},
        }
        if finding.culprit is not None:
            result["locations"] = [location(_culprit_file(finding), finding.culprit.line)]
        evidence = item.classification.evidence
        if evidence:  # what the heuristics saw, each where it stands
            result["relatedLocations"] = [
                {**location(file_uri(seen.file), seen.line), "id": number, "message": {"text": seen.text}}
                for number, seen in enumerate(evidence)
            ]
        results.append(result)
    return sarif_log({"unsafe-data-after-recovery": "Global tensor left unsafe by process-level online recovery"}, results)


def _culprit_file(finding: Finding) -> str:
    """The URI of the local copy of the culprit's file where it is the job's own with the log's lines,
    else of the log's path."""
    assert finding.culprit is not None
    if finding.origin is not Origin.JOB or finding.source_file is None or finding.source_differs:
        return path_reference(finding.culprit.file)
    try:
        relative = os.path.relpath(finding.source_file)
    except ValueError:  # another drive (Windows)
        return file_uri(finding.source_file)
    return file_uri(finding.source_file if relative.startswith("..") else relative)


def healed_notes(seen: SentinelSeen | None) -> tuple[str, ...]:
    if seen is None or not seen.healed_ranks and not seen.healed_everywhere:
        return ()
    ranks = f"rank{'s' if len(seen.healed_ranks) != 1 else ''} {rank_ranges(seen.healed_ranks)}"
    where = "" if seen.healed_everywhere else f" on {ranks} only"
    if seen.healed_from:
        replicas = f"rank{'s' if len(seen.healed_from) != 1 else ''} {rank_ranges(seen.healed_from)}"
        return (
            f"the sentinel healed it in the repair{where}, copied from the replica ({replicas}) by its path: this "
            "recovery went on, but the adaptor still needs the fix for the next fault",
        )
    return (
        f"the sentinel healed it in process{where} (heal mode ran the rule's fix and it checked safe after): this "
        "recovery went on, but the adaptor still needs the fix for the next fault",
    )


def untraced_reason(untraced: Untraced) -> str:
    """Why the log has no traceback, and whether one exists anywhere: only the release decides."""
    ranks = untraced.ranks
    who = f"Rank{'s' if len(ranks) != 1 else ''} {rank_ranges(ranks)} reported the unsafe-data error with no traceback"
    if untraced.form in UNTRACED_FORMS:
        return (
            f"{who}: MindIO's catch line is that of {MINDIO_RELEASES[untraced.form]}, which logs only the error's message, "
            "so no log of this run holds its traceback"
        )
    if untraced.form is not None:
        return f"{who} in this log; {MINDIO_RELEASES[untraced.form]} logs one: look in the rank's own stderr or per-rank log"
    return f"{who} in this log (it may be cut or filtered): look in the rank's own stderr or per-rank log"


def fault_said(fault: FaultReading) -> str:
    """What the fault before the error marked unsafe (step 2 of the suspects' model), as the log shows it."""
    where = f"rank {fault.rank}: " if fault.rank is not None else ""
    shown = f" ({where}{fault.evidence})" if fault.evidence else ""
    if fault.marking == "partial":
        return (
            f"The fault marked only the device memory it hit, a UCE in persistent memory{shown}: the more memory "
            "a global holds, the likelier it is the one"
        )
    if fault.marking == "all-marked":
        return (
            f"The recovery marked every device tensor unsafe{shown}: every surviving global is unsafe, "
            "and the first one the step reads raised"
        )
    if fault.marking == "none-marked":
        return (
            f"The fault before the error marks no memory unsafe{shown}: the unsafe data points elsewhere (an "
            "earlier fault, or not this recovery), so no suspect is what this fault left"
        )
    return (
        f"The log does not show what the fault{shown} marked unsafe (no memory check result, no restart "
        "line): the suspects are ranked by where the step first reads them"
    )
