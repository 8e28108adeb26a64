"""The interactive path, diagnose -> fix -> verify, and the next step each report ends with.

After diagnose's report each finding's fix is shown as a diff and written on --yes or when the
person says so; a finding nothing classified is put to them first; a written fix is offered a
replay. Questions are asked through cli.prompts (the controlling terminal, so they work while the
log arrives on stdin). `fix` and `audit --fix` ask their one question here too. Every command
suggested is one that runs as printed: quoted, and with '-' for a log that came on stdin.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from unsafe_doctor.cli import prompts
from unsafe_doctor.cli.streams import output_not_over, print_diff, print_rich, say
from unsafe_doctor.diagnose.pipeline import DiagnosedFinding, Diagnosis
from unsafe_doctor.knowledge.classify import Classified, FixPlan, Unclassified, classify_as
from unsafe_doctor.knowledge.context import RunContext
from unsafe_doctor.knowledge.rules import KnowledgeBase, Scenario
from unsafe_doctor.replay.quiet import framework_warnings_silenced
from unsafe_doctor.report.common import NextStep, printable
from unsafe_doctor.report.fix import written_lines

if TYPE_CHECKING:
    from unsafe_doctor.adaptor.fix import Plan, Written

VERIFY_QUESTION = "Verify the fix now (replay the fault and the recovery on 4 ranks, unpatched then patched)?"


@dataclass(frozen=True)
class Invocation:
    """What the person gave this run, to be given again to the command suggested next."""

    paths: Sequence[str]  # empty: the log came on stdin
    source_roots: Sequence[Path] = ()
    rules: Sequence[Path] = ()
    log_only: bool = False

    def command(self, name: str, adaptor: Path | None, *extra: str, log: bool = True) -> NextStep:
        """`unsafe-doctor NAME ...` with this run's log and options (`log`: the command reads a log;
        `fix --revert` and `sentinel install` do not); a log that came on stdin is '-' there too."""
        words = ["unsafe-doctor", *name.split(), *((self.paths or ["-"]) if log else [])]
        for root in self.source_roots:
            words += ["--source-root", str(root)]
        for path in self.rules:
            words += ["--rules", str(path)]
        words += ["--log-only"] if self.log_only else []
        words += ["--adaptor", str(adaptor)] if adaptor is not None else []
        piped = log and (not self.paths or "-" in self.paths)
        return NextStep(printable(shlex.join([*words, *extra])), piped)


def suggest_for_untraced(diagnosis: Diagnosis, invocation: Invocation) -> None:
    """An error logged without a traceback: the commands that write a suspect's fix, and that name
    the exact tensor at the next fault (the sentinel and the traceback keeper, into the adaptor)."""
    untraced = diagnosis.untraced
    if untraced is None:
        return
    adaptor = diagnosis.context.environment.adaptor
    if untraced.shortlist.suspects:
        say(invocation.command("fix", adaptor or Path("ADAPTOR.py"), "--suspect", "1").line("to write suspect 1's fix"))
    install = invocation.command("sentinel install", adaptor or Path("ADAPTOR.py"), "--yes", log=False)
    where = "" if adaptor else " (name your recovery adaptor: no adaptor file is known here)"
    say(install.line(f"to name the exact tensor at the next fault{where}"))
    say(
        "at the next fault the sentinel logs every global the recovery left unsafe before the first step reads it, "
        "and MindIO's own log (logs/ttp_log.log.<pid>, or stdout with TTP_LOG_STDOUT=1) holds the error's full "
        "traceback; run diagnose on those logs"
    )


def offer_fixes(diagnosis: Diagnosis, invocation: Invocation, *, yes: bool, no_input: bool) -> None:
    """After the report: each finding's fix as a diff, applied on --yes or when the person says so;
    then, for the fixes written, a replay that proves them. Ends with what to run next."""
    if not diagnosis.findings:
        return
    adaptor = diagnosis.context.environment.adaptor
    if adaptor is None:
        if any(isinstance(item.classification.fix, FixPlan) for item in diagnosis.findings):
            say("no fix written: no recovery adaptor is known; name it (--adaptor FILE) or the folder that holds it "
                f"(--source-root DIR), {invocation.command('fix', Path('ADAPTOR.py'), '--yes').line('e.g.')}")
        return
    with prompts.terminal(ask=not (yes or no_input)) as terminal:
        applied = _fix_each(diagnosis, invocation, adaptor, terminal, yes=yes)
        if applied:
            if yes or (terminal is not None and terminal.confirm(VERIFY_QUESTION)):
                _verify_now(replace(diagnosis, findings=tuple(applied)), diagnosis.context.knowledge, invocation, adaptor)
            else:
                say(invocation.command("verify", adaptor).line("to prove it"))


def _fix_each(
    diagnosis: Diagnosis, invocation: Invocation, adaptor: Path, terminal: prompts.Terminal | None, *, yes: bool
) -> list[DiagnosedFinding]:
    """Each finding's fix shown, then written or not; the findings whose fix was written."""
    from unsafe_doctor.adaptor import fix as fixes  # loaded only when a fix is offered

    applied = []
    for item, fix in _fixable(diagnosis, terminal):
        plan = fixes.plan_fix([item], diagnosis.context)
        if not plan.edits:
            for line in (*plan.present, *map(str, plan.skipped), *plan.notes):
                say(printable(line))
            continue
        print_diff(plan.diff())
        functions = " and ".join(f"{adaptor}::{name}" for name in (fix.function, fix.peer_function) if name)
        question = f"Apply scenario-{item.classification.scenario} fix to {printable(functions)}?"
        if yes or (terminal is not None and terminal.confirm(question)):
            for line in written_lines(fixes.apply(plan)):
                say(line)
            applied.append(item)
        else:
            say(invocation.command("fix", adaptor, "--yes").line("not applied; to apply"))
    return applied


