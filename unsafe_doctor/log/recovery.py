"""Recovery context: what MindIO and the recovery adaptor logged around the failure.

Tells which rank had the hardware fault, at which step recovery ran, and whether the unsafe-data
error came inside a recovery callback (repair / rollback) or in the first iteration after recovery.

Line texts are those of MindIO TFT (`framework_ttp/ttp_decorator.py`, the C++ controller and
processor) and of MindSpeed-LLM's high-availability adaptor; see the domain notes, §1 and §4.

The log also tells one setting of the run that decides between rules: whether an fp16 grad scaler
scales the loss (`read_loss_scaling`), from what Megatron prints every step and at start-up.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from unsafe_doctor.log.lines import RANK_NUMBER, LogLine
from unsafe_doctor.log.tracebacks import Frame, Traceback

RecoveryPhase = Literal["after-recovery", "rollback", "repair", "none"]
# The forms of MindIO's catch line for an error it cannot classify (domain notes §4), by the releases
# that write them: "first-public" (mind-cluster master 2025-11-28 to 2025-12-11) logs the traceback with
# LOGGER.exception, then "other exception str is : <message>"; "v7.3" (v7.3.0 to v7.3.2) and "v26" (v26.0.0
# on, with an error_code field) log only "rank:N catch OTHER exception, … ex instance:<message>".
MindioForm = Literal["first-public", "v7.3", "v26"]
# What each form says of the release that wrote it; the forms that write no traceback of the error.
MINDIO_RELEASES: dict[MindioForm, str] = {
    "first-public": "mind-cluster master of 2025-11-28 to 2025-12-11 (the first public MindIO)",
    "v7.3": "mind-cluster v7.3.0 to v7.3.2",
    "v26": "mind-cluster v26.0.0 or later",
}
UNTRACED_FORMS: frozenset[MindioForm] = frozenset({"v7.3", "v26"})
# "none": the loss is not scaled (bf16, fp32); "grad-scaler": an fp16 grad scaler scales it, and
# the optimizer's loss scale is that scaler's tensor (Megatron's MixedPrecisionOptimizer.get_loss_scale).
LossScaling = Literal["none", "grad-scaler"]

# Byte strings that mark recovery lines; `inputs.py` searches for them near the error. Every line
# `read_recovery` turns into an event contains one of them.
MARKERS: tuple[bytes, ...] = (
    b"UCE ERROR",  # torch_npu's fault text, and MindIO's "catch UCE ERROR exception"
    b"MULTI BIT ECC",  # "HBM MULTI BIT ECC ERROR", MindIO's "HBM MULTI BIT ECC can repair"
    b"device error type",  # torch_npu's device error code
    b"uce memory result",  # adaptor clean: "rank 3 check uce memory result: 3"
    b"device stop",  # controller "notify all device stop", processor "receive device stop message"
    b"[stop] rank",  # decorator: "[stop] rank:3 stop consumed:…"
    b"[clean] rank",  # adaptor: "[clean] rank:3, type:retry, …"
    b"repair",  # repair callback, "[repair] rank 3, … step:1200", "repair failed", "do repair operation ok"
    b"rollback",  # rollback callback, "… gather and rollback at iteration 1200", "rollback failed"
    b"ex instance:",  # decorator: "rank:3 catch OTHER exception, [error_code:， ]ex instance:…" (v7.3 on), and
    # so every catch line that names its exception, of every release ("catch FORCE STOP exception, …")
    b"other exception str is",  # first public decorator, after its traceback: "other exception str is : …"
    b"restart device start",  # torch_npu 26.1 `torch_npu.recovery` logger: "restart device start, … rebuild_all_resources=…"
)

# Byte strings of the lines that tell the run's loss scaling; `inputs.py` keeps the last line
# holding each before the first error. Megatron (and MindSpeed-LLM) print `| loss scale: 65536.0 |`
# in every iteration line (1.0 without a grad scaler), and the argument dump at start-up lists
# `  fp16 ........ True` (`_print_args`: name, 48 - len(name) dots, value).
LOSS_SCALING_MARKERS: tuple[bytes, ...] = (b"| loss scale: ", b"fp16 ........")

# Functions of the recovery adaptor's repair and rollback phases (MindSpeed-LLM
# `mindspeed_llm/core/high_availability/`, formerly `mindio_ttp/adaptor/`; domain notes §1).
REPAIR_FUNCTIONS = frozenset(
    {
        "repair_callback",
        "recv_rank_repair",
        "send_rank_repair",
        "load_ckpt_repair",
        "recv_ckpt_from_peer",
        "save_and_send_ckpt",
        "send_optim_param_state",
        "recv_and_load_optim_param_state",
    }
)
ROLLBACK_FUNCTIONS = frozenset(
    {
        "rollback_callback",
        "feature_rollback",
        "training_log_repair",
        "gather_model_params_from_optimizer",
        "rebuild_global_vars",
    }
)
# `build_dataset` is a common name; it counts as rollback only in an adaptor file.
ROLLBACK_DATASET_FUNCTION = "build_dataset"
ADAPTOR_PATH_PARTS = ("high_availability", "mindio_ttp")

EventKind = Literal[
    "fault",
    "caught",
    "stop",
    "clean",
    "repair",
    "rollback",
    "repair-failed",
    "rollback-failed",
    "recovered",
]
# Kinds that prove MindIO's recovery flow started.
RECOVERY_KINDS = frozenset({"stop", "clean", "repair", "rollback", "repair-failed", "rollback-failed", "recovered"})


@dataclass(frozen=True, slots=True)
class RecoveryEvent:
    kind: EventKind  # see `EventKind`; "caught": MindIO caught the unsafe-data error itself
    rank: int | None
    step: int | None
    source: str
    offset: int
    text: str

    @property
    def catch_kind(self) -> CatchKind | None:
        """What the line's MindIO catch name says happened on its rank; None for a line that is no catch line."""
        name = catch_name(self.text)
        return CATCH_NAMES[name] if name is not None else None


