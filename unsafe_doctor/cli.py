"""Command line: parse options, call the core, render. No diagnosis logic lives here."""

from __future__ import annotations

import io
import json
import os
import sys
import time
from enum import Enum
from pathlib import Path
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any, TextIO

import click
import typer
from rich.console import Console

from unsafe_doctor import __version__, inputs, report
from unsafe_doctor.classify import Classified, FixPlan, Unclassified, classify_as
from unsafe_doctor.context import RunContext, groundwork
from unsafe_doctor.diagnosis import DiagnosedFinding, Diagnosis
from unsafe_doctor.diagnosis import diagnose as run_diagnosis
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge import KnowledgeBase, load_knowledge, validate_files

if TYPE_CHECKING:
    from unsafe_doctor.fix import Plan, Written

PROGRESS_FROM = 50 << 20  # inputs smaller than this finish before a bar would be worth drawing

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Find, explain and fix the global tensor that MindIO recovery left unsafe.",
)


class OutputFormat(str, Enum):
    text = "text"
    json = "json"
    sarif = "sarif"


class ReplayMode(str, Enum):
    block = "block"
    adaptor = "adaptor"


FormatOption = Annotated[OutputFormat, typer.Option("--format", "-f", help="text for people, json or sarif for tools.")]
NoInputOption = Annotated[bool, typer.Option("--no-input", help="Never ask questions.")]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="Accept every offer without asking.")]
SourceRootOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--source-root",
        help="Folder holding the training code or frameworks named in the log (repeatable).",
        exists=True,
        file_okay=False,
        dir_okay=True,
    ),
]
RulesOption = Annotated[
    list[Path] | None,
    typer.Option("--rules", help="Extra knowledge-base rule file or folder (repeatable).", exists=True),
]

AdaptorOption = Annotated[
    Path | None,
    typer.Option(
        "--adaptor",
        help="The recovery adaptor file (feature_rollback, send/recv_rank_repair); found under --source-root if not given.",
        exists=True,
        dir_okay=False,
    ),
]

FunctionOption = Annotated[
    list[str] | None,
    typer.Option(
        "--function",
        help="The adaptor's function for a role when its name differs from the profile's: "
        "rollback=NAME, send=NAME, recv=NAME (comma-separated or repeated).",
    ),
]

rules_app = typer.Typer(help="List, show and validate knowledge-base rules.", no_args_is_help=True)
app.add_typer(rules_app, name="rules")


@app.command()
def diagnose(
    logs: Annotated[
        list[str] | None,
        typer.Argument(help="Log files or folders (.gz too). None or '-': read standard input.", show_default=False),
    ] = None,
    output_format: FormatOption = OutputFormat.text,
    no_input: NoInputOption = False,
    yes: YesOption = False,
    source_root: SourceRootOption = None,
    rules: RulesOption = None,
    adaptor: AdaptorOption = None,
) -> None:
    """Find the unsafe-data errors in a failure log, the global tensor each one read, and the fix."""
    paths = logs or []
    if not paths and sys.stdin.isatty():
        raise UsageError("no input: name a log file or folder, or pipe a log in (see --help)")
    started = time.perf_counter()
    setup = groundwork(rules or (), source_root or ())
    with _progress_bar(paths) as progress:
        diagnosis = run_diagnosis(paths, setup, adaptor=adaptor, progress=progress)
    elapsed = time.perf_counter() - started
    if output_format is OutputFormat.json:
        _print_json(report.to_json(diagnosis))
    elif output_format is OutputFormat.sarif:
        _print_json(report.to_sarif(diagnosis))
    else:
        Console(highlight=False).print(report.to_text(diagnosis, elapsed))
        _offer_fixes(diagnosis, paths, source_root or (), rules or (), yes=yes, no_input=no_input)
    raise typer.Exit(1 if diagnosis.findings or diagnosis.hits else 0)


