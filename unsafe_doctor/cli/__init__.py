"""Command line: parse options, call the core, render. No diagnosis logic lives here.

One module per command (`diagnose`, `fix`, `audit`, `verify`, `rules`), each returning its exit
code; `workflow` holds the interactive diagnose -> fix -> verify path and its questions, `streams`
the input and output helpers, `options` the options several commands share. `main` turns a
command's exit code, or a refusal, into the process exit.
"""

from __future__ import annotations

import sys
from typing import Annotated

import click
import typer

from unsafe_doctor import __version__
from unsafe_doctor.cli import audit, diagnose, fix, rules, verify
from unsafe_doctor.errors import UsageError

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Find, explain and fix the global tensor that MindIO recovery left unsafe.",
)
app.command("diagnose")(diagnose.command)
app.command("fix")(fix.command)
app.command("audit")(audit.command)
app.command("verify")(verify.command)
app.add_typer(rules.app, name="rules")


def _show_version(value: bool) -> None:
    if value:
        print(f"unsafe-doctor {__version__}")
        raise typer.Exit(0)


@app.callback()
def _top(
    version: Annotated[
        bool, typer.Option("--version", help="Show the version and exit.", callback=_show_version, is_eager=True)
    ] = False,
) -> None:
    """Find, explain and fix the global tensor that MindIO recovery left unsafe."""


def _with_default_command(argv: list[str]) -> list[str]:
    """`unsafe-doctor train.log` and `... | unsafe-doctor` mean `diagnose`."""
    commands = {command.name for command in app.registered_commands} | {group.name for group in app.registered_groups}
    if argv and (argv[0] in commands or argv[0] in ("--help", "-h", "--version")):
        return argv
    return ["diagnose", *argv]


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        code = app(args=_with_default_command(args), prog_name="unsafe-doctor", standalone_mode=False)
    except UsageError as error:
        print(f"unsafe-doctor: {error}", file=sys.stderr)
        sys.exit(2)
    except click.ClickException as error:  # a bad option or argument, an unsupported format: one line, not a box
        print(f"unsafe-doctor: {error.format_message()} (see --help)", file=sys.stderr)
        sys.exit(error.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    sys.exit(code or 0)
