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

import sys

from unsafe_doctor import __version__


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-V"], ["--version"]):  # answered before the command line's libraries load
        print(f"unsafe-doctor {__version__}")
        sys.exit(0)
    from unsafe_doctor.cli.app import run

    run(args, leave=argv is None)
