"""Splicing blocks into an adaptor's files: where a block goes in its function (`insertion_point`),
every block of a file inserted at once (`insert_blocks`), and the result checked: it must compile
(`checked_edit`). Edits are spliced into the original bytes at line boundaries, so every other byte
stays as it was (line endings, tabs, encoding). Nothing here writes files.
"""

from __future__ import annotations

import difflib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from unsafe_doctor.adaptor.code import AdaptorFunction, AdaptorSource, block_spans
from unsafe_doctor.errors import UsageError
from unsafe_doctor.source.markers import SENTINEL_KEYS


@dataclass(frozen=True)
class Insertion:
    """Where a block went into the original file, so that SARIF can place it without a diff."""

    line: int  # 0-based index of the original line the text goes before; the line count: at the end of the file
    text: str  # what was spliced in there, line endings included


@dataclass(frozen=True)
class FileEdit:
    path: Path  # as shown to the user
    original: bytes
    updated: bytes
    encoding: str
    digest: str  # sha256 of `original`: the file must still hold it when the edit is written
    changes: tuple[str, ...]  # one line per block inserted or removed
    insertions: tuple[Insertion, ...] = ()  # the blocks a fix inserts, top to bottom; none for a revert

    def diff(self) -> str:
        """Unified diff of this file, lines ending as in the file, as `git apply` and `patch -p1` take it."""
        before = [line.decode(self.encoding, errors="replace") for line in self.original.splitlines(keepends=True)]
        after = [line.decode(self.encoding, errors="replace") for line in self.updated.splitlines(keepends=True)]
        name = patch_path(self.path)
        lines = difflib.unified_diff(before, after, fromfile=f"a/{name}", tofile=f"b/{name}")
        return "".join(line if line.endswith(("\n", "\r")) else line + "\n\\ No newline at end of file\n" for line in lines)


def patch_path(path: Path) -> str:
    """The file's path as a patch names it (after `a/` and `b/`): from the root of the git repository
    around the working folder, else from the working folder; a file outside it from `/`."""
    absolute = Path(os.path.abspath(path))
    folder = Path.cwd()
    base = next((parent for parent in (folder, *folder.parents) if (parent / ".git").exists()), folder)
    try:
        return absolute.relative_to(base).as_posix()
    except ValueError:
        return absolute.as_posix().lstrip("/")


def has_block(source: AdaptorSource, function: AdaptorFunction, key: str) -> bool:
    return any(span.key == key and function.first_line - 1 <= span.begin < function.last_line for span in block_spans(source))


def insertion_point(source: AdaptorSource, function: AdaptorFunction, key: str) -> int:
    """The 0-based line a new block goes before: the end of the function's body (before a trailing
    `return`), after the blocks already there, and before the sentinel's block (or heal's), which stays last."""
    at = function.insert_at
    assert at is not None, "Adaptor.function refuses a function whose body is on its `def` line"
    spans = [span for span in block_spans(source) if function.first_line - 1 <= span.begin < function.last_line]
    for span in spans:  # a block's end marker trails the body's last statement: the body ends after it
        if span.begin < at <= span.end:
            at = span.end + 1
    sentinel = next((span for span in spans if span.key in SENTINEL_KEYS), None)
    if key not in SENTINEL_KEYS and sentinel is not None and sentinel.begin < at:
        at = sentinel.begin
    return at


def early_return_notes(source: AdaptorSource, function: AdaptorFunction) -> list[str]:
    if not function.early_returns:
        return []
    lines = ", ".join(map(str, function.early_returns))
    return [
        f"{source.shown}: {function.name}() returns before its end (line {lines}): "
        "the block runs only on paths that reach the end"
    ]


def insert_blocks(source: AdaptorSource, items: list[tuple[int, AdaptorFunction, list[str], str]]) -> FileEdit:
    """Every block for one file spliced in at once (one combined diff), each before its line; blocks
    for one place keep their planned order, so the send and receive sides of several fixes pair up."""
    lines = list(source.lines)
    newline = source.encode(source.newline)
    changes = []
    insertions = []
    # Bottom to top, so earlier positions stay valid; at one position, the last planned block first.
    for _, (at, function, block, key) in sorted(enumerate(items), key=lambda item: (item[1][0], item[0]), reverse=True):
        encoded = [source.encode(line) + newline for line in block]
        text = "".join(line + source.newline for line in block)
        if at == len(lines) and lines and not lines[-1].endswith((b"\n", b"\r")):
            lines[-1] += newline  # the file ended without a line ending after the function:
            encoded[-1] = encoded[-1][: -len(newline)]  # it still does, after the block
            text = source.newline + text[: -len(source.newline)]
        lines[at:at] = encoded
        changes.append(f"{source.shown}:{at + 1}: insert {key} at the end of {function.name}()")
        insertions.append(Insertion(at, text))
    changes.reverse()
    insertions.reverse()
    return checked_edit(source, b"".join(lines), tuple(changes), tuple(insertions))


def checked_edit(
    source: AdaptorSource, updated: bytes, changes: tuple[str, ...], insertions: tuple[Insertion, ...] = ()
) -> FileEdit:
    """The edit, once the new content parses and compiles."""
    try:
        compile(updated, str(source.path), "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        reason = f"{error.msg}, line {error.lineno}" if isinstance(error, SyntaxError) else str(error).splitlines()[0]
        raise UsageError(f"{source.shown}: the edited file would not compile ({reason}): nothing written") from None
    digest = hashlib.sha256(source.data).hexdigest()
    return FileEdit(source.path, source.data, updated, source.encoding, digest, changes, insertions)
