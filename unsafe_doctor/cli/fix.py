"""`unsafe-doctor fix`: each finding's fix written into the recovery adaptor, diff first; or every fix block taken out."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from unsafe_doctor.cli.options import (
    AdaptorOption,
    DryRunOption,
    Format,
    FormatOption,
    FunctionOption,
    LogOnlyOption,
    LogsArgument,
    NoInputOption,
    ParameterOption,
    ProfileOption,
    RulesOption,
    SourceRootOption,
    SuspectOption,
    YesOption,
)
from unsafe_doctor.cli.streams import adaptor_not_output, log_paths, print_diff, print_json, say, say_adaptor, warn_skipped
from unsafe_doctor.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from unsafe_doctor.adaptor.plan import Plan
    from unsafe_doctor.adaptor.write import Written
    from unsafe_doctor.diagnose.pipeline import DiagnosedFinding
    from unsafe_doctor.report.common import NextStep


def fix_command(
    logs: LogsArgument = None,
    *,
    adaptor: AdaptorOption = None,
    function: FunctionOption = None,
    parameter: ParameterOption = None,
    profile: ProfileOption = None,
    dry_run: DryRunOption = False,
    revert: Annotated[
        bool, typer.Option("--revert", help="Remove every fix block unsafe-doctor wrote into the adaptor (not the sentinel's).")
    ] = False,
    suspect: SuspectOption = None,
    yes: YesOption = False,
    no_input: NoInputOption = False,
    source_root: SourceRootOption = None,
    log_only: LogOnlyOption = False,
    rules: RulesOption = None,
    output_format: FormatOption = Format.text,
) -> int:
    """Write the fix for each finding into the recovery adaptor: diff first, then apply.

    Exit 0: written, nothing to do, or --dry-run; 1: a fix left unwritten; 2: refused.
    """
    from unsafe_doctor.adaptor.overrides import function_overrides, parameter_roles
    from unsafe_doctor.adaptor.plan import plan_fix, plan_revert
    from unsafe_doctor.cli import prompts
    from unsafe_doctor.cli.workflow import Invocation, write_if_accepted
    from unsafe_doctor.diagnose.pipeline import diagnose
    from unsafe_doctor.knowledge.context import groundwork
    from unsafe_doctor.report import fix as report
    from unsafe_doctor.report.common import counted

    overrides = function_overrides(function or [])
    roles = parameter_roles(parameter or [])
    setup = groundwork(
        rules or (),
        source_root or (),
        log_only=log_only,
        profile=profile,
        choose_adaptor=prompts.adaptor_chooser(yes=yes, no_input=no_input),
    )
    paths: list[str] = []
    chosen: Sequence[DiagnosedFinding] = ()
    if revert:
        if logs or suspect:
            raise UsageError("--revert takes no logs or suspects: it removes every unsafe-doctor fix block from the adaptor")
        environment = setup.detect(adaptor=adaptor).environment
        adaptor_not_output(environment)
        plan = plan_revert(environment)
        findings = 0
    else:
        paths = log_paths(logs)
        diagnosis = diagnose(paths, setup, adaptor=adaptor)
        warn_skipped(diagnosis.skipped)
        environment = diagnosis.context.environment
        adaptor_not_output(environment)
        chosen = diagnosis.chosen_suspects(suspect or ())
        plan = plan_fix([*diagnosis.findings, *chosen], diagnosis.context, overrides, roles)
        findings = len(diagnosis.findings) + len(chosen)
        if diagnosis.untraced and diagnosis.untraced.shortlist.suspects and not chosen and output_format is Format.text:
            suspects = counted(len(diagnosis.untraced.shortlist.suspects), "suspect")
            say(
                f"{suspects} for the error logged without a traceback: "
                "choose whose fix to write with --suspect N (diagnose lists them)"
            )
    text = output_format is Format.text
    interactive = text and not no_input and sys.stdout.isatty()  # asked at /dev/tty: stdin may be the log
    say_adaptor(environment)
    if text:
        show_plan(plan, findings, revert=revert)
    written = write_if_accepted(plan, dry_run=dry_run, yes=yes, interactive=interactive)
    if text:
        options = [
            *(("--revert",) if revert else ()),
            *repeated("--function", function),
            *repeated("--parameter", parameter),
            *(("--profile", profile) if profile else ()),
            *suspect_options(chosen),
        ]
        invocation = Invocation(paths, source_root or (), rules or (), log_only)
        apply = invocation.command("fix", environment.adaptor, *options, "--yes", log=not revert)
        tell_outcome(plan, written, dry_run=dry_run, interactive=interactive, apply=apply)
    else:
        print_document(report.fix_json(plan, written, dry_run=dry_run), written)
    unapplied = bool(plan.edits) and not written
    return 0 if dry_run or not (unapplied or plan.skipped) else 1


def print_document(document: dict[str, Any], written: tuple[Written, ...]) -> None:
    """The JSON report on stdout; when stdout cannot take it (a full disk), stderr says so and what
    was written: the exit code stays the write's, not the printing's."""
    from unsafe_doctor.report.fix import written_lines

    try:
        print_json(document)
    except UsageError as error:  # streams: the report could not be written
        say(str(error))
        for line in written_lines(written):
            say(line)


def show_plan(plan: Plan, findings: int, *, revert: bool) -> None:
    """The diff on stdout (it can be saved as a patch), what was decided on stderr."""
    from unsafe_doctor.report.fix import decisions

    print_diff(plan.diff())
    for line in decisions(plan, findings, revert=revert):
        say(line)


def tell_outcome(
    plan: Plan, written: tuple[Written, ...], *, dry_run: bool, interactive: bool, apply: NextStep | None = None
) -> None:
    from unsafe_doctor.report.fix import outcome

    for line in outcome(plan, written, dry_run=dry_run, interactive=interactive, apply=apply):
        say(line)


def repeated(option: str, values: list[str] | None) -> list[str]:
    return [word for value in values or () for word in (option, value)]


def suspect_options(chosen: Sequence[DiagnosedFinding]) -> list[str]:
    """`--suspect N` for each suspect chosen, once each as `Diagnosis.chosen_suspects` chose them."""
    return repeated("--suspect", [str(item.suspect) for item in chosen])
