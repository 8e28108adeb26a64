"""`sentinel install`: the sentinel's call and the traceback keeper written at the end of the adaptor's
rollback function; in mode heal, also the repair's heal at the end of its send and receive functions.

The block, planned and written by the fixer (`plan.plan_blocks`: diff, backup, idempotent, revert),
in mode report:

    # unsafe-doctor: begin unsafe_doctor.sentinel
    # <what it does>
    try:  # <why: unsafe-doctor missing or broken never fails the rollback>
        from unsafe_doctor.sentinel import check as _ud_sentinel_check
        from unsafe_doctor.sentinel.keeper import keep_tracebacks as _ud_keep_tracebacks
        _ud_keep_tracebacks()  # MindIO logs the next unsafe-data error with its traceback
        _ud_sentinel_check(train_args, mode="report")
    except Exception as _ud_error:
        import logging as _ud_logging
        import os as _ud_os
        _ud_logging.getLogger("unsafe_doctor.sentinel").warning(
            "[unsafe-doctor sentinel] rank %s: failed, the rollback goes on: %r",
            _ud_os.getenv("RANK", "?"), _ud_error)
    # unsafe-doctor: end unsafe_doctor.sentinel

It runs in the training process, where unsafe-doctor may not be installed (`sentinel install` says
what the image needs: `report.sentinel.needs_line`): in the modes `log.sentinel_modes.GUARDED`,
nothing it imports or calls can fail the rollback; one log line, which `diagnose` reads
(`log.sentinel_lines.FAILED_LINE`), says on which rank it did not check and why, and the recovery
goes on. Mode heal writes the same block, and lets through the one error it was asked to raise:
`UnsafeStateError`, for tensors it could not heal (named, not imported: where the package is missing
there is no class to name). Mode raise was asked to stop the recovery rather than let a step run on
state nobody vouched for, so its block is the same four lines unguarded: a package the ranks cannot
import stops the recovery there, as an unsafe tensor would.

Its names are bound to names of their own (`_ud_`), which nothing else in the function reads.
`train_args` is the rollback function's parameter for the profile's train_args role, when it has
one: through it the sentinel also checks the models' buffers and the optimizers' state. The keeper
(`sentinel.keeper`) makes MindIO's log line for the next unsafe-data error carry its traceback,
which MindIO 7.3 and later leave out; it goes first, so that a sentinel that raises (modes raise and
heal) still leaves it in place, and the end of the rollback is before the first step after the
recovery. One block for both: they are installed and reverted together. The block stays the last one
of the function (a later `fix` goes before it), so the sentinel sees the rollback's repairs; `fix
--revert` leaves it, `sentinel install --revert` takes it out. This module only names
`unsafe_doctor.sentinel`: it runs in the training process, not here.

Mode heal also writes a block at the end of the generation's receive and send repair functions (the
profile's, or `--function recv=NAME` / `send=NAME`), which calls `sentinel.heal.receive_state` on
the faulty rank and `send_state` on its replica, with the function's own repair group and rank
lists (written as `fix` writes a scenario-2 block: `knowledge.render.block`), guarded the same way:
a rank that cannot import unsafe-doctor logs `REPAIR_FAILED_LINE` and the repair goes on. Where
`--rules` were given, every block names them (absolute paths): the training process reads them to
know which globals are scenario 1 (the rollback re-initialises them) and 2 (the repair copies them).

No block without the import is offered: the walk that finds what a step reaches without running
its code is the package (`sentinel.walk`), and a few lines that stand in for it would either miss
the globals a recovery leaves unsafe (nested in dicts, objects, closures, caches) or run code of the
objects they read inside the rollback (docs/sentinel.md, "What the training image needs").
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from unsafe_doctor.adaptor.code import BlockSite, adaptor_files, block_spans, enclosing_function, read_adaptor_file
from unsafe_doctor.adaptor.plan import Plan, plan_blocks
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.render.block import marked_block, render
from unsafe_doctor.knowledge.render.template import INDENT
from unsafe_doctor.knowledge.rules import AdaptorProfile, map_parameters, role_parameter
from unsafe_doctor.knowledge.versions import Environment
from unsafe_doctor.log.sentinel_lines import FAILED_LINE, REPAIR_FAILED_LINE
from unsafe_doctor.log.sentinel_modes import GUARDED, MODES, SentinelMode
from unsafe_doctor.recovery_code.model import Role
from unsafe_doctor.source.markers import HEAL_KEY, SENTINEL_KEY

# under names of their own, which nothing else in a function reads
IMPORTS = (
    "from unsafe_doctor.sentinel import check as _ud_sentinel_check",
    "from unsafe_doctor.sentinel.keeper import keep_tracebacks as _ud_keep_tracebacks",
)
GUARD_COMMENT = "unsafe-doctor missing or broken never fails the rollback: one line says why"
REPAIR_GUARD_COMMENT = "unsafe-doctor missing or broken never fails the repair: one line says why"
HEAL_CALLS = {"recv": "receive_state", "send": "send_state"}  # `sentinel.heal`'s function for each repair side
HEAL_WHAT = {
    "recv": "end of the repair: copy each unsafe scenario-2 global from the replica, by its path",
    "send": "end of the repair: send the faulty rank the scenario-2 globals it asks for",
}
HEAL_STOPS = "tensors heal left unsafe: stop the recovery, as mode heal asks"
LOGGER = "unsafe_doctor.sentinel"  # the sentinel's own logger (`logging.getLogger(__name__)` there)
KEEPER_COMMENT = "MindIO logs the next unsafe-data error with its traceback"
WHAT = {  # what each mode does after naming them, as the block's comment says it
    "report": "go on",
    "raise": "stop the recovery",
    "heal": "re-initialise scenario-1 ones, else stop",
}


@dataclass(frozen=True)
class SentinelRequest:
    """The sentinel's block for the rollback function (`fix.BlockRequest`)."""

    function: str
    mode: SentinelMode
    rules: tuple[str, ...] = ()  # the user's --rules, absolute: the process reads them
    key: str = SENTINEL_KEY
    role: Role = "rollback"

    def block(self, site: BlockSite, profile: AdaptorProfile, group: str | None) -> tuple[list[str], tuple[str, ...]]:
        """The imports, the keeper's call and the sentinel's; a note when the function has no train_args to pass."""
        function = site.function
        train_args = role_parameter(profile, "train_args", function.parameters)
        passed = train_args if train_args is not None and train_args.split(".")[0] in function.parameters else None
        notes: tuple[str, ...] = ()
        if passed is None:
            notes = (
                f"{function.name}() has no train_args parameter (--parameter train_args=NAME): the sentinel is not passed "
                "the models and optimizers, so their buffers and state are not checked; pass them to it yourself",
            )
        arguments = ", ".join([*([passed] if passed else []), f'mode="{self.mode}"', *_rules_argument(self.rules)])
        code = [*IMPORTS, f"_ud_keep_tracebacks()  # {KEEPER_COMMENT}", f"_ud_sentinel_check({arguments})"]
        if self.mode in GUARDED:
            stop = ['if type(_ud_error).__name__ == "UnsafeStateError":', INDENT + f"raise  # {HEAL_STOPS}"]
            code = _guarded(code, GUARD_COMMENT, FAILED_LINE, stop if self.mode == "heal" else [])
        comment = f"last in the rollback: name every unsafe tensor, then {WHAT[self.mode]}"
        return marked_block(self.key, comment, code, function), notes


