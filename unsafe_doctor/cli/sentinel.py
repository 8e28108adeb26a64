"""`unsafe-doctor sentinel install`: the sentinel's call written into the rollback function, diff first; or taken out."""

from __future__ import annotations

import sys
from typing import Annotated, cast

import click
import typer

from unsafe_doctor.cli.conventions import reporting
from unsafe_doctor.cli.fix import print_document, repeated
from unsafe_doctor.cli.options import (
    AdaptorOption,
    DryRunOption,
    Format,
    FormatOption,
    FunctionOption,
    NoInputOption,
    ParameterOption,
    RulesOption,
    SourceRootOption,
    YesOption,
    examples,
)
from unsafe_doctor.cli.streams import adaptor_not_output, print_diff, say, say_adaptor
from unsafe_doctor.log.sentinel_modes import MODES, SentinelMode

app = typer.Typer(
    help="Install the sentinel: a check at the end of the rollback that names every tensor the recovery left unsafe.",
    no_args_is_help=True,
    suggest_commands=False,
)


def install(
    *,
    adaptor: AdaptorOption = None,
    source_root: SourceRootOption = None,
    rules: RulesOption = None,
    function: FunctionOption = None,
    parameter: ParameterOption = None,
    mode: Annotated[
        str,
        typer.Option(
            "--mode",
            click_type=click.Choice(MODES),
            help="report: log every unsafe tensor and go on; raise: stop the recovery, naming them all; "
            "heal: also copy scenario-2 globals from the replica in the repair, re-initialise scenario-1 ones, then check again.",
        ),
    ] = "report",
    dry_run: DryRunOption = False,
    revert: Annotated[
        bool, typer.Option("--revert", help="Remove the sentinel's blocks (fix --revert leaves them; this leaves the fixes).")
    ] = False,
    yes: YesOption = False,
    no_input: NoInputOption = False,
    output_format: FormatOption = Format.text,
) -> int:
    """Write the sentinel's call at the end of the adaptor's rollback function: diff first, then apply.

    Exit 0: written, already there, or --dry-run; 1: not applied; 2: refused.
    """
    from unsafe_doctor.adaptor.overrides import function_overrides, parameter_roles
    from unsafe_doctor.adaptor.plan import plan_revert
    from unsafe_doctor.adaptor.sentinel_install import plan_sentinel
    from unsafe_doctor.cli import prompts
    from unsafe_doctor.cli.workflow import Invocation, write_if_accepted
    from unsafe_doctor.knowledge.context import groundwork
    from unsafe_doctor.report import fix as fix_report
    from unsafe_doctor.report import sentinel as report

    overrides = function_overrides(function or [])
    roles = parameter_roles(parameter or [])
    chooser = prompts.adaptor_chooser(yes=yes, no_input=no_input)
    environment = groundwork(rules or (), source_root or (), choose_adaptor=chooser).detect(adaptor=adaptor).environment
    adaptor_not_output(environment)
    if revert:
        plan = plan_revert(environment, sentinel=True)
    else:
        plan = plan_sentinel(environment, cast(SentinelMode, mode), overrides, roles, rules or ())
    text = output_format is Format.text
    interactive = text and not no_input and sys.stdout.isatty()
    say_adaptor(environment)
    if text:
        print_diff(plan.diff())
        for line in fix_report.plan_lines(plan):
            say(line)
        if plan.edits and not revert:
            say(report.needs_line(cast(SentinelMode, mode)))
    written = write_if_accepted(plan, dry_run=dry_run, yes=yes, interactive=interactive)
    if text:
        options = ["--revert"] if revert else ["--mode", mode]
        options += [*repeated("--function", function), *repeated("--parameter", parameter)]
        apply = Invocation((), source_root or (), rules or ()).command(
            "sentinel install", environment.adaptor, *options, "--yes", log=False
        )
        done = "nothing to do: the sentinel is installed already"
        for line in fix_report.outcome(plan, written, dry_run=dry_run, interactive=interactive, apply=apply, done=done):
            say(line)
    else:
        print_document(
            report.sentinel_json(plan, written, dry_run=dry_run, mode=None if revert else cast(SentinelMode, mode)), written
        )
    return 0 if dry_run or not plan.edits or written else 1


app.command("install", epilog=examples("sentinel install"))(reporting(install))
