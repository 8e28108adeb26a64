"""A fix plan and what was written: the JSON document, and the lines that say what was decided and done."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unsafe_doctor.report.common import NextStep, printable

if TYPE_CHECKING:
    from unsafe_doctor.adaptor.plan import Plan  # for types only: the report loads no adaptor code
    from unsafe_doctor.adaptor.write import Written

SCHEMA = "unsafe-doctor/fix/v1"


def fix_json(plan: Plan, written: tuple[Written, ...], *, dry_run: bool) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "files": [{"path": str(edit.path), "changes": list(edit.changes), "diff": edit.diff()} for edit in plan.edits],
        "present": list(plan.present),
        "skipped": [str(item) for item in plan.skipped],
        "already_reset": [
            {
                "finding": item.finding,
                "global": item.variable,
                "function": item.coverage.function,
                "how": item.coverage.how,
                "sites": [{"file": site.file, "line": site.line, "code": site.code} for site in item.coverage.sites],
                "doubts": list(item.doubts),
            }
            for item in plan.already_reset
        ],
        "notes": list(plan.notes),
        "profile": {"id": plan.profile, "why": plan.profile_why} if plan.profile else None,
        "dry_run": dry_run,
        "written": [{"path": str(item.path), "backup": str(item.backup), "links": item.links} for item in written],
    }


def decisions(plan: Plan, findings: int, *, revert: bool) -> list[str]:
    """What the plan decided, a line each: the blocks it changes, those already there, the findings it skips."""
    lines = [] if revert or findings else ["no unsafe-data finding in the log: nothing to fix"]
    return [*map(printable, lines), *plan_lines(plan)]


def plan_lines(plan: Plan) -> list[str]:
    """A line per block the plan inserts or removes, per block already there, per finding skipped, per note."""
    lines = [change for edit in plan.edits for change in edit.changes]
    if plan.profile and plan.edits:
        lines.append(f"written for adaptor profile {plan.profile} ({plan.profile_why})")
    lines.extend((*plan.present, *map(str, plan.skipped), *plan.notes))
    return [printable(line) for line in lines]


def outcome(
    plan: Plan,
    written: tuple[Written, ...],
    *,
    dry_run: bool,
    interactive: bool,
    apply: NextStep | None = None,
    done: str = "nothing to do: the adaptor already holds every fix",
) -> list[str]:
    """What became of the plan: the files written, or why nothing was and the command (`apply`) that
    writes it; `done` when every block is there already."""
    apply = apply or NextStep("the same command with --yes")
    lines = written_lines(written)
    if not plan.edits:
        if plan.present and not plan.skipped:
            lines.append(done)
    elif dry_run:
        lines.append(apply.line("dry run: nothing written; to write it"))
    elif not written and interactive:
        lines.append(apply.line("not applied; to apply"))
    elif not written:
        lines.append(apply.line("not applied: nothing is asked without a terminal or with --no-input; to apply"))
    return lines


def written_lines(written: tuple[Written, ...]) -> list[str]:
    return [printable(f"wrote {item.path} (backup: {item.backup})" + _in_place(item) + _backup_owner(item)) for item in written]


def _in_place(item: Written) -> str:
    if item.links > 1:
        return f"; in place, as it has {item.links} hard links, which all see the change"
    return f"; in place, to keep its owner {_owner_name(item.owner)}" if item.in_place else ""


def _backup_owner(item: Written) -> str:
    if item.backup_owner == item.owner:
        return ""
    return (
        f"; warning: the backup belongs to {_owner_name(item.backup_owner)}, not to {_owner_name(item.owner)} as the file "
        "does (only root may give a file away)"
    )


def _owner_name(owner: tuple[int, int]) -> str:
    """`alice:team`, or the ids where the system has no name for them."""
    import grp
    import pwd

    user, group = owner
    try:
        user_name = pwd.getpwuid(user).pw_name
    except KeyError:
        user_name = str(user)
    try:
        group_name = grp.getgrgid(group).gr_name
    except KeyError:
        group_name = str(group)
    return f"{user_name}:{group_name}"
