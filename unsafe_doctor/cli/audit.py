"""`unsafe-doctor audit`: a framework's globals that hold device tensors, and whether recovery covers each."""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from unsafe_doctor.cli.fix import show_plan, tell_outcome
from unsafe_doctor.cli.options import (
    ADAPTOR_VARIABLE,
    CACHE_VARIABLE,
    SOURCE_ROOT_VARIABLE,
    LocatedFormat,
    LocatedFormatOption,
    NoInputOption,
    RulesOption,
    YesOption,
)
from unsafe_doctor.cli.streams import adaptor_not_output, print_json, print_rich, say, stages_bar
from unsafe_doctor.errors import UsageError

if TYPE_CHECKING:
    from unsafe_doctor.adaptor.plan import Plan
    from unsafe_doctor.recovery_code.model import Audit, AuditedHolder
    from unsafe_doctor.report.common import NextStep


def audit_command(
    paths: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Framework source folders or files to scan; none: the source roots of pyproject.toml's "
            "\\[tool.unsafe-doctor] table, else the current folder. "
            "Env: UNSAFE_DOCTOR_SOURCE_ROOT.",  # \\[: rich would read a markup tag
            show_default=False,
            envvar=SOURCE_ROOT_VARIABLE,
            show_envvar=False,
        ),
    ] = None,
    *,
    adaptor: Annotated[
        str,
        typer.Option(
            "--adaptor",
            help="The recovery adaptor file, or auto: found under the paths by its profile's file names, "
            "else the audited module that defines the profile's rollback and repair functions. Env: UNSAFE_DOCTOR_ADAPTOR.",
            envvar=ADAPTOR_VARIABLE,
            show_envvar=False,
        ),
    ] = "auto",
    output_format: LocatedFormatOption = LocatedFormat.text,
    rules: RulesOption = None,
    fix: Annotated[bool, typer.Option("--fix", help="Write the fix of every uncovered global that has one (one diff).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="With --fix: show the diff, write nothing.")] = False,
    yes: YesOption = False,
    no_input: NoInputOption = False,
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            "--cache-dir",
            help="Where the audit's cache is kept: the audit of these paths is used again while nothing it read "
            "has changed. Default: the user's cache folder. Env: UNSAFE_DOCTOR_CACHE_DIR.",
            envvar=CACHE_VARIABLE,
            show_envvar=False,
            file_okay=False,
        ),
    ] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Audit again, and keep nothing.")] = False,
) -> int:
    """Find the globals of a framework that hold device tensors, and check that recovery covers each.

    Exit 0: every global covered (with --fix: once the fixes are written); 1: a global left
    uncovered or reset unsafely; 2: bad input.
    """
    from unsafe_doctor.adaptor.audit_fixes import plan_fixes, plan_fixes_per_holder
    from unsafe_doctor.audit.run import audit as run_audit
    from unsafe_doctor.cli import prompts
    from unsafe_doctor.report import audit as report

    if not paths:  # as the pre-commit hook runs it, at a repository's root
        say("no folder named and no source-roots in pyproject.toml's [tool.unsafe-doctor]: auditing the current folder")
        paths = [Path(".")]
    if dry_run and not fix:
        raise UsageError("--dry-run goes with --fix")
    if fix and output_format is not LocatedFormat.text:
        raise UsageError("--fix prints a diff: use it with --format text")
    started = time.perf_counter()
    # A bar at a terminal only: not in a log of stderr, nor while JSON or SARIF go to a pipe.
    shown = sys.stderr.isatty() and (output_format is LocatedFormat.text or sys.stdout.isatty())
    bar = stages_bar(shown=shown, labels=_STAGES)
    with bar as progress:
        result = run_audit(
            paths,
            adaptor=None if adaptor == "auto" else Path(adaptor),
            rule_paths=rules or (),
            progress=progress,
            choose_adaptor=prompts.adaptor_chooser(yes=yes, no_input=no_input, before_asking=bar.stop),
            cache=None if no_cache else cache_dir or _user_cache(),
        )
    if result.cache.use == "not stored":
        say(f"the audit was not cached: {result.cache.why}")
    adaptor_not_output(result.context.environment)  # read, and with --fix written
    elapsed = time.perf_counter() - started
    plan = plan_fixes(result) if fix else None  # refused before any output
    if output_format is LocatedFormat.json:
        print_json(report.audit_json(result))
    elif output_format is LocatedFormat.sarif:
        print_json(report.audit_sarif(result, plan_fixes_per_holder(result)))
    else:
        print_rich(report.audit_text(result, elapsed, None if fix else _with_fix(paths, adaptor, rules or (), result)))
    left = len(result.uncovered)
    if plan is not None:
        left -= len(_write_fixes(result, plan, dry_run=dry_run, yes=yes, no_input=no_input))
    return 1 if left else 0


def _with_fix(paths: list[Path], adaptor: str, rules: Sequence[Path], result: Audit) -> NextStep:
    """This audit again, with --fix: the command a report with fixes ends with. With no adaptor found,
    --fix alone would be refused: the command names one to give (ADAPTOR.py); one the person picked
    among several is named."""
    from unsafe_doctor.report.common import NextStep, printable

    words = ["unsafe-doctor", "audit", *map(str, paths)]
    found = result.context.environment.adaptor
    if adaptor != "auto" or found is None:
        words += ["--adaptor", "ADAPTOR.py" if adaptor == "auto" else adaptor]
    elif result.context.environment.adaptor_why == "given":  # picked at the terminal among several: not asked again
        words += ["--adaptor", str(found)]
    for path in rules:
        words += ["--rules", str(path)]
    return NextStep(printable(shlex.join([*words, "--fix"])))


def _user_cache() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("unsafe-doctor"))


_STAGES = {"reading": "reading files", "scanning": "scanning files", "judging": "judging globals"}


def _write_fixes(result: Audit, plan: Plan, *, dry_run: bool, yes: bool, no_input: bool) -> tuple[AuditedHolder, ...]:
    """The audit's fixes as one diff, applied like `fix` does; the holders whose fix was written."""
    from unsafe_doctor.cli.workflow import write_if_accepted

    fixable = result.fixable
    if not fixable:
        say("no uncovered global has a fix to write")
        return ()
    show_plan(plan, len(fixable), revert=False)
    interactive = not no_input and sys.stdin.isatty() and sys.stdout.isatty()
    written = write_if_accepted(plan, dry_run=dry_run, yes=yes, interactive=interactive)
    tell_outcome(plan, written, dry_run=dry_run, interactive=interactive)
    return fixable if written else ()
