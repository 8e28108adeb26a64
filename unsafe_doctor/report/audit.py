"""An Audit (the globals that hold device tensors, and how recovery covers each) as JSON, SARIF or a table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from unsafe_doctor.knowledge.render.template import FixPlan
from unsafe_doctor.report.common import (
    NextStep,
    adaptor_json,
    counted,
    fix_plan_json,
    frameworks_json,
    printable,
)
from unsafe_doctor.report.sarif import artifact_change, file_uri, location, sarif_log
from unsafe_doctor.report.terminal import stale_text
from unsafe_doctor.source.files import MAX_SOURCE_TOKENS

if TYPE_CHECKING:
    from unsafe_doctor.adaptor.plan import Plan
    from unsafe_doctor.recovery_code.model import Audit, AuditedHolder, Holder, Site

SCHEMA = "unsafe-doctor/audit/v1"
SARIF_RULES = {
    "uncovered-global-tensor": "Global that holds device tensors and that no recovery step resets, rebuilds or repairs",
    "unsafe-reset": "Recovery code that touches a global tensor in a way that fails on unsafe memory",
    "stale-reset": "Reset in the adaptor's rollback of a name the framework no longer has",
}
_STATUS_STYLE = {"uncovered": "bold red", "unsafe": "bold yellow", "covered": "green"}
SARIF_RELATED = 10  # writers listed with each result
_PLACEMENT_TEXT = {"device": "on the device", "unknown": "device unknown"}
NAME_WIDTH = 48  # the global column's widest: a name longer than this folds


def audit_json(audit: Audit) -> dict[str, Any]:
    environment = audit.context.environment
    return {
        "schema": SCHEMA,
        "paths": [str(path) for path in audit.paths],
        "files": audit.files,
        "unreadable": list(audit.unreadable),
        "adaptor": adaptor_json(environment),
        "frameworks": frameworks_json(environment),
        "holders": [_holder_json(item) for item in audit.holders],
        "stale_resets": [
            {"file": str(item.file), "line": item.line, "statement": item.statement, "kind": item.kind, "why": item.why}
            for item in audit.stale
        ],
        "notes": list(audit.notes),
        "conversion_only": list(audit.conversion_only),
        "summary": _counts(audit),
    }


def _counts(audit: Audit) -> dict[str, int]:
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
        "name": holder.name.dotted,
        "kind": holder.kind,
        "module": holder.name.module,
        "owner": holder.name.owner,
        "variable": holder.name.variable,
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
        "fix": fix_plan_json(verdict.fix) if verdict else None,
    }


def audit_sarif(audit: Audit, fixes: Mapping[str, Plan]) -> dict[str, Any]:
    """SARIF 2.1.0: each holder not covered is a result at its definition, with its fix (one
    insertion per adaptor function) where one exists; each stale reset a result in the adaptor."""
    results = [_holder_result(item, fixes.get(item.holder.name.dotted)) for item in audit.uncovered]
    for stale in audit.stale:
        results.append(
            {
                "ruleId": "stale-reset",
                "level": "warning",
                "message": {"text": f"{stale.statement}: {stale.why}"},
                "locations": [location(file_uri(str(stale.file)), stale.line)],
            }
        )
    return sarif_log(SARIF_RULES, results)


def _holder_result(item: AuditedHolder, plan: Plan | None) -> dict[str, Any]:
    holder, coverage, verdict = item.holder, item.coverage, item.classification
    what = f"{holder.name.dotted} ({holder.kind}, {_PLACEMENT_TEXT[holder.placement]})"
    rule = verdict.rule if verdict else None
    if coverage.status == "unsafe":
        text = f"{what}: {coverage.why}"
    else:
        scenario = f"; scenario {verdict.scenario} ({rule or 'heuristics'})" if verdict and verdict.scenario else ""
        text = f"{what} is not reset, rebuilt or repaired by recovery{scenario}"
    result: dict[str, Any] = {
        "ruleId": "unsafe-reset" if coverage.status == "unsafe" else "uncovered-global-tensor",
        "level": "error",
        "message": {"text": text},
        "locations": [_site_location(holder.definition)],
        "relatedLocations": [
            {**_site_location(site), "message": {"text": f"written in {site.function or 'module body'}"}}
            for site in holder.writers[:SARIF_RELATED]
        ],
        "properties": {
            "kind": holder.kind,
            "placement": holder.placement,
            "scenario": verdict.scenario if verdict else None,
            "rule": rule,
            "confidence": verdict.confidence if verdict else None,
        },
    }
    if plan is not None and plan.edits:
        result["fixes"] = [
            {
                "description": {"text": f"unsafe-doctor fix for {holder.name.dotted} ({rule or 'generic'})"},
                "artifactChanges": [artifact_change(edit) for edit in plan.edits],
            }
        ]
    return result


def _site_location(site: Site) -> dict[str, Any]:
    return location(file_uri(site.file), site.line)


def audit_text(audit: Audit, elapsed: float, write_fixes: NextStep | None = None) -> RenderableType:
    """`write_fixes`: the command that writes the fixes, shown last when some global has one."""
    parts: list[RenderableType] = []
    if audit.holders:
        # A global's own name (Owner.variable) is never cut: its column is as wide as the longest (up
        # to NAME_WIDTH), and a longer one folds; its module, on the line below, folds too. In the
        # other columns a word too long is cut with "…".
        longest = max(max(len(item.holder.name.qualname), len(_kind_text(item.holder))) for item in audit.holders)
        table = Table(header_style="bold", show_lines=True)
        table.add_column("global", overflow="fold", ratio=4, min_width=min(longest, NAME_WIDTH))
        table.add_column("written · read", overflow="ellipsis", ratio=2)
        table.add_column("recovery", overflow="ellipsis", ratio=3)
        table.add_column("scenario", overflow="ellipsis", ratio=3)
        for item in audit.holders:
            table.add_row(*_holder_cells(item))
        parts.append(table)
    else:
        parts.append(Text("No global that holds device tensors was found.", style="green"))
    if audit.stale:
        parts.append(stale_text(audit.stale))
    for note in audit.notes:
        parts.append(Text(f"note: {printable(note)}", style="yellow"))
    if audit.conversion_only:
        parts.append(
            Text(
                f"note: left out {counted(len(audit.conversion_only), 'global')} that only a checkpoint converter "
                f"writes and reads (conversion runs at load or offline, not in a training step): "
                f"{_first_three(audit.conversion_only)}",
                style="yellow",
            )
        )
    if audit.unreadable:
        parts.append(
            Text(
                f"note: {counted(len(audit.unreadable), 'file')} not scanned (unreadable, not Python, or more "
                f"than {MAX_SOURCE_TOKENS:,} tokens): {_first_three(audit.unreadable)}",
                style="yellow",
            )
        )
    parts.append(_summary(audit, elapsed))
    if write_fixes is not None and _counts(audit)["fixable"]:
        parts.append(Text(write_fixes.line("to write the fixes")))
    return Group(*parts)


def _first_three(names: Sequence[str]) -> str:
    return ", ".join(printable(name) for name in names[:3]) + (", …" if len(names) > 3 else "")


def _kind_text(holder: Holder) -> str:
    return f"{holder.kind}, {_PLACEMENT_TEXT[holder.placement]}"


def _holder_cells(item: AuditedHolder) -> tuple[Text, Text, Text, Text]:
    holder, coverage, verdict = item.holder, item.coverage, item.classification
    name = Text(printable(holder.name.qualname), style="bold magenta")
    name.append(f"\nin {printable(holder.name.module)}", style="magenta")
    name.append(f"\n{_kind_text(holder)}", style="dim")
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
        status.append(f"\n{printable(coverage.why)}")
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
    return f"{printable(site.file.replace(chr(92), '/').rpartition('/')[2])}:{site.line}"


def _summary(audit: Audit, elapsed: float) -> Text:
    counts = _counts(audit)
    environment = audit.context.environment
    pieces = [
        f"{counted(counts['holders'], 'global')}: {counts['uncovered']} uncovered, "
        f"{counts['unsafe']} unsafe, {counts['covered']} covered"
    ]
    if counts["fixable"]:
        how = " (--fix)" if environment.adaptor else ""  # with no adaptor, the command below says what to give
        pieces.append(f"{counts['fixable']} with a fix{how}")
    pieces.append(counted(audit.files, "file"))
    if environment.adaptor is not None:
        pieces.append(f"adaptor {printable(str(environment.adaptor))} ({environment.profile.id}; {environment.adaptor_why})")
    for name, version in environment.versions.items():
        pieces.append(f"{name} {version}")
    pieces.append(f"{elapsed:.2f} s" + (", from the cache" if audit.cache.use == "hit" else ""))
    return Text(" · ".join(pieces), style="bold")