def _offer_fixes(
    diagnosis: Diagnosis,
    paths: list[str],
    source_roots: Sequence[Path],
    rules: Sequence[Path],
    *,
    yes: bool,
    no_input: bool,
) -> None:
    """After the report: each finding's fix as a diff, applied on --yes or when the person says so.

    Questions go to the controlling terminal, so they work while the log arrives on stdin.
    """
    adaptor = diagnosis.context.environment.adaptor
    if adaptor is None or not diagnosis.findings:
        return
    terminal = None if yes or no_input or not sys.stdout.isatty() else _controlling_terminal()
    fixable = []
    for item in diagnosis.findings:
        if isinstance(item.classification, Unclassified) and terminal is not None:
            item = _ask_scenario(terminal, item, diagnosis.context)
        if isinstance(item.classification, Classified) and isinstance(item.classification.fix, FixPlan):
            fixable.append((item, item.classification.fix))
    from unsafe_doctor import fix as fixes  # libcst is loaded only when a fix is offered

    options = [*paths, *(f"--source-root {root}" for root in source_roots), *(f"--rules {path}" for path in rules)]
    applied = []
    for item, fix in fixable:
        plan = fixes.plan_fix([item], diagnosis.context)
        if not plan.edits:
            continue
        sys.stdout.write(plan.diff())
        question = f"Apply scenario-{item.classification.scenario} fix to {adaptor}::{fix.function}?"
        if yes or (terminal is not None and _ask(terminal, question)):
            for written in fixes.apply(plan):
                _say(f"wrote {written.path} (backup: {written.backup})")
            applied.append(item)
        elif terminal is None:
            _say(f"not applied; to apply: unsafe-doctor fix {' '.join(options)} --adaptor {adaptor} --yes")
    if applied:
        question = "Verify the fix now (replay the fault and the recovery on 4 ranks, unpatched then patched)?"
        if yes or (terminal is not None and _ask(terminal, question)):
            _verify_now(replace(diagnosis, findings=tuple(applied)), diagnosis.context.knowledge)
        else:
            _say(f"to prove it: unsafe-doctor verify {' '.join(options)} --adaptor {adaptor}")
    if terminal is not None:
        terminal.close()


def _verify_now(diagnosis: Diagnosis, knowledge: KnowledgeBase) -> None:
    import importlib.util

    from unsafe_doctor import verify as verification

    if importlib.util.find_spec("torch") is None:
        _say("not verified: verify replays on torch, which is not installed (pip install 'unsafe-doctor[replay]')")
        return
    plan, skipped = verification.plan_replay(diagnosis, knowledge)
    outcome = verification.verify(plan, skipped)
    if outcome is not None:
        Console(highlight=False).print(report.verification_text(outcome))


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
    scenario = int(answer)
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


@app.command()
def fix(
    logs: Annotated[
        list[str] | None,
        typer.Argument(help="Log files or folders (.gz too). None or '-': read standard input.", show_default=False),
    ] = None,
    adaptor: AdaptorOption = None,
    function: FunctionOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the diff; write nothing.")] = False,
    revert: Annotated[bool, typer.Option("--revert", help="Remove every block unsafe-doctor wrote into the adaptor.")] = False,
    yes: YesOption = False,
    no_input: NoInputOption = False,
    source_root: SourceRootOption = None,
    rules: RulesOption = None,
    output_format: FormatOption = OutputFormat.text,
) -> None:
    """Write the fix for each finding into the recovery adaptor: diff first, then apply.

    Exit 0: written, nothing to do, or --dry-run; 1: a fix left unwritten; 2: refused.
    """
    from unsafe_doctor import fix as fixes  # libcst takes a second to load: diagnose does without it

    if output_format is OutputFormat.sarif:
        raise UsageError("fix writes text or json (--format sarif is for diagnose)")
    overrides = fixes.function_overrides(function or [])
    setup = groundwork(rules or (), source_root or ())
    if revert:
        if logs:
            raise UsageError("--revert takes no logs: it removes every unsafe-doctor block from the adaptor")
        plan = fixes.plan_revert(setup.detect(adaptor=adaptor).environment)
        findings = 0
    else:
        paths = logs or []
        if not paths and sys.stdin.isatty():
            raise UsageError("no input: name a log file or folder, or pipe a log in (see --help)")
        diagnosis = run_diagnosis(paths, setup, adaptor=adaptor)
        plan = fixes.plan_fix(diagnosis.findings, diagnosis.context, overrides)
        findings = len(diagnosis.findings)
    interactive = output_format is OutputFormat.text and not no_input and sys.stdin.isatty() and sys.stdout.isatty()
    if output_format is OutputFormat.text:
        _show_plan(plan, findings, revert)
    written: tuple[Written, ...] = ()
    if plan.edits and not dry_run and (yes or (interactive and typer.confirm("Apply?", default=False))):
        written = fixes.apply(plan)
    if output_format is OutputFormat.json:
        _print_json(_fix_json(plan, written, dry_run))
    else:
        _tell_outcome(plan, written, dry_run, interactive)
    unapplied = bool(plan.edits) and not written
    raise typer.Exit(0 if dry_run or not (unapplied or plan.skipped) else 1)


def _show_plan(plan: Plan, findings: int, revert: bool) -> None:
    """The diff on stdout (it can be saved as a patch), what was decided on stderr."""
    if not revert and not findings:
        _say("no unsafe-data finding in the log: nothing to fix")
    sys.stdout.write(plan.diff())
    sys.stdout.flush()
    for line in (*(change for edit in plan.edits for change in edit.changes), *plan.present, *plan.skipped, *plan.notes):
        _say(line)


