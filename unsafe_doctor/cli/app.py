"""The commands, built with typer, and the process exit a command's code or a refusal makes."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import click
import typer
from click.core import ParameterSource

from unsafe_doctor import __version__
from unsafe_doctor.cli import audit, config, diagnose, fix, rules, sentinel, verify
from unsafe_doctor.cli.conventions import reporting
from unsafe_doctor.cli.options import examples
from unsafe_doctor.cli.streams import say
from unsafe_doctor.errors import UsageError, os_reason

app = typer.Typer(
    pretty_exceptions_enable=False,
    add_completion=False,  # typer's reads no shell name: `_top` has options that do
    suggest_commands=False,  # click suggests already: once is enough
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Find, explain and fix the global tensor that MindIO recovery left unsafe. "
    "unsafe-doctor LOG, or a log piped in, runs diagnose.",
    epilog=examples("unsafe-doctor"),
)
app.command("diagnose", epilog=examples("diagnose"))(reporting(diagnose.diagnose_command))
app.command("fix", epilog=examples("fix"))(reporting(fix.fix_command))
app.command("audit", epilog=examples("audit"))(reporting(audit.audit_command))
app.command("verify", epilog=examples("verify"))(reporting(verify.verify_command))
app.add_typer(rules.app, name="rules")
app.add_typer(sentinel.app, name="sentinel")


def _show_version(*, value: bool) -> None:
    if value:
        print(f"unsafe-doctor {__version__}")
        raise typer.Exit(0)


SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")
_DETECTED = "the shell this runs in"


def _completion(value: str | None, *, install: bool) -> None:
    """`--install-completion [SHELL]` and `--show-completion [SHELL]`: the shell named, else the one
    this runs in (typer's own options take no name). The scripts are typer's."""
    if value is None:
        return
    from typer._completion_shared import _get_shell_name

    from unsafe_doctor.cli import completion

    shell = _get_shell_name() if value == _DETECTED else value.lower()
    if shell not in SHELLS:
        named = "cannot tell which shell this runs in" if value == _DETECTED else f"no completion for {value!r}"
        raise UsageError(f"{named}: name one of {', '.join(SHELLS[:4])} (e.g. --install-completion zsh)")
    if not install:
        print(completion.script(shell))
        raise typer.Exit(0)
    try:
        installed = completion.install_completion(shell)
    except OSError as error:  # a read-only home, a full disk
        where = f" ({error.filename})" if error.filename else ""
        raise UsageError(f"cannot install {shell} completion{where}: {os_reason(error)}") from None
    appended = f" (a line added at the end of {installed.appended_to})" if installed.appended_to else ""
    print(f"{shell} completion installed in {installed.script}{appended}: it works in shells started from now on")
    if installed.advice:
        print(installed.advice)
    raise typer.Exit(0)


_SHELL_HELP = "bash, zsh, fish or powershell; the shell this runs in when not named"


def _completion_option(name: str, *, install: bool, help: str) -> click.Option:
    """A click option, as typer's cannot take a value that may be left out (`--show-completion [SHELL]`)."""
    return click.Option(
        [name],
        metavar="[SHELL]",
        is_flag=False,
        flag_value=_DETECTED,
        is_eager=True,
        expose_value=False,
        help=help,
        callback=lambda context, parameter, value: _completion(value, install=install),
    )


def _command() -> click.Command:
    from typer.completion import completion_init

    completion_init()  # typer's completers, which its scripts call (without it, click's answer a format they do not read)
    command = typer.main.get_command(app)
    command.params += [
        _completion_option("--install-completion", install=True, help=f"Install completion for a shell ({_SHELL_HELP})."),
        _completion_option(
            "--show-completion",
            install=False,
            help=f"Print the completion script for a shell ({_SHELL_HELP}), to install it yourself.",
        ),
    ]
    return command


@app.callback()
def _top(
    *,
    version: Annotated[
        bool, typer.Option("--version", "-V", help="Show the version and exit.", callback=_show_version, is_eager=True)
    ] = False,
) -> None:
    """Find, explain and fix the global tensor that MindIO recovery left unsafe."""


_TOP_OPTIONS = ("--help", "-h", "--version", "-V", "--install-completion", "--show-completion")


def _with_default_command(argv: list[str]) -> list[str]:
    """`unsafe-doctor train.log` and `... | unsafe-doctor` mean `diagnose`; a first word that is no
    file and reads like a command misspelt is refused, not taken for a missing log."""
    commands = [command.name or "" for command in app.registered_commands] + [group.name or "" for group in app.registered_groups]
    if argv and (argv[0] in commands or argv[0].split("=")[0] in _TOP_OPTIONS):
        return argv
    if argv and re.fullmatch(r"[a-z]+", argv[0]) and not os.path.lexists(argv[0]):  # a word, not `fix.log`; no OSError
        import difflib  # only for a word that is no command

        close = difflib.get_close_matches(argv[0], commands, n=1)
        if close:
            raise UsageError(f"unknown command '{argv[0]}'; did you mean '{close[0]}'?")
    return ["diagnose", *argv]


def run(args: list[str], *, leave: bool) -> None:
    """Run the command line `args`; `leave`: end the process without freeing its objects (`_leave`)."""
    try:
        settings = config.find(_working_folder())
        code = _command().main(
            args=_with_default_command(args),
            prog_name="unsafe-doctor",
            standalone_mode=False,
            obj=settings,
            default_map=config.default_map(settings) if settings else None,
        )
    except click.exceptions.NoArgsIsHelpError:  # `unsafe-doctor rules`: the help was asked for by asking nothing
        sys.exit(0)
    except UsageError as error:
        say(str(error))
        sys.exit(2)
    except click.ClickException as error:  # a bad option or argument, an unsupported format: one line, not a box
        say(f"{error.format_message()}{_where_from(error)} (see --help)")
        sys.exit(error.exit_code)
    except click.exceptions.Abort:  # Ctrl-C or Ctrl-D at a question (prompts.Terminal)
        say("stopped at the question: what it asked about was not written")
        sys.exit(130)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    if leave:
        _leave(code or 0)
    sys.exit(code or 0)


def _working_folder() -> Path:
    try:
        return Path.cwd()
    except FileNotFoundError:
        raise UsageError("the working folder no longer exists (deleted?): cd to one that does") from None


def _leave(code: int) -> NoReturn:
    """The program's end, once its output is flushed: without the interpreter freeing every object
    one by one first (half a second after an audit of a job's code, for nothing). Nothing of ours
    waits for exit handlers: temporary folders and bars are closed by the commands themselves."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # a reader that left early (`| head`): its end, not an error
        pass
    os._exit(code)


def _where_from(error: click.ClickException) -> str:
    """A bad value the command line did not give: say whether a variable or pyproject.toml did."""
    if not isinstance(error, click.BadParameter) or error.ctx is None or error.param is None or error.param.name is None:
        return ""
    source = error.ctx.get_parameter_source(error.param.name)
    if source is ParameterSource.ENVIRONMENT:
        return f" (from {error.param.envvar})"
    if source is ParameterSource.DEFAULT_MAP:
        settings = error.ctx.find_object(config.Settings)
        return f" (from {settings.file if settings else 'pyproject.toml'} [tool.unsafe-doctor])"
    return ""
