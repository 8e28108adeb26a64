"""Pieces that diagnosis and audit show alike: a fix as JSON, the frameworks and adaptor found, stale resets."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.syntax import Syntax
from rich.text import Text

from unsafe_doctor.classify import FixPlan, NoFix
from unsafe_doctor.stale import StaleReset
from unsafe_doctor.versions import Environment


@cache
def _python_lexer() -> Any:
    """One Python lexer per process: building one compiles pygments' regular expressions (about 35 ms)."""
    from pygments.lexers.python import PythonLexer

    return PythonLexer()


class PythonCode:
    """Python source in a report: highlighted where the console shows colour; plain where it does
    not (a pipe, a file, NO_COLOR), which then needs no lexer."""

    def __init__(self, code: str, **options: Any):
        self.code = code
        self.options = options

    def _syntax(self, console: Console) -> Syntax:
        return Syntax(self.code, _python_lexer() if console.color_system else "text", **self.options)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self._syntax(console)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self._syntax(console))


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

