"""`unsafe-doctor verify`: the fault and the recovery replayed on a real process group, unpatched then patched."""

from __future__ import annotations

import contextlib
import shlex
import sys
from collections.abc import Callable, Iterator
from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer

from unsafe_doctor.cli.options import (
    AdaptorOption,
    Format,
    FormatOption,
    FunctionOption,
    LogOnlyOption,
    LogsArgument,
    ParameterOption,
    ProfileOption,
    RulesOption,
    SourceRootOption,
    SuspectOption,
)
from unsafe_doctor.cli.streams import adaptor_not_output, log_paths, print_json, print_rich, say_adaptor, warn_skipped
from unsafe_doctor.errors import UsageError

if TYPE_CHECKING:
    from unsafe_doctor.replay.results import Milestone


class ReplayModeChoice(str, Enum):
    adaptor = "adaptor"
    block = "block"


def verify_command(
    logs: LogsArgument = None,
    *,
    adaptor: AdaptorOption = None,
    source_root: SourceRootOption = None,
    log_only: LogOnlyOption = False,
    rules: RulesOption = None,
    function: FunctionOption = None,
    parameter: ParameterOption = None,
    profile: ProfileOption = None,
    suspect: SuspectOption = None,
    ranks: Annotated[int | None, typer.Option("--ranks", help="Ranks to replay on (2-16; default 4, or torchrun's).")] = None,
    mode: Annotated[
        ReplayModeChoice,
        typer.Option(
            "--mode",
            help="adaptor: call the patched adaptor's own functions (their fix blocks alone where "
            "their own code cannot run here); block: only the fix blocks, in their functions' scope.",
        ),
    ] = ReplayModeChoice.adaptor,
    probe: Annotated[
        str | None,
        typer.Option("--probe", help="MODULE:FUNCTION of yours that creates and touches the global (called every step)."),
    ] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds before a stuck replay is stopped.")] = 60.0,
    as_is: Annotated[
        bool,
        typer.Option(
            "--as-is",
            help="Replay the adaptor as it stands, the sentinel's blocks (heal) included, and judge whether the "
            "first step after recovery runs, fix or no fix.",
        ),
    ] = False,
    output_format: FormatOption = Format.text,
) -> int:
    """Replay the fault and the recovery on a real process group: unpatched must fail, patched must not.

    Exit 0: every fix proven (or block-proven), or with --as-is the first step after recovery runs;
    1: a check failed (including no fix present), or with --as-is the recovery or that step dies; 2: cannot replay.
    """
    import importlib.util

    from unsafe_doctor.adaptor.overrides import function_overrides, parameter_roles
    from unsafe_doctor.cli.fix import suspect_options
    from unsafe_doctor.cli.workflow import Invocation
    from unsafe_doctor.diagnose.pipeline import diagnose
    from unsafe_doctor.knowledge.context import groundwork
    from unsafe_doctor.replay import verify as verification
    from unsafe_doctor.replay.launch import torchrun_world_size, under_torchrun
    from unsafe_doctor.replay.quiet import framework_warnings_silenced
    from unsafe_doctor.report import verification as report
    from unsafe_doctor.report.common import NextStep, printable

    if importlib.util.find_spec("torch") is None:
        raise UsageError(
            "verify replays on torch, which is not installed: pip install 'unsafe-doctor[replay]' "
            "(or torch==2.13.0 for the CPU build)"
        )
    paths = log_paths(logs)
    if under_torchrun():
        ranks = torchrun_world_size()
    diagnosis = diagnose(paths, groundwork(rules or (), source_root or (), log_only=log_only, profile=profile), adaptor=adaptor)
    warn_skipped(diagnosis.skipped)
    adaptor_not_output(diagnosis.context.environment)
    functions: dict[str, str] = {role: name for role, name in function_overrides(function or []).items()}
    with framework_warnings_silenced():  # megatron-core's import-time Apex/TE warnings, in the ranks too (forked)
        chosen = diagnosis.chosen_suspects(suspect or ())
        plan, skipped = verification.plan_replay(
            diagnosis,
            diagnosis.context.knowledge,
            suspects=chosen,
            ranks=4 if ranks is None else ranks,
            mode=mode.value,
            probe=probe,
            timeout=timeout,
            functions=functions,
            parameters=parameter_roles(parameter or []),
            as_is=as_is,
        )
        say_adaptor(diagnosis.context.environment)
        with _phases_on_terminal(plan.world_size) as progress:
            outcome = verification.verify(plan, skipped, progress)
    if outcome is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    if output_format is Format.json:
        print_json(report.verification_json(outcome))
    else:
        invocation = Invocation(paths, source_root or (), rules or (), log_only)
        adaptor_path = diagnosis.context.environment.adaptor
        others = None
        if source_root and report.unfixed_globals(outcome):
            named = ["--adaptor", str(adaptor_path)] if adaptor_path else []
            audit = ["unsafe-doctor", "audit", *map(str, source_root), *named, "--fix"]
            others = NextStep(printable(shlex.join(audit)))
        write_fix = invocation.command("fix", adaptor_path, *suspect_options(chosen), "--yes")
        print_rich(report.verification_text(outcome, write_fix=write_fix, fix_others=others))
    return outcome.exit_code


@contextlib.contextmanager
def _phases_on_terminal(ranks: int) -> Iterator[Callable[[Milestone], None] | None]:
    """A replay takes seconds: on a terminal, a line on stderr names the phase the faulty rank is in
    (it goes when the replay ends); nothing when stderr is a file or a pipe."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console

    with Console(stderr=True).status(f"replay on {ranks} ranks: starting") as status:
        yield lambda milestone: status.update(f"replay on {ranks} ranks: {milestone}")