def _tell_outcome(plan: Plan, written: tuple[Written, ...], dry_run: bool, interactive: bool) -> None:
    for item in written:
        _say(f"wrote {item.path} (backup: {item.backup})")
    if not plan.edits:
        if plan.present and not plan.skipped:
            _say("nothing to do: the adaptor already holds every fix")
    elif dry_run:
        _say("dry run: nothing written")
    elif not written and interactive:
        _say("not applied")
    elif not written:
        _say("not applied: nothing is asked without a terminal or with --no-input; run again with --yes to apply")


def _fix_json(plan: Plan, written: tuple[Written, ...], dry_run: bool) -> dict[str, Any]:
    return {
        "schema": "unsafe-doctor/fix/v1",
        "files": [{"path": str(edit.path), "changes": list(edit.changes), "diff": edit.diff()} for edit in plan.edits],
        "present": list(plan.present),
        "skipped": [str(item) for item in plan.skipped],
        "notes": list(plan.notes),
        "dry_run": dry_run,
        "written": [{"path": str(item.path), "backup": str(item.backup)} for item in written],
    }


if TYPE_CHECKING:
    from unsafe_doctor.audit import Audit, AuditedHolder


@app.command()
def audit(
    paths: Annotated[list[Path], typer.Argument(help="Framework source folders or files to scan.", show_default=False)],
    adaptor: Annotated[
        str,
        typer.Option(
            "--adaptor",
            help="The recovery adaptor file, or auto: found under the paths by its profile's file names, "
            "else the audited module that defines the profile's rollback and repair functions.",
        ),
    ] = "auto",
    output_format: FormatOption = OutputFormat.text,
    rules: RulesOption = None,
    fix: Annotated[bool, typer.Option("--fix", help="Write the fix of every uncovered global that has one (one diff).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="With --fix: show the diff, write nothing.")] = False,
    yes: YesOption = False,
) -> None:
    """Find the globals of a framework that hold device tensors, and check that recovery covers each.

    Exit 0: every global covered (with --fix: once the fixes are written); 1: a global left
    uncovered or reset unsafely; 2: bad input.
    """
    from unsafe_doctor import audit as audits

    if dry_run and not fix:
        raise UsageError("--dry-run goes with --fix")
    if fix and output_format is not OutputFormat.text:
        raise UsageError("--fix prints a diff: use it with --format text")
    started = time.perf_counter()
    result = audits.audit(paths, adaptor=None if adaptor == "auto" else Path(adaptor), rule_paths=rules or ())
    elapsed = time.perf_counter() - started
    plan = audits.plan_fixes(result) if fix else None  # refused before any output
    if output_format is OutputFormat.json:
        _print_json(report.audit_to_json(result))
    elif output_format is OutputFormat.sarif:
        _print_json(report.audit_to_sarif(result, audits.plan_fixes_per_holder(result)))
    else:
        Console(highlight=False).print(report.audit_to_text(result, elapsed))
    left = len(result.uncovered)
    if plan is not None:
        left -= len(_audit_fix(result, plan, dry_run=dry_run, yes=yes))
    raise typer.Exit(1 if left else 0)


def _audit_fix(result: Audit, plan: Plan, *, dry_run: bool, yes: bool) -> tuple[AuditedHolder, ...]:
    """The audit's fixes as one diff, applied like `fix` does; the holders whose fix was written."""
    from unsafe_doctor import fix as fixes

    fixable = result.fixable
    if not fixable:
        _say("no uncovered global has a fix to write")
        return ()
    _show_plan(plan, len(fixable), revert=False)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    written: tuple[Written, ...] = ()
    if plan.edits and not dry_run and (yes or (interactive and typer.confirm("Apply?", default=False))):
        written = fixes.apply(plan)
    _tell_outcome(plan, written, dry_run, interactive)
    return fixable if written else ()


@app.command()
def verify(
    logs: Annotated[
        list[str] | None,
        typer.Argument(help="Log files or folders (.gz too). None or '-': read standard input.", show_default=False),
    ] = None,
    adaptor: AdaptorOption = None,
    source_root: SourceRootOption = None,
    rules: RulesOption = None,
    function: FunctionOption = None,
    ranks: Annotated[int | None, typer.Option("--ranks", help="Ranks to replay on (2-16; default 4, or torchrun's).")] = None,
    mode: Annotated[
        ReplayMode,
        typer.Option("--mode", help="block: run the marked fix blocks; adaptor: import the adaptor and call its functions."),
    ] = ReplayMode.block,
    probe: Annotated[
        str | None,
        typer.Option("--probe", help="MODULE:FUNCTION of yours that creates and touches the global (called every step)."),
    ] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds before a stuck replay is stopped.")] = 60.0,
    output_format: FormatOption = OutputFormat.text,
) -> None:
    """Replay the fault and the recovery on a real process group: unpatched must fail, patched must not.

    Exit 0: every fix proven; 1: a check failed (including no fix present); 2: cannot replay.
    """
    import importlib.util

    from unsafe_doctor import fix as fixes
    from unsafe_doctor import verify as verification
    from unsafe_doctor.replay.launch import under_torchrun

    if importlib.util.find_spec("torch") is None:
        raise UsageError("verify replays on torch, which is not installed: pip install 'unsafe-doctor[replay]' "
                         "(or torch==2.13.0 for the CPU build)")
    if output_format is OutputFormat.sarif:
        raise UsageError("verify writes text or json (--format sarif is for diagnose)")
    paths = logs or []
    if not paths and sys.stdin.isatty():
        raise UsageError("no input: name a log file or folder, or pipe a log in (see --help)")
    if under_torchrun():
        ranks = int(os.environ["WORLD_SIZE"])
    diagnosis = run_diagnosis(paths, groundwork(rules or (), source_root or ()), adaptor=adaptor)
    plan, skipped = verification.plan_replay(
        diagnosis, diagnosis.context.knowledge, ranks=ranks or 4, mode=mode.value, probe=probe, timeout=timeout,
        functions=fixes.function_overrides(function or []),
    )
    outcome = verification.verify(plan, skipped)
    if outcome is None:  # a torchrun rank other than 0: rank 0 reports
        raise typer.Exit(0)
    if output_format is OutputFormat.json:
        _print_json(report.verification_json(outcome))
    else:
        Console(highlight=False).print(report.verification_text(outcome))
    raise typer.Exit(outcome.exit_code)


def _say(line: str) -> None:
    print(f"unsafe-doctor: {line}", file=sys.stderr)


@rules_app.command("list")
def rules_list(
    rules: RulesOption = None,
    output_format: FormatOption = OutputFormat.text,
) -> None:
    """Every rule: id, scenario, framework versions, title."""
    knowledge = load_knowledge(rules or ())
    if output_format is not OutputFormat.text:
        _print_json({"rules": [report.rule_json(rule) for rule in knowledge.rules]})
        return
    Console(highlight=False).print(report.rules_table(knowledge))


@rules_app.command("show")
def rules_show(
    rule_id: Annotated[str, typer.Argument(help="The rule's id, as `rules list` shows it.")],
    rules: RulesOption = None,
    output_format: FormatOption = OutputFormat.text,
) -> None:
    """One rule in full: what it matches, why, and the fix it writes."""
    knowledge = load_knowledge(rules or ())
    rule = knowledge.rule(rule_id)
    if rule is None:
        raise UsageError(f"no rule '{rule_id}' (see `unsafe-doctor rules list`)")
    if output_format is not OutputFormat.text:
        _print_json(report.rule_json(rule))
        return
    Console(highlight=False).print(report.rule_panel(rule, knowledge))


@rules_app.command("validate")
def rules_validate(
    files: Annotated[list[Path], typer.Argument(help="Rule files or folders to check.", exists=True)],
) -> None:
    """Check rule files against the schema; every problem as file:line: what is wrong."""
    problems = validate_files(files)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        raise typer.Exit(2)
    print(f"{len(files)} path{'s' if len(files) != 1 else ''}: valid")


def _print_json(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document, indent=2, ensure_ascii=False) + "\n")


class _progress_bar:
    """A byte progress bar on stderr, only for large inputs and only when stderr is a terminal."""

    def __init__(self, paths: list[str]) -> None:
        self.bar: Any = None  # a rich Progress, imported only when a bar is drawn
        if not sys.stderr.isatty():
            return
        total = inputs.total_size(paths) if paths else _stdin_size()
        if total is not None and total >= PROGRESS_FROM:
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            self.bar = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self.task = self.bar.add_task("reading logs", total=total)

    def __enter__(self):
        if self.bar is None:
            return None
        self.bar.start()
        return lambda count: self.bar.advance(self.task, count)

    def __exit__(self, *exc_info: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _stdin_size() -> int | None:
    status = os.fstat(sys.stdin.fileno())
    return status.st_size if status.st_size else None


def _with_default_command(argv: list[str]) -> list[str]:
    """`unsafe-doctor train.log` and `... | unsafe-doctor` mean `diagnose`."""
    commands = {command.name or command.callback.__name__ for command in app.registered_commands}
    commands |= {group.name for group in app.registered_groups}
    if argv and (argv[0] in commands or argv[0] in ("--help", "-h", "--version")):
        return argv
    return ["diagnose", *argv]


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


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        code = app(args=_with_default_command(args), prog_name="unsafe-doctor", standalone_mode=False)
    except UsageError as error:
        print(f"unsafe-doctor: {error}", file=sys.stderr)
        sys.exit(2)
    except click.ClickException as error:  # a bad option or argument: one line, not a box
        print(f"unsafe-doctor: {error.format_message()} (see --help)", file=sys.stderr)
        sys.exit(error.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    sys.exit(code or 0)
