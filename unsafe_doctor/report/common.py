"""Pieces that every report shows alike: a fix as JSON, the frameworks and adaptor found, stale resets,
code to copy, rank lists, counted nouns, and text from logs made safe for a terminal."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.measure import Measurement
from rich.syntax import Syntax
from rich.text import Text

from unsafe_doctor.knowledge.classify import FixPlan, NoFix
from unsafe_doctor.knowledge.versions import Environment

if TYPE_CHECKING:  # for types only: a report loads none of the adaptor's reading
    from unsafe_doctor.audit.stale import StaleReset


@cache
def _python_lexer() -> Any:
    """One Python lexer per process: building one compiles pygments' regular expressions (about 35 ms)."""
    from pygments.lexers.python import PythonLexer

    return PythonLexer()


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
    """"1 rank", "2 ranks": the noun in the plural only when the count asks for it."""
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


def title(text: str) -> Text:
    """A panel's title: cut with an ellipsis when it is wider than the panel, never parsed as markup."""
    return Text(printable(text), overflow="ellipsis")


class Hanging:
    """`lead` then `text`, every line the text wraps into starting under its first character, at any
    width. A word wider than the room left (a long dotted module) stands whole on its own line, past
    the width: a name split over two lines cannot be copied."""

    def __init__(self, lead: str, text: Text) -> None:
        self.lead, self.text = lead, text

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        indent = len(self.lead)
        width = max(options.max_width - indent, 16)
        lines = [piece for part in self.text.split() for piece in part.divide(_breaks(part.plain, width))]
        for number, line in enumerate(lines):
            line.rstrip()
            shown = Text(self.lead if number == 0 else " " * indent).append_text(line)
            shown.no_wrap, shown.overflow = True, "ignore"
            yield shown

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.text).with_maximum(options.max_width)


_WORD = re.compile(r"\s*\S+\s*")  # a word and the spaces after it (the first, also those before it)


def _breaks(text: str, width: int) -> list[int]:
    """Where one line of text breaks to fit `width` cells: before each word that would pass it. A
    word wider than the width stands whole on a line of its own (Text.wrap would fold it)."""
    breaks, used = [], 0
    for word in _WORD.finditer(text):
        if word.start() and used + cell_len(word.group().rstrip()) > width:
            breaks.append(word.start())
            used = 0
        used += cell_len(word.group())
    return breaks


class CodeToCopy:
    """Code meant to be copied (a fix block, a rule's template, an address), printed outside any box:
    Python highlighted where the console shows colour, every line whole at any width (never wrapped
    nor cropped)."""

    def __init__(self, code: str, *, python: bool = True) -> None:
        self.code, self.python = printable_lines(code), python

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if console.color_system and self.python:
            text = Syntax(self.code, _python_lexer(), theme="ansi_dark", background_color="default").highlight(self.code)
            text.rstrip()
        else:
            text = Text(self.code)
        text.no_wrap, text.overflow = True, "ignore"
        yield text


class PythonCode:
    """Python source in a report: highlighted where the console shows colour; plain where it does
    not (a pipe, a file, NO_COLOR), which then needs no lexer."""

    def __init__(self, code: str, **options: Any):
        self.code = printable_lines(code)
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


def stale_text(stale: Sequence[StaleReset]) -> Group:
    """Each stale reset where it stands and why, every wrapped line under the text it continues."""
    parts: list[Hanging | Text] = [Text("Stale resets in the adaptor's rollback:", style="bold yellow")]
    for item in stale:
        where = Text(f"{printable(str(item.file))}:{item.line}  ", style="cyan")
        where.append(printable(item.statement), style="default")
        parts += [Hanging("  ", where), Hanging("    ", Text(printable(item.why)))]
    return Group(*parts, Text(""))
