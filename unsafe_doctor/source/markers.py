"""The comment lines around each block unsafe-doctor writes into an adaptor, and reading them back.

Kept apart from `adaptor` so that `audit` and `diagnose` recognise its blocks without loading
the code that writes them."""

from __future__ import annotations

import io
import tokenize
from dataclasses import dataclass

MARKER_BEGIN = "# unsafe-doctor: begin "
MARKER_END = "# unsafe-doctor: end "
# The key of the sentinel's block (`unsafe-doctor sentinel install`). A rule id has no `_` and a fix
# key for a named global has a `:`, so no fix block can take this key.
SENTINEL_KEY = "unsafe_doctor.sentinel"
# Mode heal's block at the end of each repair function (send and receive): installed, kept last and
# reverted with the sentinel's.
HEAL_KEY = "unsafe_doctor.sentinel.heal"
SENTINEL_KEYS = frozenset({SENTINEL_KEY, HEAL_KEY})


@dataclass(frozen=True)
class BlockMarker:
    line: int  # 0-based index of its line
    begins: bool  # a begin marker; else an end marker
    key: str


def markers(text: str) -> list[BlockMarker]:
    """The markers in a file's text, top to bottom: comments alone on their line, at statement level.

    Read from the token stream, not the lines: the same text in a string (a docstring quoting a
    block) or between brackets is no marker, and neither `sentinel install` nor `--revert` may take
    it for one. Text that does not tokenize to its end gives the markers before the fault."""
    found: list[BlockMarker] = []
    depth = 0
    try:
        for token in tokenize.generate_tokens(io.StringIO(text, newline=None).readline):  # \r ends a line too
            if token.type == tokenize.OP and token.string in "([{":
                depth += 1
            elif token.type == tokenize.OP and token.string in ")]}":
                depth = max(depth - 1, 0)
            elif token.type == tokenize.COMMENT and depth == 0 and not token.line[: token.start[1]].strip():
                comment = token.string.rstrip()
                for prefix, begins in ((MARKER_BEGIN, True), (MARKER_END, False)):
                    if comment.startswith(prefix):
                        found.append(BlockMarker(token.start[0] - 1, begins, comment[len(prefix) :]))
    except (tokenize.TokenError, SyntaxError):
        pass
    return found
