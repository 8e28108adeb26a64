"""Python 3.11+ position markers placed on parsed source: which operands the raising part reads.

A traceback's `~~~^~~~` / `^^^^` line marks the sub-expression that raised, in characters of the
printed line (`tracebacks.Marker`: its columns and its `^` part). Code is parsed either from the local file (the printed line is
one of its lines, indented) or from the printed line itself (made parseable, maybe wrapped:
`_(key=self.x,)`); `MarkedSpan.place` moves the marker onto that text, in `ast`'s coordinates
(line, UTF-8 byte columns). The marker is trusted only when it fits the parse: some expression
starts where it starts and ends where it ends (or runs past the printed line, which Python's
markers stop at). Then the operands that overlap the marked span are the ones that can have
raised; those overlapping the `^` part come first.
"""

from __future__ import annotations

import ast
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