@dataclass(frozen=True)
class HealRequest:
    """Mode heal's block at the end of a repair function: the receive side (faulty rank) or the send side (replica)."""

    function: str
    role: Role  # "recv" or "send"
    rules: tuple[str, ...] = ()
    key: str = HEAL_KEY

    def block(self, site: BlockSite, profile: AdaptorProfile, group: str | None) -> tuple[list[str], tuple[str, ...]]:
        """The call of `sentinel.heal` with the function's own repair group, rank lists and train_args, guarded."""
        function = site.function
        call = HEAL_CALLS[self.role]
        train_args = role_parameter(profile, "train_args", function.parameters)
        roots = ["train_args"] if train_args is not None and train_args.split(".")[0] in function.parameters else []
        notes: tuple[str, ...] = ()
        if not roots:
            notes = (
                f"{function.name}() has no train_args parameter (--parameter train_args=NAME): heal reaches the "
                "globals of the packages, not the models' buffers or the optimizers' state",
            )
        rules = _rules_argument(self.rules) if self.role == "recv" else []  # the replica sends what it is asked
        arguments = ", ".join([profile.repair_group, "src_ranks", "dest_ranks", *roots, *rules])
        code = f"from unsafe_doctor.sentinel.heal import {call} as _ud_{call}\n_ud_{call}({arguments})\n"
        rendered = render(code, profile.repair_group_imports, 2, site, profile, group=group, what=self.key, per_pair=False)
        guarded = _guarded(rendered.lines, REPAIR_GUARD_COMMENT, REPAIR_FAILED_LINE, [])
        return marked_block(self.key, HEAL_WHAT[self.role], guarded, function), (*rendered.notes, *notes)


