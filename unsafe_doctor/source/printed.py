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
markers stop at: the marker then covers the rest of it). Then the operands that overlap the marked
expression are the ones that can have raised; those overlapping the `^` part come first, a call's
`^` part being the whole call whether Python 3.11 or 3.13 printed it.
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


Position = tuple[int, int]  # (line, UTF-8 byte column), as `ast` counts them


@dataclass(frozen=True)
class MarkedSpan:
    """A marker on parsed code: the expression it marks, from `start` to `end`, and its `^` part."""

    start: Position
    end: Position
    primary: tuple[Position, Position]

    @classmethod
    def place(
        cls, marked: tuple[int, int], primary: tuple[int, int], printed: str, host: str, line: int, *, root: ast.AST
    ) -> MarkedSpan | None:
        """A marker's columns (characters of `printed`, the line as the log shows it) on line
        `line` of the parsed text, whose text is `host`, as the expression under `root` it marks;
        None when `host` does not hold `printed` or no expression is exactly the marked part.

        Two ways of marking the same expression read alike. A marker that runs to the end of the
        printed line marks the whole expression when it goes on over more lines (Python 3.11 and
        3.12 mark only its first line; 3.13 prints it whole with no marker). A call is marked all
        `^` (3.11, 3.12) or its callee `~` and its arguments `^` (3.13: `~~~~~~^^^^^`); the
        receiver of a method is as much an input of it as the arguments, so its `^` part is the
        whole call either way."""
        at = host.find(printed)
        if at < 0 or marked[1] > len(printed):
            return None

        def column(offset: int) -> int:
            return len(host[: at + offset].encode())

        start, end, line_end = column(marked[0]), column(marked[1]), column(len(printed))
        for node in ast.walk(root):
            if not isinstance(node, ast.expr) or (node.lineno, node.col_offset) != (line, start):
                continue
            whole = (node.end_lineno or line, node.end_col_offset or 0)
            if whole != (line, end) and not (whole[0] > line and end == line_end):
                continue
            first, last = column(primary[0]), column(primary[1])
            if isinstance(node, ast.Call) and (node.func.end_lineno, node.func.end_col_offset) == (line, first):
                first = start  # 3.13's `~` callee
            return cls((line, start), whole, ((line, first), whole if last == line_end else (line, last)))
        return None

    def overlaps(self, node: ast.AST, span: tuple[Position, Position] | None = None) -> bool:
        """`node` shares text with the marked part (or with `span`)."""
        start, end = span or (self.start, self.end)
        first = (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
        last = (getattr(node, "end_lineno", None) or 0, getattr(node, "end_col_offset", None) or 0)
        return first < end and start < last

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
