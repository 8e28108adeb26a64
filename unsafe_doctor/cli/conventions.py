"""The options every reporting command takes the way ruff and pip-audit take them: `-o FILE`,
`-q`, `-v`, `--exit-zero`, and `--format github`. They act around the command, not inside it,
so each command's body stays about its own job.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

import click

from unsafe_doctor.cli import options
from unsafe_doctor.cli.config import Settings
from unsafe_doctor.cli.streams import output_lost, same_file, say, stdout_names
from unsafe_doctor.errors import UsageError, os_reason

Command = Callable[..., int]


def reporting(command: Command) -> Command:
    """diagnose, fix, verify, audit: -o, -q, -v and --exit-zero; --format github where SARIF is written."""

    @functools.wraps(command)
    def run(*, output: Path | None, quiet: bool, verbose: bool, exit_zero: bool, **kwargs: Any) -> int:
        if quiet and verbose:
            raise UsageError("--quiet and --verbose contradict each other: give one")
        if verbose:
            for line in _settings_in_force():
                say(line)
        annotate = kwargs.get("output_format") is options.LocatedFormat.github
        if annotate:  # written as SARIF, then each result rewritten as a workflow command
            kwargs["output_format"] = options.LocatedFormat.sarif
        if "verbose" in inspect.signature(command).parameters:  # the command says more too (diagnose: the evidence)
            kwargs["verbose"] = verbose
        with _stdout_to(output, kwargs), _silenced(quiet=quiet):
            code = _annotated(command, **kwargs) if annotate else command(**kwargs)
        return 0 if exit_zero and code == 1 else code

    return _with_options(
        run,
        command,
        output=options.OutputOption,
        quiet=options.QuietOption,
        verbose=options.VerboseOption,
        exit_zero=options.ExitZeroOption,
    )


def printing(command: Command) -> Command:
    """rules list and show: only -o (they have no notes to quiet and no findings to exit 1 on)."""

    @functools.wraps(command)
    def run(*, output: Path | None, **kwargs: Any) -> int:
        with _stdout_to(output, kwargs):
            return command(**kwargs)

    return _with_options(run, command, output=options.OutputOption)


def _with_options(run: Command, command: Command, **added: Any) -> Command:
    """`run` as typer sees it: the command's own parameters, then the added ones (off, or no file)."""
    signature = inspect.signature(command, eval_str=True)
    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None if name == "output" else False, annotation=kind)
        for name, kind in added.items()
        if name not in signature.parameters
    ]
    parameters = [parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY) for parameter in signature.parameters.values()]
    run.__signature__ = signature.replace(parameters=[*parameters, *extra])  # type: ignore[attr-defined]
    run.__annotations__ = {**{p.name: p.annotation for p in parameters}, **added, "return": int}
    return run


def _annotated(command: Command, **kwargs: Any) -> int:
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        code = command(**kwargs)
    document = json.loads(captured.getvalue() or "{}")
    from unsafe_doctor.report.github import from_sarif

    for line in from_sarif(document, Path.cwd()):
        print(line)
    return code


def _settings_in_force() -> list[str]:
    context = click.get_current_context(silent=True)
    settings = context.find_object(Settings) if context else None
    lines = [f"settings from {settings.file} [tool.unsafe-doctor]" if settings else "no [tool.unsafe-doctor] table found"]
    lines += [f"{name}={value}" for name, value in sorted(os.environ.items()) if name.startswith("UNSAFE_DOCTOR_")]
    return lines


@contextlib.contextmanager
def _silenced(*, quiet: bool) -> Iterator[None]:
    """Notes and progress go to stderr; -q sends them nowhere. Refusals are printed by `main`, after."""
    if not quiet:
        yield
        return
    with open(os.devnull, "w") as nowhere, contextlib.redirect_stderr(nowhere):
        yield


@contextlib.contextmanager
def _stdout_to(output: Path | None, arguments: Mapping[str, Any]) -> Iterator[None]:
    """stdout into `output`, as `>` would, but never over a file the command reads or writes.

    A descriptor named as a file (`/dev/stdout`, `/dev/fd/N`) is written itself, as the shell
    writes it: an appending stdout goes on appending. A device or a FIFO is written through. The
    report for a regular file is written whole beside it first, so a refusal or a full disk leaves
    the old report as it was; once the command returns, it goes into an existing file in place (a
    symlink's target, the link kept), which keeps its inode, hard links, owner, group and mode, and
    is renamed into place where there was no file."""
    if output is None:
        yield
        return
    named = _descriptor_named(output)
    if named is not None:
        with (
            _written_through(output, lambda: os.dup(named)) as stream,
            contextlib.redirect_stdout(stream),
            stdout_names(str(output), file=False),
        ):
            yield
        return
    _refuse_own_input(output, arguments)
    existing = _existing_file(output)
    if existing is None and os.path.exists(output):  # a device, a FIFO
        with (
            _written_through(output, lambda: os.open(output, os.O_WRONLY | os.O_CLOEXEC)) as stream,
            contextlib.redirect_stdout(stream),
            stdout_names(str(output)),
        ):
            yield
        return
    target = Path(os.path.realpath(output))
    try:
        descriptor, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as error:
        if existing is not None:
            os.close(existing)
        raise UsageError(f"cannot write {output}: {os_reason(error)}") from None
    stream = open(descriptor, "w", encoding="utf-8")
    try:
        with contextlib.redirect_stdout(stream), stdout_names(str(output)):
            yield
        if output_lost(stream):  # said by the command, which went on (`fix` had written the adaptor)
            return
        try:
            stream.flush()
            if existing is not None:
                from unsafe_doctor.source.files import write_over

                report = Path(temporary).read_bytes()
                os.unlink(temporary)  # its space, for the file's
                write_over(existing, report)
            else:
                os.fsync(stream.fileno())
                os.chmod(temporary, _new_file_mode())
                os.replace(temporary, target)
        except OSError as error:
            raise UsageError(f"cannot write {output}: {os_reason(error)}: the old report is left as it was") from None
    finally:
        stream.close()
        if existing is not None:
            os.close(existing)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


