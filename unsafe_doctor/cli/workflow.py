"""The interactive path, diagnose -> fix -> verify, and every question it asks.

After diagnose's report each finding's fix is shown as a diff and written on --yes or when the
person says so; a finding nothing classified is put to them first; a written fix is offered a
replay. Questions go to the controlling terminal (/dev/tty), so they work while the log arrives
on stdin. `fix` and `audit --fix` ask their one question here too.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import typer

from unsafe_doctor.classify import Classified, FixPlan, Unclassified, classify_as
from unsafe_doctor.cli.streams import print_rich, say
from unsafe_doctor.context import RunContext
from unsafe_doctor.diagnosis import DiagnosedFinding, Diagnosis
from unsafe_doctor.knowledge import KnowledgeBase, Scenario
from unsafe_doctor.report.fix import written_lines

if TYPE_CHECKING:
    from unsafe_doctor.fix import Plan, Written

VERIFY_QUESTION = "Verify the fix now (replay the fault and the recovery on 4 ranks, unpatched then patched)?"


def offer_fixes(
    diagnosis: Diagnosis,
    paths: list[str],
    source_roots: Sequence[Path],
    rules: Sequence[Path],
    *,
    yes: bool,
    no_input: bool,
) -> None:
    """After the report: each finding's fix as a diff, applied on --yes or when the person says so;
    then, for the fixes written, a replay that proves them."""
    adaptor = diagnosis.context.environment.adaptor
    if adaptor is None or not diagnosis.findings:
        return
    terminal = None if yes or no_input or not sys.stdout.isatty() else _controlling_terminal()
    knowledge = diagnosis.context.knowledge
    fixable = _fixable(diagnosis, terminal)
    from unsafe_doctor import fix as fixes  # libcst is loaded only when a fix is offered

    options = [*paths, *(f"--source-root {root}" for root in source_roots), *(f"--rules {path}" for path in rules)]
    options += ["--log-only"] if diagnosis.context.workspace.log_only else []
    applied = []
    for item, fix in fixable:
        plan = fixes.plan_fix([item], diagnosis.context)
        if not plan.edits:
            continue
        sys.stdout.write(plan.diff())
        question = f"Apply scenario-{item.classification.scenario} fix to {adaptor}::{fix.function}?"
        if yes or (terminal is not None and _ask(terminal, question)):
            for line in written_lines(fixes.apply(plan)):
                say(line)
            applied.append(item)
        elif terminal is None:
            say(f"not applied; to apply: unsafe-doctor fix {' '.join(options)} --adaptor {adaptor} --yes")
    if applied:
        if yes or (terminal is not None and _ask(terminal, VERIFY_QUESTION)):
            _verify_now(replace(diagnosis, findings=tuple(applied)), knowledge)
        else:
            say(f"to prove it: unsafe-doctor verify {' '.join(options)} --adaptor {adaptor}")
    if terminal is not None:
        terminal.close()


def _fixable(diagnosis: Diagnosis, terminal: TextIO | None) -> list[tuple[DiagnosedFinding, FixPlan]]:
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
    from unsafe_doctor import fix as fixes

    if plan.edits and not dry_run and (yes or (interactive and typer.confirm("Apply?", default=False))):
        return fixes.apply(plan)
    return ()


def _verify_now(diagnosis: Diagnosis, knowledge: KnowledgeBase) -> None:
    import importlib.util

    from unsafe_doctor import verify as verification
    from unsafe_doctor.report.verification import to_text

    if importlib.util.find_spec("torch") is None:
        say("not verified: verify replays on torch, which is not installed (pip install 'unsafe-doctor[replay]')")
        return
    plan, skipped = verification.plan_replay(diagnosis, knowledge)
    outcome = verification.verify(plan, skipped)
    if outcome is not None:
        print_rich(to_text(outcome))


def _ask_scenario(terminal: TextIO, item: DiagnosedFinding, context: RunContext) -> DiagnosedFinding:
    """Nothing classified this tensor: the person decides, with the evidence in front of them."""
    tensor = item.finding.tensor
    name = (tensor.variable or tensor.expression) if tensor else "the tensor"
    terminal.write(f"\n{name} is unclassified: {item.classification.reason}\n")
    for line in item.classification.evidence:
        terminal.write(f"  {line}\n")
    terminal.write(
        f"Does {name} depend on training iterations?\n"
        "  1 = no: re-initialise it in rollback; 2 = yes: copy it from the replica in repair; Enter = skip\n"
        "Scenario [1/2/skip]: "
    )
    answer = terminal.readline().strip()
    if answer not in ("1", "2"):
        return item
    scenario: Scenario = 1 if answer == "1" else 2
    verdict = classify_as(item.subject, scenario, context, item.classification.evidence)
    return replace(item, classification=verdict)


def _controlling_terminal() -> TextIO | None:
    """The terminal itself, for reading answers: a tty is not seekable, so no buffered r+ mode."""
    try:
        return io.TextIOWrapper(open("/dev/tty", "r+b", buffering=0), encoding="utf-8", write_through=True)
    except OSError:
        return None


def _ask(terminal: TextIO, question: str) -> bool:
    terminal.write(f"{question} [y/N] ")
    return terminal.readline().strip().lower() in ("y", "yes")