@dataclass(frozen=True)
class RecoveryContext:
    seen: bool  # the recovery flow ran (any stop/clean/repair/rollback event, failed or not)
    fault_ranks: tuple[int, ...]  # ranks with a fault event, sorted (not the ranks MindIO stopped because another faulted)
    step: int | None  # the last recovery step logged
    events: tuple[RecoveryEvent, ...]  # in the order of the lines given

    def fault_kinds(self) -> dict[int, CatchKind]:
        """Each fault rank's kind of fault, as its lines name it: a memory fault where a line names none
        (MindIO's older fault lines, `UCE ERROR` in any message), a link fault or a precision retry only
        where every fault line of the rank says so."""
        kinds: dict[int, CatchKind] = {}
        for event in self.events:
            if event.kind != "fault" or event.rank is None:
                continue
            kind = event.catch_kind if event.catch_kind in _FAULT_KINDS else "memory-fault"
            kinds[event.rank] = kind if kinds.get(event.rank, kind) == kind else "memory-fault"
        return kinds


# What a MindIO catch line `rank:N catch <NAME> exception, …` says happened on rank N, by the report state
# MindIO sends for NAME (mind-cluster `framework_ttp/ttp_decorator.py`, `fault_types`; the ReportState API page):
# "memory-fault", a UCE or HBM ECC error (RS_UCE, RS_UCE_CORRUPTED); "link-fault", a link or HCCL fault MindIO
# retries or repairs by relinking (RS_HCCL_FAILED); "precision-retry", a precision error retried from a
# checkpoint step (RS_RETRY); "force-stop", the error MindIO's stop handler raises on a rank that did not fault,
# so that the decorator takes over its main thread for the recovery (RS_NORMAL); "step-pause", a step-level pause
# of a sub-health hot switch (RS_STEP_FINISH); "rescheduled", a newly launched rank (ARF) done with its
# pre-repair (RS_PREREPAIR_FINISH); "other", an error MindIO cannot classify (RS_UNKNOWN: the unsafe-data error).
CatchKind = Literal["memory-fault", "link-fault", "precision-retry", "force-stop", "step-pause", "rescheduled", "other"]
# Every NAME a catch line carries, of every release: the names the handlers of `fault_handles` return (`fault_dict`'s
# keys in the first public version), the literal names of its format strings, and MindSpeed-LLM's registered
# `PRECISION ERROR` (`mindspeed_llm/core/high_availability/tft_train_initialize.py`, 26.0.0 on: its handler in
# `tft_precision_error_handler.py` returns that name). tests/log/test_catch_names.py holds it to the real files.
CATCH_NAMES: dict[str, CatchKind] = {
    "UCE ERROR": "memory-fault",
    "HBM MULTI BIT ECC": "memory-fault",  # first public
    "HBM MULTI BIT ECC can repair": "memory-fault",  # v7.3.0 on
    "HBM MULTI BIT ECC can't repair": "memory-fault",  # v7.3.0 on (RS_UCE_CORRUPTED)
    "HBM": "memory-fault",  # first public: "catch HBM exception, but can't repair ex instance:…"
    "HCCL OP RETRY FAILED": "link-fault",
    "SUSPECT REMOTE ERROR": "link-fault",
    "UB LINK ERROR": "link-fault",  # v26.1.0 on
    "HCCS LINK ERROR": "link-fault",  # v26.1.0 on
    "PRECISION ERROR": "precision-retry",
    "FORCE STOP": "force-stop",
    "STEP FINISH": "step-pause",
    "ARF FINISH": "rescheduled",
    "OTHER": "other",  # a handler's answer when retry is off (`catch_name` reads the fault in its message), or no match
    "other": "other",  # the handler's generic `except Exception`
}
# The event a catch line's kind is; "other" tells nothing by itself (its message may: the unsafe-data error, a UCE).
_CATCH_EVENTS: dict[CatchKind, EventKind | None] = {
    "memory-fault": "fault",
    "link-fault": "fault",
    "precision-retry": "fault",
    "force-stop": "stop",
    "step-pause": "stop",
    "rescheduled": "repair",
    "other": None,
}
# The kinds that are a fault of the line's rank.
_FAULT_KINDS: frozenset[CatchKind] = frozenset({"memory-fault", "link-fault", "precision-retry"})
# The faults that leave no memory unsafe: MindIO retries the step or relinks, and no device memory was hit.
_UNMARKING_FAULTS: frozenset[CatchKind] = frozenset({"link-fault", "precision-retry"})
# The names are fixed texts: one alternation of them, longest first, runs in time linear in the line.
_CATCH_NAME = re.compile(
    r"\bcatch (" + "|".join(re.escape(name) for name in sorted(CATCH_NAMES, key=len, reverse=True)) + r") exception\b"
)
# The fault names an OTHER line's message may hold (MindIO answers OTHER for them when retry is off), as MindIO
# matches them: anywhere in the error's text (not the first public version's bare "HBM", no pattern of MindIO's).
_FAULT_IN_MESSAGE = re.compile(
    "|".join(
        re.escape(name)
        for name in sorted(CATCH_NAMES, key=len, reverse=True)
        if CATCH_NAMES[name] in _FAULT_KINDS and name != "HBM"
    )
)
# Substrings per kind, tried in this order (the first kind that matches wins). Failures and the
# success marker come before the generic repair/rollback texts that they also contain.
_KIND_TEXTS: tuple[tuple[EventKind, tuple[str, ...]], ...] = (
    ("repair-failed", ("repair failed, ret:",)),
    ("rollback-failed", ("rollback failed, ret:",)),
    ("recovered", ("do repair operation ok",)),
    ("fault", ("UCE ERROR", "MULTI BIT ECC", "device error type")),
    (
        "rollback",
        ("start to rollback callback", "and rollback at iteration", "[rollback] rank", "start rollback", "reply rollback result"),
    ),
    (
        "repair",
        ("start to repair callback", "[repair] rank", "receive repair message", "reply repair result"),
    ),
    ("clean", ("[clean] rank", "check uce memory result", "restart device start")),
    ("stop", ("[stop] rank", "device stop")),
)
# check_uce_in_memory: 0 = no UCE on this device (the line then only shows that clean ran);
# 1, 2, 3 = a UCE hit it (3: in persistent memory, the case that leaves unsafe tensors).
_UCE_MEMORY_RESULT = re.compile(r"check uce memory result:\s*([1-9])")
# MindIO decorator's catch line, newest form first: v26 "rank:%s catch %s exception, error_code:%s， ex
# instance:%s" (full-width comma), v7.3 "rank:{r} catch {exc} exception, ex instance:{err}", and the first
# public "other exception str is : {err}" logged after the traceback. Each form is its start, and for v26
# what follows it somewhere after: one `.*?` between them searched from every start is quadratic.
_CATCH_FORMS: tuple[tuple[MindioForm, re.Pattern[str], re.Pattern[str] | None], ...] = (
    ("v26", re.compile(r"catch \S+ exception, error_code:"), re.compile(r"[，,] ?ex instance:")),
    ("v7.3", re.compile(r"catch \S+ exception, ex instance:"), None),
    ("first-public", re.compile(r"other exception str is : "), None),
)
_UNSAFE = "unsafe data in the input tensor"
_ANY_MARKER = re.compile("|".join(re.escape(marker.decode()) for marker in MARKERS))
# "rank:3", "rank 3", "[rank3]" left mid-line, torch_npu's "RankID:3" (-1 when RANK was unset).
# A rank is at most RANK_DIGITS digits and a step eighteen: a longer run is none (and `int` refuses 4,300 digits).
_RANK = re.compile(rf"\brank(?:id)?[: ]?\s*(-?{RANK_NUMBER})(?!\d)", re.IGNORECASE)
# "[repair] rank 3, …, step:1200", "rank:3 successfully gather and rollback at iteration 1200".
_STEP = re.compile(r"\bstep:\s*(\d{1,18})(?!\d)|\bat iteration (\d{1,18})(?!\d)")


