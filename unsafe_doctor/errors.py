"""The one exception the core raises for bad input; the CLI turns it into a line on stderr and exit 2."""

from __future__ import annotations

from pathlib import Path


class UsageError(Exception):
    """Bad usage or unreadable input. The message is shown to the user as one line."""


class AmbiguousAdaptor(UsageError):
    """Several files under the source roots hold a rollback function: which is the adaptor is the
    person's to say (--adaptor, or an answer at the terminal), never guessed."""

    def __init__(self, candidates: tuple[Path, ...]) -> None:
        shown = ", ".join(map(str, candidates[:5])) + (", ..." if len(candidates) > 5 else "")
        super().__init__(f"several recovery adaptors under the source roots ({shown}): name the one to use with --adaptor FILE")
        self.candidates = candidates


def os_reason(error: OSError | ValueError) -> str:
    """An OS error about a path as the lower-case phrase a person reads: 'no such file or directory',
    'too many levels of symbolic links', 'file name too long'."""
    if isinstance(error, FileNotFoundError):
        return "no such file or directory"
    if isinstance(error, PermissionError):
        return "permission denied"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror[0].lower() + error.strerror[1:]
    return str(error)  # a NUL byte in the name: "embedded null byte"
