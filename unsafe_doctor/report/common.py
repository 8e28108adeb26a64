"""Pieces that every report shows alike: a fix as JSON, the frameworks and adaptor found, rank
lists, counted nouns, commands to run next, and text from logs made safe for a terminal. No rich
here: a JSON or SARIF report loads none of it (the terminal's pieces are in `terminal`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from unsafe_doctor.knowledge.render.template import FixPlan, NoFix
from unsafe_doctor.knowledge.versions import Environment

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 but tab and newline, DEL, C1
_CONTROL_OR_NEWLINE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")  # and the line separators


def printable(text: str) -> str:
    """A name or a field from a log or a file name, on one line, every control character written
    as an escape (ESC becomes \\x1b, a line feed \\x0a): a hostile log must not set the terminal's
    title or clear its screen, nor start a line of its own (a CI runner reads `::error::` lines)."""
    return _CONTROL_OR_NEWLINE.sub(_escape, text)


def printable_lines(text: str) -> str:
    """Text of several lines (code to copy), its line feeds kept, every other control character escaped."""
    return _CONTROL.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group()):02x}" if ord(match.group()) < 0x100 else f"\\u{ord(match.group()):04x}"


def counted(count: int, noun: str) -> str:
    """ "1 rank", "2 ranks": the noun in the plural only when the count asks for it."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def rank_ranges(ranks: Iterable[int]) -> str:
    """Ranks as people read them at scale: 0-511 for all 512, "0-15, 32" for a gap."""
    spans: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in spans)


@dataclass(frozen=True)
class NextStep:
    """A command to run next, quoted so that it runs as pasted. `piped`: it reads the log from stdin
    ('-'), as this run did, so the log must be piped in again."""

    command: str
    piped: bool = False

    def line(self, what: str) -> str:
        """`what: command`, the command last on the line, whole, to be copied."""
        return f"{what}{' (pipe the same log in again)' if self.piped else ''}: {self.command}"


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
    """Each version found and where from; where the job's releases are those its arguments dump fits,
    the newest of them, as the frames' fingerprint gives its newest."""
    found = {name: {"version": str(version), "from": environment.origins[name]} for name, version in environment.versions.items()}
    for name in environment.job_releases():
        dumped = environment.dumped_release(name)
        if dumped is not None:
            found[name] = {"version": str(dumped.releases[-1]), "from": f"the arguments dump ({dumped.describe()})"}
    return found


def adaptor_json(environment: Environment) -> dict[str, str | None]:
    return {
        "file": str(environment.adaptor) if environment.adaptor else None,
        "found": environment.adaptor_why,
        "profile": environment.profile.id,
        "profile_from": environment.profile_from,
    }