def _kind_of(text: str) -> EventKind | None:
    if not _ANY_MARKER.search(text):  # most lines: one regex call instead of every needle
        return None
    if _UNSAFE in text and catch_form(text) is not None:
        return "caught"
    if _UCE_MEMORY_RESULT.search(text):
        return "fault"
    if (name := catch_name(text)) is not None and (kind := _CATCH_EVENTS[CATCH_NAMES[name]]) is not None:
        return kind
    for kind, needles in _KIND_TEXTS:
        if any(needle in text for needle in needles):
            return kind
    return None


def catch_form(text: str) -> MindioForm | None:
    """Which release's catch line this is, or None for any other line."""
    for form, start, then in _CATCH_FORMS:
        if (found := start.search(text)) and (then is None or then.search(text, found.end())):
            return form
    return None


def catch_name(text: str) -> str | None:
    """The name of what a MindIO catch line reports (a key of `CATCH_NAMES`): its exception name, but for an
    OTHER line the fault name its error's message holds where it holds one; None for any other line."""
    if (m := _CATCH_NAME.search(text)) is None:
        return None
    if CATCH_NAMES[m[1]] == "other" and (fault := _FAULT_IN_MESSAGE.search(text, m.end())):
        return fault[0]
    return m[1]


def mindio_form(context: RecoveryContext) -> MindioForm | None:
    """The form of the log's catch lines of the unsafe-data error; the newest when inputs mix releases."""
    forms = {catch_form(event.text) for event in context.events if event.kind == "caught"}
    return next((form for form, _, _ in _CATCH_FORMS if form in forms), None)


