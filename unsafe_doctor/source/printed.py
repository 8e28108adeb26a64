"""A traceback's printed source line: parsed on its own, and its position markers placed on code.

`parse_printed_line`: the first statement of a printed line, made parseable (a `pass` body after a
trailing `:`, closing brackets for an unbalanced first line of a statement over several lines, a
call around a continuation line printed alone), for when the job's file is not here.

`MarkedSpan`: Python 3.11+ position markers placed on parsed code. A traceback's `~~~^~~~` /
`^^^^` line marks the sub-expression that raised, in characters of the printed line
(`tracebacks.Marker`: its columns and its `^` part). Code is parsed either from the local file (the
printed line is one of its lines, indented) or from the printed line itself (maybe wrapped:
`_(key=self.x,)`); `MarkedSpan.place` moves the marker onto that text, in `ast`'s coordinates
(line, UTF-8 byte columns). The marker is trusted only when it fits the parse: some expression
starts where it starts and ends where it ends (or runs past the printed line, which Python's
markers stop at). Then the operands that overlap the marked span are the ones that can have
raised; those overlapping the `^` part come first.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class MarkedSpan:
    """A marker on parsed text: `line` (1-based) and byte columns as `ast` counts them."""

    line: int
    start: int
    end: int
    primary: tuple[int, int]
    line_end: int  # where the code of that line ends: a marker that reaches it may run on

    @classmethod
    def place(
        cls, marked: tuple[int, int], primary: tuple[int, int], printed: str, host: str, line: int
    ) -> MarkedSpan | None:
        """A marker's columns (characters of `printed`, the line as the log shows it) on line
        `line` of the parsed text, whose text is `host`; None when `host` does not hold `printed`."""
        at = host.find(printed)
        if at < 0 or marked[1] > len(printed):
            return None

        def column(offset: int) -> int:
            return len(host[: at + offset].encode())

        return cls(line, column(marked[0]), column(marked[1]), (column(primary[0]), column(primary[1])),
                   column(len(printed)))

    def fits(self, root: ast.AST) -> bool:
        """Some expression under `root` is exactly the marked part."""
        for node in ast.walk(root):
            if not isinstance(node, ast.expr) or node.lineno != self.line or node.col_offset != self.start:
                continue
            if (node.end_lineno, node.end_col_offset) == (self.line, self.end):
                return True
            if (node.end_lineno or 0) > self.line and self.end == self.line_end:
                return True
        return False

    def overlaps(self, node: ast.AST, span: tuple[int, int] | None = None) -> bool:
        """`node` shares text with the marked part (or with `span` of its line)."""
        start, end = span or (self.start, self.end)
        first = (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
        last = (getattr(node, "end_lineno", None) or 0, getattr(node, "end_col_offset", None) or 0)
        return first < (self.line, end) and (self.line, start) < last

    def narrow(self, items: Sequence[T], node_of: Callable[[T], ast.AST]) -> list[T]:
        """The items whose node overlaps the marked part, those under the `^` part first (each
        group in the given order); all of them when none does."""
        marked = [item for item in items if self.overlaps(node_of(item))]
        if not marked:
            return list(items)
        primary = [item for item in marked if self.overlaps(node_of(item), self.primary)]
        return primary + [item for item in marked if not self.overlaps(node_of(item), self.primary)]


_OPENERS = {"(": ")", "[": "]", "{": "}"}


def first_line(source: str | None) -> str | None:
    """The first non-blank line a traceback printed for a frame, stripped; None when it printed none."""
    lines = [line.strip() for line in (source or "").splitlines() if line.strip()]
    return lines[0] if lines else None


def is_partial(printed: str) -> bool:
    """The printed source is part of a longer statement: its brackets stay open (a call over several
    lines, whose arguments Python before 3.13 does not print) or 3.13 elided lines (`...<12 lines>...`)."""
    text = "\n".join(line.strip() for line in printed.splitlines() if line.strip())
    return bool(_ELIDED.search(text) or _missing_closers(text)[0])


_ELIDED = re.compile(r"^\.\.\.<\d+ lines?>\.\.\.$", re.MULTILINE)


def parse_printed_line(printed: str) -> tuple[ast.stmt, str] | None:
    """The first statement of a printed source line, made parseable; with the text it was parsed from."""
    text = "\n".join(line.strip() for line in printed.splitlines() if line.strip() and not _ELIDED.match(line.strip()))
    attempts = [text]
    if text.endswith(":"):
        attempts.append(re.sub(r"^elif\b", "if  ", text) + " pass")
    closers, code = _missing_closers(text)
    if closers:
        attempts.append(code + closers)
    attempts.append(f"_({text.rstrip(',')})")  # a continuation line printed alone: `key=self.x,`
    for attempt in attempts:
        try:
            tree = ast.parse(attempt)
        except (SyntaxError, ValueError):
            continue
        if tree.body:
            return tree.body[0], attempt
    return None


def _missing_closers(text: str) -> tuple[str, str]:
    """Brackets left open by the first line of a multi-line statement, and the text without a comment."""
    stack: list[str] = []
    code = text
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.OP and token.string in _OPENERS:
                stack.append(_OPENERS[token.string])
            elif token.type == tokenize.OP and token.string in _OPENERS.values() and stack:
                stack.pop()
            elif token.type == tokenize.COMMENT and token.start[0] == text.count("\n") + 1:
                code = text[: len(text) - len(text.splitlines()[-1]) + token.start[1]].rstrip()
    except (tokenize.TokenError, SyntaxError):
        pass
    return "".join(reversed(stack)), code
