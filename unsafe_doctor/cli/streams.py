"""Where input comes from and output goes: logs or stdin, JSON and rich output on stdout, notes on
stderr, and a progress bar on stderr for large inputs and long audits."""

from __future__ import annotations

import codecs
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO

from unsafe_doctor.errors import UsageError, os_reason

if TYPE_CHECKING:
    from rich.console import RenderableType

    from unsafe_doctor.knowledge.versions import Environment
    from unsafe_doctor.log.inputs import SkippedInput

PROGRESS_FROM = 50 << 20  # inputs smaller than this finish before a bar would be worth drawing


def log_paths(logs: list[str] | None) -> list[str]:
    """The logs named; none means stdin, which must then be piped in, not a terminal (nor closed: `<&-`).
    `-` reads stdin even at a terminal, which is then told how to end the log it pastes."""
    paths = logs or []
    if not paths and (sys.stdin is None or sys.stdin.isatty()):
        raise UsageError("no input: name a log file or folder, or pipe a log in (see --help)")
    if "-" in paths and sys.stdin is not None and sys.stdin.isatty():
        say("reading the log from this terminal: paste it, then press Ctrl-D on an empty line")
    return paths


def warn_skipped(skipped: Sequence[SkippedInput]) -> None:
    """One line per input that could not be read; the rest were diagnosed. Said even under -q: an
    input left out is not noise."""
    for item in skipped:
        say(f"skipped {item.name}: {item.reason}", stream=sys.__stderr__ or sys.stderr)


def say_adaptor(environment: Environment) -> None:
    """Which adaptor file the command reads or writes, and how it came to be the one."""
    if environment.adaptor is not None:
        say(f"adaptor {environment.adaptor} ({environment.adaptor_why})")


def adaptor_not_output(environment: Environment) -> None:
    """`-o` naming one of the adaptor's files (its sibling too, which no option names), or the backup a
    write keeps of one, is refused once the adaptor is known, before anything is written: the report
    would replace it."""
    output = _output_file()
    if output is None or environment.adaptor is None:
        return
    from unsafe_doctor.adaptor.code import adaptor_files
    from unsafe_doctor.adaptor.write import backup_of
    from unsafe_doctor.source.files import shown_path

    for path in adaptor_files(environment):
        for what, file in (("adaptor file", path), ("adaptor file's backup", backup_of(path))):
            if same_file(output, file):
                raise UsageError(
                    f"-o {output} would replace the command's own {what} ({shown_path(file)}): write the report elsewhere"
                )


def same_file(one: str | Path, other: str | Path) -> bool:
    """Whether two names are one file: the same inode (hard links too), or the same path once
    symlinks are resolved (a file not there yet)."""
    try:
        return os.path.samefile(one, other)
    except (OSError, ValueError):
        return os.path.realpath(one) == os.path.realpath(other)


def say(line: str, stream: TextIO | None = None) -> None:
    """A note for the person (what was decided or done) on stderr, apart from the output proper;
    control characters escaped, since notes name files and log text."""
    from unsafe_doctor.report.common import printable

    print(f"unsafe-doctor: {printable(line)}", file=stream or sys.stderr)


