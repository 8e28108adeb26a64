"""Questions to the person at the terminal, one behaviour for diagnose, fix and audit --fix.

Questions are read from stdin when it is a terminal, else from the controlling terminal (/dev/tty),
so they are asked while the log arrives on stdin (`cat train.log | unsafe-doctor fix ...`). None is asked with --yes or
--no-input, or when stdout is not a terminal (the output is being saved or read by a program).
End of input (Ctrl-D) or Ctrl-C at a question stops the command with exit 130, as an interrupt,
on a line of its own and saying that what was asked about was not written.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import click

from unsafe_doctor.errors import AmbiguousAdaptor
from unsafe_doctor.report.common import printable

if TYPE_CHECKING:
    from unsafe_doctor.knowledge.versions import AdaptorChooser


class Terminal:
    """The person's terminal: what is written there is read by them, what they type is the answer."""

    def __init__(self, reader: TextIO, writer: TextIO) -> None:
        self.reader, self.writer = reader, writer

    def tell(self, text: str) -> None:
        self.writer.write(text)
        self.writer.flush()

    def answer(self, prompt: str) -> str:
        """The line typed after the prompt, stripped; end of input is an interrupt, not a "no"."""
        self.tell(fitted(prompt, self._columns()))
        try:
            line = self.reader.readline()
        except KeyboardInterrupt:
            line = ""
        if not line:
            self.tell("\n")  # the shell's prompt on a line of its own
            raise click.exceptions.Abort()
        return line.strip()

    def _columns(self) -> int:
        """The width of this terminal, the one the prompt is written to (stdout may be another, and
        COLUMNS may say what stdout was); where it tells none (a window size of 0), COLUMNS or 80."""
        try:
            columns = os.get_terminal_size(self.writer.fileno()).columns
        except (OSError, ValueError):  # io.UnsupportedOperation is both
            columns = 0
        return columns or shutil.get_terminal_size().columns

    def confirm(self, question: str) -> bool:
        """Yes or no, no by default (Enter); anything else is asked again, not taken for a no."""
        while True:
            reply = self.answer(f"{question} [y/N]: ").lower()
            if reply in ("y", "yes", "n", "no", ""):
                return reply in ("y", "yes")
            self.tell("answer y or n (Enter: no)\n")


def fitted(prompt: str, columns: int) -> str:
    """The prompt wrapped between words at the terminal's width, its choice (`[y/N]:`) and every
    path whole: the terminal itself would cut a long line anywhere, `[y/` on one line, `N]` on the next."""
    width = columns - 1  # the answer's first character fits after the prompt
    words = prompt.rstrip(" ")
    return textwrap.fill(words, width, break_long_words=False, break_on_hyphens=False) + prompt[len(words) :]


@contextlib.contextmanager
def terminal(*, ask: bool) -> Iterator[Terminal | None]:
    """The controlling terminal when questions may be asked (`ask`: neither --yes nor --no-input),
    stdout is a terminal and one can be opened; None otherwise."""
    if not ask or not sys.stdout.isatty():
        yield None
        return
    if sys.stdin.isatty():
        yield Terminal(sys.stdin, sys.stdout)
        return
    try:  # a tty is not seekable: unbuffered bytes, wrapped for text
        raw = open("/dev/tty", "r+b", buffering=0)  # noqa: SIM115 (closed by the with below)
    except OSError:
        yield None
        return
    with io.TextIOWrapper(raw, encoding="utf-8", errors="replace", write_through=True) as stream:
        yield Terminal(stream, stream)


def adaptor_chooser(*, yes: bool, no_input: bool, before_asking: Callable[[], None] = lambda: None) -> AdaptorChooser:
    """How a command's detection settles several adaptors found: the one the person picks at the
    terminal (each path escaped: a folder's name must not set the terminal's title or clear it),
    `before_asking` first (a progress bar stopped); the refusal itself where no one can be asked
    (--yes, --no-input, no terminal)."""

    def chosen(error: AmbiguousAdaptor) -> Path:
        before_asking()
        with terminal(ask=not (yes or no_input)) as person:
            if person is None:
                raise error
            person.tell("Several recovery adaptors are under the source roots:\n")
            for number, candidate in enumerate(error.candidates, 1):
                person.tell(f"  {number} = {printable(str(candidate))}\n")
            numbers = {str(number) for number in range(1, len(error.candidates) + 1)}
            while (answer := person.answer(f"Which is yours? [1-{len(error.candidates)}]: ")) not in numbers:
                person.tell("answer with one of the numbers\n")
        return error.candidates[int(answer) - 1]

    return chosen