def _fixable(diagnosis: Diagnosis, terminal: prompts.Terminal | None) -> list[tuple[DiagnosedFinding, FixPlan]]:
    """The findings with a fix, each with its fix; at a terminal, the person classifies those nothing classified."""
    fixable = []
    for item in diagnosis.findings:
        if isinstance(item.classification, Unclassified) and terminal is not None:
            item = _ask_scenario(terminal, item, diagnosis.context)
        if isinstance(item.classification, Classified) and isinstance(item.classification.fix, FixPlan):
            fixable.append((item, item.classification.fix))
    return fixable


def write_if_accepted(plan: Plan, *, dry_run: bool, yes: bool, interactive: bool) -> tuple[Written, ...]:
    """`fix` and `audit --fix`: the plan written on --yes or when the person at the terminal accepts it."""
    from unsafe_doctor.adaptor import fix as fixes

    if not plan.edits or dry_run:
        return ()
    output_not_over([edit.path for edit in plan.edits])
    if yes:
        return fixes.apply(plan)
    files = ", ".join(dict.fromkeys(printable(str(edit.path)) for edit in plan.edits))
    with prompts.terminal(ask=interactive) as terminal:
        if terminal is not None and terminal.confirm(f"Write this into {files}?"):
            return fixes.apply(plan)
    return ()


def _verify_now(diagnosis: Diagnosis, knowledge: KnowledgeBase, invocation: Invocation, adaptor: Path) -> None:
    import importlib.util

    from unsafe_doctor.replay import verify as verification
    from unsafe_doctor.report.verification import to_text

    if importlib.util.find_spec("torch") is None:
        say("not verified: verify replays on torch, which is not installed (pip install 'unsafe-doctor[replay]')")
        return
    with framework_warnings_silenced():
        plan, skipped = verification.plan_replay(diagnosis, knowledge)
        outcome = verification.verify(plan, skipped)
    if outcome is not None:
        print_rich(to_text(outcome, write_fix=invocation.command("fix", adaptor, "--yes")))


def _ask_scenario(terminal: prompts.Terminal, item: DiagnosedFinding, context: RunContext) -> DiagnosedFinding:
    """Nothing classified this tensor: the person decides, with the evidence in front of them."""
    tensor = item.finding.tensor
    name = printable(tensor.variable or tensor.expression) if tensor else "the tensor"
    terminal.tell(f"\n{name} is unclassified: {printable(item.classification.reason)}\n")
    for line in item.classification.evidence:
        terminal.tell(f"  {printable(str(line))}\n")
    terminal.tell(
        f"Does {name} depend on training iterations?\n"
        "  1 = no: re-initialise it in rollback; 2 = yes: copy it from the replica in repair; Enter = skip\n"
    )
    answer = terminal.answer("Scenario [1/2/skip]: ")
    if answer not in ("1", "2"):
        terminal.tell(f"skipped: no fix for {name}\n")
        return item
    scenario: Scenario = 1 if answer == "1" else 2
    verdict = classify_as(item.subject, scenario, context, item.classification.evidence)
    if not isinstance(verdict.fix, FixPlan):
        terminal.tell(f"no fix for {name} in scenario {scenario}: {printable(verdict.fix.reason)}\n")
    return replace(item, classification=verdict)