def print_json(document: dict[str, Any]) -> None:
    """UTF-8 as is; to an ASCII or Latin-1 stdout as \\u escapes, which every JSON reader takes."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    with _reader_may_leave():
        sys.stdout.write(json.dumps(document, indent=2, ensure_ascii=codecs.lookup(encoding).name != "utf-8") + "\n")
        sys.stdout.flush()


def print_rich(renderable: RenderableType) -> None:
    """Colour only on a terminal, and never under NO_COLOR (rich reads both itself). Not cropped at
    the width: code to copy is printed whole (report.terminal.CodeToCopy); all else fits the width."""
    with _reader_may_leave():
        _console()(highlight=False).print(renderable, crop=False)
        sys.stdout.flush()


_DIFF_STYLES = (("+++", "bold"), ("---", "bold"), ("+", "green"), ("-", "red"), ("@@", "cyan"))


def print_diff(diff: str) -> None:
    """A unified diff on stdout: as it is to a file or a pipe (it is a patch to apply), coloured at a
    terminal (not under NO_COLOR). There every line stays whole, never folded into a line without its
    `+`, `-` or space (the terminal wraps what is wider), and a control character (a folder name's
    escape sequence) is shown as an escape, not acted on."""
    with _reader_may_leave():
        if not sys.stdout.isatty() or os.environ.get("NO_COLOR"):
            sys.stdout.write(diff)
        else:
            from rich.text import Text

            from unsafe_doctor.report.common import printable

            text = Text()
            for line in _diff_lines(diff):
                shown = printable(line)
                text.append(shown + "\n", style=next((style for start, style in _DIFF_STYLES if shown.startswith(start)), ""))
            _console()(highlight=False).print(text, soft_wrap=True, end="")
        sys.stdout.flush()


def _diff_lines(diff: str) -> list[str]:
    """The diff's lines without their ends (LF, CRLF or CR, as the file's lines end)."""
    lines = diff.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return lines[:-1] if lines[-1] == "" else lines


@contextmanager
def _reader_may_leave() -> Iterator[None]:
    """`… | head -c1` closes the pipe early: the rest of the output goes nowhere, silently, and the
    command still exits with the code its result deserves (click and rich would make it 1)."""
    try:
        yield
    except BrokenPipeError:
        _output_nowhere()
    except OSError as error:  # a full disk, a quota: the report is lost, and the person must know
        _output_nowhere()
        raise UsageError(f"cannot write the report to {_destinations[-1].name}: {os_reason(error)}") from None


class _Destination(NamedTuple):
    """Where stdout goes, as the person named it (`-o FILE`)."""

    name: str
    file: bool  # a file, not a descriptor: the command may not read or write it


_destinations = [_Destination("standard output", file=False)]


@contextmanager
def stdout_names(destination: str, *, file: bool = True) -> Iterator[None]:
    """While stdout is redirected to `destination` (a `file`, not a descriptor): a report that cannot
    be written names it, and the command refuses to read or write the file (`adaptor_not_output`)."""
    _destinations.append(_Destination(destination, file))
    try:
        yield
    finally:
        _destinations.pop()


def _output_file() -> str | None:
    """The file `-o` named while stdout goes there; None for stdout itself or a descriptor."""
    destination = _destinations[-1]
    return destination.name if destination.file else None


def output_lost(stream: TextIO) -> bool:
    """Whether a write to `stream` failed, and its descriptor now leads nowhere (`_output_nowhere`)."""
    return os.path.samestat(os.fstat(stream.fileno()), os.stat(os.devnull))


def _output_nowhere() -> None:
    nowhere = os.open(os.devnull, os.O_WRONLY)
    os.dup2(nowhere, sys.stdout.fileno())  # what is still buffered is flushed there at exit
    os.close(nowhere)


@cache
def _console() -> type:
    """rich's console, loaded when a report is rendered (not for `--help`)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            """rich's own raises SystemExit(1) here."""
            self.quiet = True
            _output_nowhere()

    return _Console


def _transient_bar(*columns: Any) -> Any:
    """A rich Progress on stderr, described and barred, then `columns`; gone once stopped."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress

    return Progress(
        "[progress.description]{task.description}", BarColumn(), *columns, console=Console(stderr=True), transient=True
    )


class progress_bar:
    """A byte progress bar on stderr, only for large inputs and only when stderr is a terminal."""

    def __init__(self, paths: list[str]) -> None:
        self.bar: Any = None  # a rich Progress, imported only when a bar is drawn
        if not sys.stderr.isatty():
            return
        from unsafe_doctor.log.inputs import total_size

        total = total_size(paths) if paths else _stdin_size()
        if total is not None and total >= PROGRESS_FROM:
            from rich.progress import DownloadColumn, TransferSpeedColumn

            self.bar = _transient_bar(DownloadColumn(), TransferSpeedColumn())
            self.task = self.bar.add_task("reading logs", total=total)

    def __enter__(self) -> Callable[[int], None] | None:
        if self.bar is None:
            return None
        self.bar.start()
        return lambda count: self.bar.advance(self.task, count)

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        """The bar gone now, the logs read: a question is to be asked at the terminal it was drawn on."""
        if self.bar is not None:
            self.bar.stop()


class stages_bar:
    """A bar on stderr for a long run's stages (an audit's files read, files scanned, holders judged),
    only when `shown`, each stage described by its label; it is gone once the run ends."""

    def __init__(self, *, shown: bool, labels: Mapping[str, str]) -> None:
        self.bar: Any = None  # a rich Progress, imported only when a bar is drawn
        self.labels = labels
        self.stage: str | None = None
        if shown:
            from rich.progress import MofNCompleteColumn, TimeElapsedColumn

            self.bar = _transient_bar(MofNCompleteColumn(), TimeElapsedColumn())
            self.task = self.bar.add_task("starting", total=None)

    def __enter__(self) -> Callable[[str, int, int], None] | None:
        if self.bar is None:
            return None
        self.bar.start()
        return self._advance

    def _advance(self, stage: str, done: int, total: int) -> None:
        if stage != self.stage:
            self.stage = stage
            self.bar.reset(self.task, total=total, description=self.labels.get(stage, stage))
        self.bar.update(self.task, completed=done)

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        """The bar gone now: a question is to be asked at the terminal it was drawn on."""
        if self.bar is not None:
            self.bar.stop()


def _stdin_size() -> int | None:
    try:
        status = os.fstat(sys.stdin.fileno())
    except (AttributeError, OSError, ValueError):  # stdin closed
        return None
    return status.st_size if status.st_size else None
