"""The interactive path, diagnose -> fix -> verify, and the next step each report ends with.

After diagnose's report each finding's fix is shown as a diff and written on --yes or when the
person says so; a finding nothing classified is put to them first; a written fix is offered a
replay, and one closing line says what was done. An error logged without a traceback gets, at a
terminal, a suspect's fix (the person picks which) and the sentinel offered the same way.
Questions are asked through cli.prompts (the controlling terminal, so they work while the log
arrives on stdin). `fix` and `audit --fix` ask their one question here too. Every command
suggested is one that runs as printed: quoted, and with '-' for a log that came on stdin.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from unsafe_doctor.cli import prompts
from unsafe_doctor.cli.streams import print_diff, print_rich, say
from unsafe_doctor.diagnose.pipeline import DiagnosedFinding, Diagnosis
from unsafe_doctor.knowledge.classify import Classified, Unclassified, classify_as
from unsafe_doctor.knowledge.context import RunContext
from unsafe_doctor.knowledge.render.template import FixPlan
from unsafe_doctor.knowledge.rules import KnowledgeBase, Scenario
from unsafe_doctor.replay.quiet import framework_warnings_silenced
from unsafe_doctor.report.common import NextStep, counted, printable
from unsafe_doctor.report.fix import written_lines

if TYPE_CHECKING:
    from unsafe_doctor.adaptor.plan import Plan
    from unsafe_doctor.adaptor.write import Written
    from unsafe_doctor.diagnose.pipeline import Untraced

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


def offer_for_untraced(diagnosis: Diagnosis, invocation: Invocation, *, yes: bool, no_input: bool) -> None:
    """An error logged without a traceback. At a terminal, with the adaptor known: a suspect's fix
    (the person picks which) and the sentinel, each shown as a diff and written when the person says
    so. Elsewhere (and for what was declined): the commands that write them. --yes picks no suspect:
    which one it is, is a guess only the person may make."""
    untraced = diagnosis.untraced
    if untraced is None:
        return
    adaptor = diagnosis.context.environment.adaptor
    with prompts.terminal(ask=adaptor is not None and not (yes or no_input)) as terminal:
        if adaptor is not None and terminal is not None:
            if untraced.shortlist.suspects:
                _offer_suspect(diagnosis, untraced, invocation, adaptor, terminal)
            _offer_sentinel(diagnosis, invocation, adaptor, terminal)
        else:
            fixable = [
                number
                for number, suspect in enumerate(untraced.shortlist.suspects, 1)
                if isinstance(suspect.classification.fix, FixPlan)
            ]
            if fixable:  # the first suspect with a fix to write: the report says why the others have none
                number = str(fixable[0])
                say(
                    invocation.command("fix", adaptor or Path("ADAPTOR.py"), "--suspect", number).line(
                        f"to write suspect {number}'s fix"
                    )
                )
            where = "" if adaptor else " (name your recovery adaptor: no adaptor file is known here)"
            say(_install_sentinel(invocation, adaptor).line(f"to name the exact tensor at the next fault{where}"))
    say(
        "at the next fault the sentinel logs every global the recovery left unsafe before the first step reads it, "
        "and MindIO's own log (logs/ttp_log.log.<pid>, or stdout with TTP_LOG_STDOUT=1) holds the error's full "
        "traceback; run diagnose on those logs"
    )


def _install_sentinel(invocation: Invocation, adaptor: Path | None) -> NextStep:
    return invocation.command("sentinel install", adaptor or Path("ADAPTOR.py"), "--yes", log=False)


def _offer_suspect(
    diagnosis: Diagnosis, untraced: Untraced, invocation: Invocation, adaptor: Path, terminal: prompts.Terminal
) -> None:
    """The person picks a suspect (the only one: no question), sees its fix's diff, and says whether to write it."""
    from unsafe_doctor.adaptor.plan import plan_fix

    count = len(untraced.shortlist.suspects)
    number = 1
    if count > 1:
        choices = {str(choice) for choice in range(1, count + 1)}
        while (answer := terminal.answer(f"Which suspect's fix to write? [1-{count}/skip]: ").lower()) not in choices:
            if answer in ("", "skip"):
                say(invocation.command("fix", adaptor, "--suspect", "N").line("no suspect's fix written; to write suspect N's"))
                return
            terminal.tell(f"answer with a number from 1 to {count}, or skip (Enter)\n")
        number = int(answer)
    item = untraced.suspect_finding(number)
    fix = item.classification.fix
    if not isinstance(fix, FixPlan):
        say(printable(f"suspect {number}: {fix.reason if fix else item.classification.reason}"))
        return
    question = f"Apply suspect {number}'s scenario-{item.classification.scenario} fix to {_functions(adaptor, fix)}?"
    declined = invocation.command("fix", adaptor, "--suspect", str(number), "--yes")
    _offer_plan(plan_fix([item], diagnosis.context), question, declined, terminal, yes=False)