_DESCRIPTOR_PATH = re.compile(r"/(?:dev/fd|proc/(?:self|thread-self|(?P<pid>\d+))/fd)/(?P<descriptor>\d+)")


def _descriptor_named(output: Path) -> int | None:
    """The descriptor of this process that `output` names: `/dev/fd/N`, `/proc/self/fd/N`, or a
    symlink to one (`/dev/stdout`, `/dev/stderr`). Opening such a name opens the file behind the
    descriptor anew, so a report written there would replace what an appending stdout holds."""
    path = os.path.abspath(output)
    for _ in range(40):  # the kernel's own limit on symlinks followed
        named = _DESCRIPTOR_PATH.fullmatch(path)
        if named and named["pid"] in (None, str(os.getpid())):
            return int(named["descriptor"])
        try:
            link = os.readlink(path)
        except (OSError, ValueError):
            return None
        path = os.path.normpath(os.path.join(os.path.dirname(path), link))
    return None


def _existing_file(output: Path) -> int | None:
    """The regular file `output` names, opened for writing, as `>` opens it: before the command runs,
    so that a file that cannot be written (its mode, a symlink loop) is refused before anything else
    is; None where there is no file yet, or something else (a device, a FIFO)."""
    try:
        status = os.stat(output)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot write {output}: {os_reason(error)}") from None
    if not stat.S_ISREG(status.st_mode):
        return None
    try:
        return os.open(output, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as error:
        raise UsageError(f"cannot write {output}: {os_reason(error)}") from None


@contextlib.contextmanager
def _written_through(output: Path, opened: Callable[[], int]) -> Iterator[TextIO]:
    """stdout into the descriptor `opened` gives, as it is (not truncated, not replaced)."""
    try:
        stream = open(opened(), "w", encoding="utf-8")
    except OSError as error:  # a descriptor not open
        raise UsageError(f"cannot write {output}: {os_reason(error)}") from None
    try:
        with stream:
            yield stream
    except OSError as error:  # /dev/full; a FIFO whose reader left
        raise UsageError(f"cannot write {output}: {os_reason(error)}") from None


def _refuse_own_input(output: Path, arguments: Mapping[str, Any]) -> None:
    """`-o` naming a file the command reads (`fix --adaptor A -o A`, `diagnose LOG -o LOG`, a log
    piped in, `diagnose -o LOG < LOG`), or one it would read in a folder it was given (`audit PKG -o
    PKG/x.py`): the report would replace it."""
    target = os.path.realpath(output)
    for name, read_there in _read_in_folders().items():
        value = arguments.get(name)
        for given in value if isinstance(value, list | tuple) else [value] if value is not None else []:
            real = os.path.realpath(given)
            inside = os.path.isdir(real) and target.startswith(real.rstrip(os.sep) + os.sep)
            if same_file(output, given) or (inside and read_there(os.path.basename(target))):
                raise UsageError(f"-o {output} would replace the command's own input ({given}): write the report elsewhere")
    logs = arguments.get("logs", None)
    if "logs" in arguments and (not logs or "-" in logs) and _is_stdin(output):
        raise UsageError(
            f"-o {output} would replace the command's own input (the log on standard input): write the report elsewhere"
        )


def _is_stdin(output: Path) -> bool:
    """Whether stdin is the regular file `output` names (`< job.log`)."""
    try:
        status = os.fstat(0)
        return stat.S_ISREG(status.st_mode) and os.path.samestat(status, os.stat(output))
    except (OSError, ValueError):
        return False


def _read_in_folders() -> dict[str, Callable[[str], bool]]:
    """The options that name inputs, each with the files the command reads in a folder it names."""
    from unsafe_doctor.knowledge.loading import KNOWLEDGE_SUFFIXES
    from unsafe_doctor.log.inputs import is_log_name

    def python(name: str) -> bool:
        return name.endswith(".py")

    return {
        "logs": is_log_name,
        "paths": python,
        "source_root": python,
        "adaptor": python,
        "rules": lambda name: name.endswith(KNOWLEDGE_SUFFIXES),
    }


def _new_file_mode() -> int:
    """The mode a plain `>` gives a new file."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
