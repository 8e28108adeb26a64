"""`unsafe-doctor diagnose` (also the command when none is named): the log's findings, then the fixes offered."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from unsafe_doctor.cli.options import (
    AdaptorOption,
    LocatedFormat,
    LocatedFormatOption,
    LogOnlyOption,
    LogsArgument,
    NoInputOption,
    RulesOption,
    SourceRootOption,
    VerboseOption,
    YesOption,
)
from unsafe_doctor.cli.streams import adaptor_not_output, log_paths, print_json, print_rich, progress_bar, warn_skipped

if TYPE_CHECKING:
    from unsafe_doctor.adaptor.plan import Preview
    from unsafe_doctor.diagnose.pipeline import Diagnosis


def diagnose_command(
    logs: LogsArgument = None,
    *,
    output_format: LocatedFormatOption = LocatedFormat.text,
    no_input: NoInputOption = False,
    yes: YesOption = False,
    source_root: SourceRootOption = None,
    log_only: LogOnlyOption = False,
    rules: RulesOption = None,
    adaptor: AdaptorOption = None,
    verbose: VerboseOption = False,
) -> int:
    """Find the unsafe-data errors in a failure log, the global tensor each one read, and the fix.

    Exit 0: no unsafe-data error in the log, or every one fixed and proven by this run (--yes, or y
    at the terminal); 1: one or more found and not all fixed and proven; 2: bad input.
    """
    from unsafe_doctor.cli import prompts
    from unsafe_doctor.cli.workflow import Invocation, offer_fixes, offer_for_untraced
    from unsafe_doctor.diagnose.pipeline import diagnose
    from unsafe_doctor.knowledge.context import groundwork
    from unsafe_doctor.report import diagnosis as report

    paths = log_paths(logs)
    started = time.perf_counter()
    # the bar is made once the rules load (a bad rule file is refused first), and stopped before a question
    choose_adaptor = prompts.adaptor_chooser(yes=yes, no_input=no_input, before_asking=lambda: bar.stop())
    setup = groundwork(rules or (), source_root or (), log_only=log_only, choose_adaptor=choose_adaptor)
    bar = progress_bar(paths)
    with bar as progress:
        diagnosis = diagnose(paths, setup, adaptor=adaptor, progress=progress)
        warn_skipped(diagnosis.skipped)
    adaptor_not_output(diagnosis.context.environment)
    elapsed = time.perf_counter() - started
    if output_format is LocatedFormat.json:
        print_json(report.diagnosis_json(diagnosis))
    elif output_format is LocatedFormat.sarif:
        print_json(report.diagnosis_sarif(diagnosis))
    else:
        from unsafe_doctor.report.diagnosis_text import diagnosis_text  # rich loads when a report is rendered

        print_rich(diagnosis_text(diagnosis, elapsed, _previews(diagnosis), verbose=verbose))
        invocation = Invocation(paths, source_root or (), rules or (), log_only)
        repair = offer_fixes(diagnosis, invocation, yes=yes, no_input=no_input)
        offer_for_untraced(diagnosis, invocation, yes=yes, no_input=no_input)
        if repair.settles(diagnosis):
            return 0
    return 1 if diagnosis.findings or diagnosis.hits else 0


def _previews(diagnosis: Diagnosis) -> list[tuple[Preview, ...]]:
    """Each finding's fix blocks as `fix` writes them; the adaptor code is loaded only when a finding has one."""
    from unsafe_doctor.knowledge.classify import Classified
    from unsafe_doctor.knowledge.render.template import FixPlan

    if not any(
        isinstance(item.classification, Classified) and isinstance(item.classification.fix, FixPlan)
        for item in diagnosis.findings
    ):
        return []
    from unsafe_doctor.adaptor.plan import preview

    return [preview(item, diagnosis.context) for item in diagnosis.findings]
