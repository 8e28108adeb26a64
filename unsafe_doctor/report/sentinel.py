"""`sentinel install`'s JSON document: fix's, less what only findings have, with the mode written and
what the training image needs; and that need in words."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from unsafe_doctor import __version__
from unsafe_doctor.log.sentinel_modes import GUARDED
from unsafe_doctor.report import fix

if TYPE_CHECKING:
    from unsafe_doctor.adaptor.plan import Plan
    from unsafe_doctor.adaptor.write import Written
    from unsafe_doctor.log.sentinel_modes import SentinelMode

SCHEMA = "unsafe-doctor/sentinel-install/v1"


WHERE = "importable in every rank's Python"
IF_MISSING = {
    "logged": "where it is not, the block logs one line and the rollback goes on without the sentinel",
    "raised": "where it is not, the rollback raises there and MindIO gives up the online recovery, as it does for "
    "an unsafe tensor in this mode",
}


def sentinel_json(plan: Plan, written: tuple[Written, ...], *, dry_run: bool, mode: SentinelMode | None) -> dict[str, Any]:
    """`mode`: the one written; None for --revert. The training image's need where the plan writes a block."""
    document = fix.fix_json(plan, written, dry_run=dry_run)
    del document["skipped"], document["already_reset"]  # a sentinel answers no finding
    training_image = None
    if mode is not None and plan.edits:
        training_image = {"needs": f"unsafe-doctor=={__version__}", "where": WHERE, "if_missing": _if_missing(mode)}
    return {**document, "schema": SCHEMA, "mode": mode, "training_image": training_image}


def needs_line(mode: SentinelMode) -> str:
    """What the training image needs for a block of `mode`, and what the block does where it lacks it."""
    return f"the training image needs unsafe-doctor=={__version__} {WHERE}: {IF_MISSING[_if_missing(mode)]}"


def _if_missing(mode: SentinelMode) -> Literal["logged", "raised"]:
    """One log line and the rollback goes on (the guarded modes), or the rollback raises."""
    return "logged" if mode in GUARDED else "raised"
