"""Command line: parse options, call the core, render. No diagnosis logic lives here.

One module per command (`diagnose`, `fix`, `audit`, `verify`, `rules`, `sentinel`), each returning its exit
code; `app` builds the commands and turns a command's exit code, or a refusal, into the process
exit; `workflow` holds the interactive diagnose -> fix -> verify path and its questions, `streams`
the input and output helpers, `options` the options several commands share, `conventions` the
-o/-q/-v/--exit-zero/--format github every reporting command takes, `config` the settings of
pyproject.toml. A command module loads the core it runs only when it runs: `--help` and `-V`
load none of it.

The top stage: it may import any other; none imports it but the entry points.
"""

from __future__ import annotations

import codecs
import os
import sys

from unsafe_doctor import __version__


def main(argv: list[str] | None = None) -> None:
    _usable_streams()
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-V"], ["--version"]):  # answered before the command line's libraries load
        print(f"unsafe-doctor {__version__}")
        sys.exit(0)
    from unsafe_doctor.cli.app import run

    run(args, leave=argv is None)


def _usable_streams() -> None:
    """Standard streams as the commands can use them. A closed stderr (`2>&-`) becomes /dev/null, so
    that a refusal still exits 2; a closed stdout is refused, the output having nowhere to go; a
    terminal or variable that asks for ASCII or Latin-1 gets our `·`, `…` and names escaped, not a
    UnicodeEncodeError."""
    if sys.stderr is None:
        sys.stderr = open(_null_at(2), "w", closefd=False)  # noqa: SIM115 - the process's own stderr
    if sys.stdout is None:
        print(
            "unsafe-doctor: standard output is closed (>&-): there is nowhere to write; send it to a file or /dev/null instead",
            file=sys.stderr,
        )
        sys.exit(2)
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None)
        if encoding and codecs.lookup(encoding).name != "utf-8" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


def _null_at(descriptor: int) -> int:
    """/dev/null opened onto `descriptor`, which is closed (open takes the lowest free number)."""
    null = os.open(os.devnull, os.O_WRONLY)
    if null != descriptor:
        os.dup2(null, descriptor)
        os.close(null)
    return descriptor