def _offer_sentinel(diagnosis: Diagnosis, invocation: Invocation, adaptor: Path, terminal: prompts.Terminal) -> None:
    """The sentinel's block, shown as a diff, and written into the rollback when the person says so."""
    from unsafe_doctor.adaptor.sentinel_install import plan_sentinel
    from unsafe_doctor.errors import UsageError
    from unsafe_doctor.report.sentinel import needs_line

    try:
        plan = plan_sentinel(diagnosis.context.environment, "report")
    except UsageError as refused:  # what `sentinel install` would say: the diagnosis stands
        say(f"no sentinel offered: {refused}")
        return
    if plan.edits:  # said before the question, as `sentinel install` says it
        say(needs_line("report"))
    files = ", ".join(dict.fromkeys(printable(str(edit.path)) for edit in plan.edits))
    question = f"Install the sentinel into {files} (it names the exact tensor at the next fault)?"
    _offer_plan(plan, question, _install_sentinel(invocation, adaptor), terminal, yes=False)


def _offer_plan(
    plan: Plan, question: str, declined: NextStep, terminal: prompts.Terminal | None, *, yes: bool
) -> tuple[Written, ...]:
    """A plan's diff, then written on --yes or when the person says so; what was written. Nothing to
    write (already there, or skipped): why, and no question."""
    from unsafe_doctor.adaptor.write import apply

    if not plan.edits:
        for line in (*plan.present, *map(str, plan.skipped), *plan.notes):
            say(printable(line))
        return ()
    print_diff(plan.diff())
    if not (yes or (terminal is not None and terminal.confirm(question))):
        say(declined.line("not applied; to apply"))
        return ()
    written = apply(plan)
    for line in written_lines(written):
        say(line)
    return written


@dataclass(frozen=True)
class Repair:
    """What diagnose did after its report: the findings whose fix it wrote, the files it wrote them
    into, and whether a replay proved those fixes (None: not replayed)."""

    fixed: tuple[DiagnosedFinding, ...] = ()
    files: tuple[Path, ...] = ()
    proven: bool | None = None

    def settles(self, diagnosis: Diagnosis) -> bool:
        """Every error of the log fixed and proven in this run: nothing left for an exit 1 to report."""
        untold = diagnosis.untraced_ranks or diagnosis.hits_not_parsed
        return bool(self.proven) and len(self.fixed) == len(diagnosis.findings) and not untold

    def summary(self, diagnosis: Diagnosis) -> str:
        """One closing line: what was fixed of the diagnosis's findings, where, and whether it is proven."""
        findings = len(diagnosis.findings)
        fixed = counted(findings, "finding")
        fixed = fixed if len(self.fixed) == findings else f"{len(self.fixed)} of {fixed}"
        files = ", ".join(printable(str(path)) for path in self.files)
        proof = {
            True: "proven by the replay above (verify)",
            False: "not proven: the replay above says why",
            None: "not proven: not replayed (verify, above)",
        }[self.proven]
        return f"done: {fixed} fixed in {files}, {proof}"


def offer_fixes(diagnosis: Diagnosis, invocation: Invocation, *, yes: bool, no_input: bool) -> Repair:
    """After the report: each finding's fix as a diff, applied on --yes or when the person says so;
    then, for the fixes written, a replay that proves them. Ends with what to run next, or with
    what was done."""
    if not diagnosis.findings:
        return Repair()
    adaptor = diagnosis.context.environment.adaptor
    if adaptor is None:
        if any(isinstance(item.classification.fix, FixPlan) for item in diagnosis.findings):
            missing = "no fix written: no recovery adaptor is known; " if yes else ""  # --yes asked for a write
            write = invocation.command("fix", Path("ADAPTOR.py"), "--yes")
            say(
                write.line(
                    f"{missing}to write the fix into your recovery adaptor (its file for ADAPTOR.py, or "
                    "--source-root DIR, the folder that holds it)"
                )
            )
        return Repair()
    with prompts.terminal(ask=not (yes or no_input)) as terminal:
        repair = _fix_each(diagnosis, invocation, adaptor, terminal, yes=yes)
        if not repair.fixed:
            return repair
        proven = None
        if yes or (terminal is not None and terminal.confirm(VERIFY_QUESTION)):
            proven = _verify_now(replace(diagnosis, findings=repair.fixed), diagnosis.context.knowledge, invocation, adaptor)
        else:
            say(invocation.command("verify", adaptor).line("to prove it"))
    repair = replace(repair, proven=proven)
    say(repair.summary(diagnosis))
    return repair


