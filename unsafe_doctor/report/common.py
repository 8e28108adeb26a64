"""Pieces that diagnosis and audit show alike: a fix as JSON, the frameworks and adaptor found, stale resets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.text import Text

from unsafe_doctor.classify import FixPlan, NoFix
from unsafe_doctor.stale import StaleReset
from unsafe_doctor.versions import Environment


def fix_plan_json(fix: FixPlan | NoFix | None) -> dict[str, Any] | None:
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


def frameworks_json(environment: Environment) -> dict[str, dict[str, str]]:
    return {
        name: {"version": str(version), "from": environment.origins[name]} for name, version in environment.versions.items()
    }


def adaptor_json(environment: Environment) -> dict[str, str | None]:
    return {"file": str(environment.adaptor) if environment.adaptor else None, "profile": environment.profile.id}


def stale_text(stale: Sequence[StaleReset]) -> Text:
    text = Text("Stale resets in the adaptor's rollback:\n", style="bold yellow")
    for item in stale:
        text.append(f"  {item.file}:{item.line}  ", style="cyan")
        text.append(f"{item.statement}\n    {item.why}\n")
    return text

