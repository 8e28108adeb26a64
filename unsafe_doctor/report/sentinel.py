"""`sentinel install`'s JSON document: fix's, less what only findings have, with the mode written."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unsafe_doctor.report import fix

if TYPE_CHECKING:
    from unsafe_doctor.adaptor.fix import Plan, Written
    from unsafe_doctor.log.sentinel_lines import Mode

SCHEMA = "unsafe-doctor/sentinel-install/v1"


def to_json(plan: Plan, written: tuple[Written, ...], dry_run: bool, mode: Mode | None) -> dict[str, Any]:
    """`mode`: the one written; None for --revert."""
    document = fix.to_json(plan, written, dry_run)
    del document["skipped"], document["already_reset"]  # a sentinel answers no finding
    return {**document, "schema": SCHEMA, "mode": mode}
