"""`unsafe-doctor verify`: the fault and the recovery replayed on a real process group, unpatched then patched."""

from __future__ import annotations

import os
from enum import Enum
from typing import Annotated

import typer

from unsafe_doctor.cli.options import (
    AdaptorOption,
    Format,
    FormatOption,
    FunctionOption,
    LogOnlyOption,
    LogsArgument,
    ParameterOption,
    RulesOption,
    SourceRootOption,
)
from unsafe_doctor.cli.streams import log_paths, print_json, print_rich, warn_skipped
from unsafe_doctor.context import groundwork
from unsafe_doctor.diagnosis import diagnose
from unsafe_doctor.errors import UsageError


class ReplayMode(str, Enum):
    block = "block"
    adaptor = "adaptor"


def command(
    logs: LogsArgument = None,
    adaptor: AdaptorOption = None,
    source_root: SourceRootOption = None,
    log_only: LogOnlyOption = False,
    rules: RulesOption = None,
    function: FunctionOption = None,
    parameter: ParameterOption = None,
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
    output_format: FormatOption = Format.text,
) -> int:
    """Replay the fault and the recovery on a real process group: unpatched must fail, patched must not.

    Exit 0: every fix proven; 1: a check failed (including no fix present); 2: cannot replay.
    """
    import importlib.util

    from unsafe_doctor import fix as fixes
    from unsafe_doctor import verify as verification
    from unsafe_doctor.replay.launch import under_torchrun
    from unsafe_doctor.report import verification as report

    if importlib.util.find_spec("torch") is None:
        raise UsageError("verify replays on torch, which is not installed: pip install 'unsafe-doctor[replay]' "
                         "(or torch==2.13.0 for the CPU build)")
    paths = log_paths(logs)
    if under_torchrun():
        ranks = int(os.environ["WORLD_SIZE"])
    diagnosis = diagnose(paths, groundwork(rules or (), source_root or (), log_only=log_only), adaptor=adaptor)
    warn_skipped(diagnosis.skipped)
    functions: dict[str, str] = {role: name for role, name in fixes.function_overrides(function or []).items()}
    plan, skipped = verification.plan_replay(
        diagnosis, diagnosis.context.knowledge, ranks=ranks or 4, mode=mode.value, probe=probe, timeout=timeout,
        functions=functions, parameters=fixes.parameter_roles(parameter or []),
    )
    outcome = verification.verify(plan, skipped)
    if outcome is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    if output_format is Format.json:
        print_json(report.to_json(outcome))
    else:
        print_rich(report.to_text(outcome))
    return outcome.exit_code