def _rank_of(line: LogLine) -> int | None:
    """The rank a message names wins over the rank that wrote it (a controller logs for others)."""
    m = _RANK.search(line.text)
    if m is not None and int(m[1]) >= 0:
        return int(m[1])
    return line.rank


def _step_of(text: str) -> int | None:
    m = _STEP.search(text)
    return int(m[1] or m[2]) if m else None


def read_recovery(lines: Iterable[LogLine]) -> RecoveryContext:
    """Turn normalised lines into recovery events; lines that are no event are ignored.

    A line given twice (same source and offset, e.g. found by two markers) counts once.
    """
    events = []
    done: set[tuple[str, int]] = set()
    for line in lines:
        kind = _kind_of(line.text)
        if kind is None or (line.source, line.offset) in done:
            continue
        done.add((line.source, line.offset))
        events.append(RecoveryEvent(kind, _rank_of(line), _step_of(line.text), line.source, line.offset, line.text))
    steps = [event.step for event in events if event.step is not None]
    return RecoveryContext(
        seen=any(event.kind in RECOVERY_KINDS for event in events),
        fault_ranks=tuple(sorted({e.rank for e in events if e.kind == "fault" and e.rank is not None})),
        step=steps[-1] if steps else None,
        events=tuple(events),
    )


# What the fault before the error left unsafe (torch_npu's allocator, domain notes §3): "partial", only the
# blocks a UCE in persistent memory hit (`check_uce_in_memory` 3; an HBM ECC error always reports 3);
# "all-marked", every device tensor (`restart_device(rebuild_all_resources=True)`); "none-marked", nothing
# (a UCE in temporary memory only, result 2, or a link, HCCL-retry or precision fault); "unknown".
FaultMarking = Literal["partial", "all-marked", "none-marked", "unknown"]


@dataclass(frozen=True)
class FaultReading:
    marking: FaultMarking
    evidence: str | None = None  # what the line that tells says ("check uce memory result: 3"); None: no line tells
    rank: int | None = None  # the rank that logged it