def _fix_each(
    diagnosis: Diagnosis, invocation: Invocation, adaptor: Path, terminal: prompts.Terminal | None, *, yes: bool
) -> Repair:
    """Each finding's fix shown, then written or not; the findings whose fix was written, and the files."""
    from unsafe_doctor.adaptor.plan import plan_fix  # loaded only when a fix is offered

    applied, files = [], []
    for item, fix in _fixable(diagnosis, terminal):
        question = f"Apply scenario-{item.classification.scenario} fix to {_functions(adaptor, fix)}?"
        declined = invocation.command("fix", adaptor, "--yes")
        written = _offer_plan(plan_fix([item], diagnosis.context), question, declined, terminal, yes=yes)
        if written:
            applied.append(item)
            files += [each.path for each in written]
    return Repair(tuple(applied), tuple(dict.fromkeys(files)))


def _fixable(diagnosis: Diagnosis, terminal: prompts.Terminal | None) -> list[tuple[DiagnosedFinding, FixPlan]]:
    """The findings with a fix, each with its fix; at a terminal, the person classifies those nothing classified."""
    fixable = []
    for item in diagnosis.findings:
        if isinstance(item.classification, Unclassified) and terminal is not None:
            item = _ask_scenario(terminal, item, diagnosis.context)
        if isinstance(item.classification, Classified) and isinstance(item.classification.fix, FixPlan):
            fixable.append((item, item.classification.fix))
    return fixable


def _functions(adaptor: Path, fix: FixPlan) -> str:
    """The adaptor functions a fix goes into, as its question names them: `adaptor.py::rollback`."""
    return printable(" and ".join(f"{adaptor}::{name}" for name in (fix.function, fix.peer_function) if name))


def write_if_accepted(plan: Plan, *, dry_run: bool, yes: bool, interactive: bool) -> tuple[Written, ...]:
    """`fix`, `sentinel install` and `audit --fix`: the plan written on --yes or when the person at the
    terminal accepts it (`-o` was checked against the adaptor's files when the adaptor became known)."""
    from unsafe_doctor.adaptor.write import apply

    if not plan.edits or dry_run:
        return ()
    if yes:
        return apply(plan)
    files = ", ".join(dict.fromkeys(printable(str(edit.path)) for edit in plan.edits))
    with prompts.terminal(ask=interactive) as terminal:
        if terminal is not None and terminal.confirm(f"Write this into {files}?"):
            return apply(plan)
    return ()


def _verify_now(diagnosis: Diagnosis, knowledge: KnowledgeBase, invocation: Invocation, adaptor: Path) -> bool | None:
    """The fixes written, replayed: whether every one was proven; None where no replay ran."""
    import importlib.util

    from unsafe_doctor.replay import verify as verification
    from unsafe_doctor.report.verification import verification_text

    if importlib.util.find_spec("torch") is None:
        say("not verified: verify replays on torch, which is not installed (pip install 'unsafe-doctor[replay]')")
        return None
    with framework_warnings_silenced():
        plan, skipped = verification.plan_replay(diagnosis, knowledge)
        outcome = verification.verify(plan, skipped)
    if outcome is None:
        return None
    print_rich(verification_text(outcome, write_fix=invocation.command("fix", adaptor, "--yes")))
    return outcome.exit_code == 0


def _ask_scenario(terminal: prompts.Terminal, item: DiagnosedFinding, context: RunContext) -> DiagnosedFinding:
    """Nothing classified this tensor: the person decides, with the evidence in front of them."""
    tensor = item.finding.tensor
    name = printable(tensor.name.variable or tensor.expression) if tensor else "the tensor"
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
        terminal.tell(f"{name}, scenario {scenario}: {printable(verdict.fix.reason)}\n")
    return replace(item, classification=verdict)
