"""A Verification (the replay's verdicts) as JSON or a rich renderable."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from unsafe_doctor.report.common import NextStep, printable
from unsafe_doctor.report.terminal import CodeToCopy, title

if TYPE_CHECKING:
    from unsafe_doctor.replay.verify import ReplayVerdict, Verification  # for types only: the report loads no replay code

SCHEMA = "unsafe-doctor/verification/v1"
_OUTCOME_STYLE = {
    "proven": "green",
    "block-proven": "yellow",
    "failed": "red",
    "no-fix": "red",
    "not-modelled": "yellow",
    "survives": "green",
    "dies": "red",
}


def verification_json(verification: Verification) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "backend": verification.backend,
        "transport": verification.transport,
        "mode": verification.mode,
        "ranks": verification.world_size,
        "faulty_rank": verification.faulty,
        "replica_rank": verification.replica,
        "seconds": round(verification.seconds, 3),
        "phase_seconds": {phase: round(value, 4) for phase, value in verification.phase_seconds.items()},
        "exit_code": verification.exit_code,
        "proved": verification.proved,
        "as_is": verification.as_is,
        "verdicts": [
            {
                "global": verdict.target.name.dotted,
                "scenario": verdict.target.scenario,
                "rule": verdict.target.rule,
                "fix_key": verdict.target.key,
                "outcome": verdict.outcome,
                "unpatched": verdict.unpatched,
                "patched": verdict.patched,
                "problems": list(verdict.problems),
                "suspect": _suspect_json(verdict),
            }
            for verdict in verification.verdicts
        ],
        "skipped": list(verification.skipped),
        "notes": list(verification.notes),
        "sentinel": {run: list(names) for run, names in verification.sentinel.items()},
    }


def verification_text(
    verification: Verification, write_fix: NextStep | None = None, fix_others: NextStep | None = None
) -> RenderableType:
    """The verdicts in boxes; when a fix is missing, the command that writes it (`write_fix`); when
    the sentinel names globals after the patched rollback that no finding is about, the command
    that writes their fixes (`fix_others`)."""
    device = "CPU" if verification.backend == "emulated" else "NPU"
    footer = (
        f"backend: {verification.backend} ({device}, {verification.transport}) · {verification.mode} mode · "
        f"{verification.world_size} ranks (fault on rank {verification.faulty}, replica rank {verification.replica}) · "
        f"{verification.seconds:.1f} s"
    )
    parts: list[RenderableType] = []
    # --as-is: the adaptor without unsafe-doctor's blocks (fixes and the sentinel's), then as it stands
    without, written = ("without blocks", "as it stands") if verification.as_is else ("unpatched", "patched")
    for verdict in verification.verdicts:
        style = _OUTCOME_STYLE[verdict.outcome]
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        grid.add_row(without, Text(printable(verdict.unpatched)))
        if verdict.patched is not None:
            grid.add_row(written, Text(printable(verdict.patched), style=style))
        for problem in verdict.problems[1:]:
            grid.add_row("", Text(printable(problem), style=style))
        chosen = f"suspect {verdict.target.suspect} · " if verdict.target.suspect is not None else ""
        heading = title(f"{verdict.outcome.upper()} · {chosen}{verdict.target.name.dotted} · scenario {verdict.target.scenario}")
        parts.append(Panel(grid, title=heading, title_align="left", border_style=style))
    for run, names in verification.sentinel.items():
        named = ", ".join(names) if names else "nothing"
        shown = {"unpatched": without, "patched": written}.get(run, run)
        parts.append(Text(f"sentinel after the {shown} rollback (rank {verification.faulty}): {printable(named)}", style="dim"))
    if verification.proved:
        parts.append(Text(f"proof: {printable(verification.proved)}", style="dim"))
    for line in (*verification.skipped, *(note for note in verification.notes if not note.startswith("stand-ins"))):
        parts.append(Text(f"note: {printable(line)}", style="dim"))
    parts.append(Text(footer, style="dim"))
    parts.extend(_suspects_scope(verification))
    missing = [verdict.target.name.dotted for verdict in verification.verdicts if verdict.outcome == "no-fix"]
    if missing:
        parts.extend(_write_the_fix(missing, write_fix))
    others = unfixed_globals(verification)
    if others:
        text = Text(
            f"Still unsafe after the patched rollback, and no finding of the log: {printable(', '.join(others))}; "
            "the first step after a real recovery reads them too",
            style="bold",
        )
        hint = " (unsafe-doctor audit SOURCE --adaptor ADAPTOR --fix writes their fixes)."
        parts.append(text.append(":" if fix_others else hint))
        if fix_others:
            parts.append(CodeToCopy(fix_others.command, python=False))
    elif any(_proven(verdict) and verdict.target.suspect is None for verdict in verification.verdicts):
        parts.append(
            Text(
                "Proven: the fixes of this log's globals. Other globals the recovery leaves unsafe are not "
                "checked here: `unsafe-doctor audit SOURCE --adaptor ADAPTOR` finds them before a fault does.",
                style="dim",
            )
        )
    return Group(*parts)


def unfixed_globals(verification: Verification) -> tuple[str, ...]:
    """What the sentinel names after the patched rollback that no verdict is about."""
    targets = [verdict.target for verdict in verification.verdicts]
    return tuple(name for name in verification.sentinel.get("patched", ()) if not any(target.names(name) for target in targets))


def _write_the_fix(missing: list[str], write_fix: NextStep | None) -> list[RenderableType]:
    """NO-FIX: what to run to write the fix (a line of its own, whole, to be copied), then verify again."""
    text = Text(f"The adaptor holds no fix for {printable(', '.join(missing))}: write it, then run verify again", style="bold")
    if write_fix is None:
        return [text.append(" (unsafe-doctor fix, with this command's log and options, and --yes).")]
    text.append(" (pipe the same log in again):" if write_fix.piped else ":")
    return [text, CodeToCopy(write_fix.command, python=False)]


def _proven(verdict: ReplayVerdict) -> bool:
    return verdict.outcome in ("proven", "block-proven")


def _suspect_json(verdict: ReplayVerdict) -> dict[str, Any] | None:
    """A suspect's verdict: what its proof shows, and what it does not."""
    if verdict.target.suspect is None:
        return None
    return {"number": verdict.target.suspect, "proves": _suspect_proves(verdict), "does_not_prove": _suspect_leaves(verdict)}


def _suspects_scope(verification: Verification) -> list[RenderableType]:
    """A line per suspect's verdict, so that a PROVEN is not read as "this suspect is the culprit"."""
    lines: list[RenderableType] = []
    for verdict in verification.verdicts:
        number = verdict.target.suspect
        if number is not None:
            head = f"Proven for suspect {number} only" if _proven(verdict) else f"Suspect {number}"
            line = f"{head}: {_suspect_proves(verdict)}. Not shown: {_suspect_leaves(verdict)}."
            lines.append(Text(printable(line), style="bold" if _proven(verdict) else ""))
    return lines


def _suspect_proves(verdict: ReplayVerdict) -> str:
    label = verdict.target.name.dotted
    replayed = f"the replay made {label} the global the recovery left unsafe (marked as a UCE on it would be)"
    return f"{replayed}; its fix brings the first step after recovery back clean" if _proven(verdict) else replayed


def _suspect_leaves(verdict: ReplayVerdict) -> str:
    return (
        f"that suspect {verdict.target.suspect} is the global this log's fault left unsafe (the log has no "
        "traceback): `unsafe-doctor sentinel install` names that one at the next fault"
    )