_STRONGEST_FIRST: tuple[FaultMarking, ...] = ("all-marked", "partial", "unknown", "none-marked")
_RESTART = re.compile(r"restart device start\b.*")
_REBUILD_ALL = re.compile(r"rebuild_all_resources\s*[=:]\s*True")
_UNSAFE_CHECK_OFF = re.compile(r"disable_tensor_unsafe_check\s*[=:]\s*True")
_UCE_NAMES = ("UCE ERROR", "device error type")  # a UCE whose memory check is not in the line


def read_fault(context: RecoveryContext) -> FaultReading:
    """What the log's faults marked unsafe, the strongest marking first: a restart that rebuilds all
    resources (and does not disable the check), then a UCE in persistent memory, then a UCE whose
    memory check the log does not show (unknown), then the faults that mark nothing."""
    found: dict[FaultMarking, FaultReading] = {}
    unchecked: list[FaultReading] = []
    checked: set[int | None] = set()  # the ranks whose memory check the log shows
    for event in context.events:
        text = event.text
        if event.kind == "clean" and (restart := _RESTART.search(text)):
            if _REBUILD_ALL.search(text) and not _UNSAFE_CHECK_OFF.search(text):
                found.setdefault("all-marked", FaultReading("all-marked", restart[0].strip(), event.rank))
            continue
        if event.kind != "fault":
            continue
        if (result := _UCE_MEMORY_RESULT.search(text)) is not None:
            checked.add(event.rank)
            marking: FaultMarking = "partial" if result[1] == "3" else "none-marked" if result[1] == "2" else "unknown"
            found.setdefault(marking, FaultReading(marking, result[0], event.rank))
        elif "MULTI BIT ECC" in text:  # check_uce_in_memory always reports an HBM ECC error as persistent (3)
            found.setdefault("partial", FaultReading("partial", "HBM MULTI BIT ECC", event.rank))
        elif event.catch_kind in _UNMARKING_FAULTS:
            found.setdefault("none-marked", FaultReading("none-marked", catch_name(text), event.rank))
        elif name := next((name for name in _UCE_NAMES if name in text), None):
            unchecked.append(FaultReading("unknown", name, event.rank))
    # a UCE on a rank whose check the log lacks may have hit persistent memory: another rank's check does not say
    if reading := next((each for each in unchecked if each.rank not in checked and (each.rank is not None or not checked)), None):
        found.setdefault("unknown", reading)
    return next((found[marking] for marking in _STRONGEST_FIRST if marking in found), FaultReading("unknown"))


def _frame_phase(frame: Frame) -> RecoveryPhase | None:
    if frame.function in REPAIR_FUNCTIONS:
        return "repair"
    if frame.function in ROLLBACK_FUNCTIONS:
        return "rollback"
    in_adaptor = any(part in frame.file for part in ADAPTOR_PATH_PARTS)
    if frame.function == ROLLBACK_DATASET_FUNCTION and in_adaptor:
        return "rollback"
    return None


def phase_of(traceback: Traceback, context: RecoveryContext) -> RecoveryPhase:
    """Where the error was raised: inside a repair or rollback callback, after recovery, or unknown.

    The innermost callback frame decides, looking at the raised exception first, then its causes.
    """
    for link in traceback.chain():
        for frame in reversed(link.frames):
            phase = _frame_phase(frame)
            if phase is not None:
                return phase
    return "after-recovery" if context.seen else "none"


_LOSS_SCALE = re.compile(r"\| loss scale: (\d+(?:\.\d*)?(?:[eE][+-]?\d+)?) \|")
_FP16_ARGUMENT = re.compile(r"(?:^|\s)fp16 \.{8,} (True|False)\s*$")


def read_loss_scaling(lines: Iterable[LogLine]) -> LossScaling | None:
    """Whether an fp16 grad scaler scales the loss, or None when the lines do not tell.

    The argument dump's `fp16` line decides when present; otherwise the iteration lines' loss
    scale: 1.0 is the constant of an unscaled (bf16) run, any other value a grad scaler's. Lines
    that disagree (inputs of different runs) tell nothing.
    """
    arguments: set[LossScaling] = set()
    scales: set[LossScaling] = set()
    for line in lines:
        if m := _FP16_ARGUMENT.search(line.text):
            arguments.add("grad-scaler" if m[1] == "True" else "none")
        elif m := _LOSS_SCALE.search(line.text):
            scales.add("none" if float(m[1]) == 1.0 else "grad-scaler")
    found = arguments or scales
    return found.pop() if len(found) == 1 else None