def _rules_argument(rules: Sequence[str]) -> list[str]:
    return [f"rules={json.dumps(list(rules))}"] if rules else []  # double quotes, as the files write strings


def _guarded(code: Sequence[str], why: str, failed_line: str, stop: Sequence[str]) -> list[str]:
    """`code` in a try whose except lets `stop` decide first, then logs the one line `diagnose` reads."""
    log = [
        "import logging as _ud_logging",
        "import os as _ud_os",
        f'_ud_logging.getLogger("{LOGGER}").warning(',
        INDENT + f'"{failed_line}",',
        INDENT + '_ud_os.getenv("RANK", "?"), _ud_error)',
    ]
    return [
        f"try:  # {why}",
        *(INDENT + line for line in code),
        "except Exception as _ud_error:",
        *(INDENT + line for line in [*stop, *log]),
    ]


def plan_sentinel(
    environment: Environment,
    mode: SentinelMode,
    functions: Mapping[Role, str] | None = None,
    parameters: Mapping[str, Sequence[str]] | None = None,
    rules: Sequence[Path] = (),
) -> Plan:
    """The edit that writes the sentinel's block at the end of the rollback function, and in mode
    heal the repair's blocks at the end of the receive and send functions; reads files, writes
    nothing. `functions` and `parameters` as `plan.plan_fix` takes them; `rules`: the user's."""
    if mode not in MODES:
        raise UsageError(f"sentinel mode {mode!r}: one of {', '.join(MODES)}")
    profile = map_parameters(environment.profile, parameters or {})
    installed = _installed(environment)
    if installed is not None:  # one sentinel per adaptor, wherever it is: a second would check it all again
        present, unguarded = installed
        again = "sentinel install --revert, then install again"
        note = f"to write another mode or move it: {again}"
        if unguarded:  # written before the guard: the failure this module's guarded block exists to prevent
            note = (
                f"it is unguarded in mode {unguarded} (an earlier unsafe-doctor wrote it): a rank that cannot import "
                f"unsafe-doctor fails the rollback there; to guard it: {again}"
            )
        return Plan((), (present,), (), (note,))
    functions = functions or {}
    named = tuple(str(Path(rule).resolve()) for rule in rules)
    requests: list[SentinelRequest | HealRequest] = [
        SentinelRequest(_end_of_rollback(environment, profile, functions), mode, named)
    ]
    notes: tuple[str, ...] = ()
    if mode == "heal":
        names = _function_names(environment)
        sides: dict[Role, str] = {"recv": functions.get("recv", profile.recv), "send": functions.get("send", profile.send)}
        missing = [name for role, name in sides.items() if role not in functions and name not in names]
        if missing:  # an adaptor with a rollback alone: heal re-initialises scenario 1 there, copies nothing
            notes = (
                f"the adaptor has no {' or '.join(f'{name}()' for name in missing)}: the repair's heal is not written "
                "(--function recv=NAME --function send=NAME), so scenario-2 globals are left to the rollback's check",
            )
        else:
            requests += [HealRequest(name, role, named) for role, name in sides.items()]
    plan = plan_blocks(requests, environment, profile)
    return replace(plan, notes=(*plan.notes, *notes))


def _end_of_rollback(environment: Environment, profile: AdaptorProfile, functions: Mapping[Role, str]) -> str:
    """`--function rollback=NAME`, else the profile's rollback callback where the adaptor has it (the
    rollback's real end, after the parameters are repaired), else its rollback function."""
    if "rollback" in functions:
        return functions["rollback"]
    callback = profile.rollback_callback
    return callback if callback in _function_names(environment) else profile.rollback


def _function_names(environment: Environment) -> set[str]:
    return {function.name for path in adaptor_files(environment) for function in read_adaptor_file(path).functions}


def _installed(environment: Environment) -> tuple[str, SentinelMode | None] | None:
    """Where the adaptor's files hold the sentinel's block already, as `fix.Plan.present` says it, and
    its mode where that is report or heal and the block has no guard."""
    for path in adaptor_files(environment):
        source = read_adaptor_file(path)
        for span in block_spans(source):
            if span.key == SENTINEL_KEY:
                function = enclosing_function(source, span.begin + 1)
                where = f"{function.name}()" if function else f"line {span.begin + 1}"
                block = b"".join(source.lines[span.begin : span.end + 1])
                guarded = b"except Exception as _ud_error:" in block
                unguarded = next((mode for mode in GUARDED if f'mode="{mode}"'.encode() in block and not guarded), None)
                return f"{source.shown}: {SENTINEL_KEY} already in {where}", unguarded
    return None
