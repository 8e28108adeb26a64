"""Pieces that every terminal report draws alike: panel titles, text that hangs under its lead, code
to copy, Python highlighted, stale resets. rich (and pygments, for a highlighted line) load with
this module, which only a report rendered for people imports."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.measure import Measurement
from rich.syntax import Syntax
from rich.text import Text

from unsafe_doctor.report.common import printable, printable_lines

if TYPE_CHECKING:  # for types only: a report loads none of the adaptor's reading
    from unsafe_doctor.recovery_code.stale import StaleReset


@cache
def _python_lexer() -> Any:
    """One Python lexer per process: building one compiles pygments' regular expressions (about 35 ms)."""
    from pygments.lexers.python import PythonLexer

    return PythonLexer()


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


def stale_text(stale: Sequence[StaleReset]) -> Group:
    """Each stale reset where it stands and why, every wrapped line under the text it continues."""
    parts: list[Hanging | Text] = [Text("Stale resets in the adaptor's rollback:", style="bold yellow")]
    for item in stale:
        where = Text(f"{printable(str(item.file))}:{item.line}  ", style="cyan")
        where.append(printable(item.statement), style="default")
        parts += [Hanging("  ", where), Hanging("    ", Text(printable(item.why)))]
    return Group(*parts, Text(""))
