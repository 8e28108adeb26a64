"""The sentinel: inside the training process, at the end of the rollback, name every tensor a step
can reach that the recovery left unsafe, all at once, before the first step dies on one of them.

    from unsafe_doctor.sentinel import check
    check(train_args, mode="report")   # at the end of feature_rollback

It walks (``sentinel.walk``) the objects passed in (models, optimizers, ``train_args``) and the
module globals and class attributes of the framework's packages and of the caller's, checks every
device tensor with the unsafe backend that marks them (torch_npu's ``check_npu_tensor_is_safe`` on
an NPU, the emulation where one is active), and logs one line per unsafe global in the format of
``unsafe_doctor.log.sentinel_lines``, which ``diagnose`` reads. Modes: ``report`` logs and returns,
and never raises into the training job (the summary line says what went wrong instead);
``raise`` also raises ``UnsafeStateError`` naming every unsafe global, so MindIO gives up the
online recovery instead of dying inside step 1; ``heal`` runs the shipped scenario-1 rules' fixes in
place, checks again, and raises for what is still unsafe. Scenario 2 needs the replica's data: in
mode heal, ``sentinel.heal`` copies it from the replica in the repair, before this check runs.

`walk` finds what a step can reach, `reachable` the tensors behind one global (the replay uses it
too), `verdict` what the rules say of each unsafe holder, `heal` the repair's copy from the replica.
Imports `npu`, `log` and `knowledge`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch.distributed as dist

from unsafe_doctor.log.sentinel_lines import Record, Summary, UnsafeGlobal, format_line
from unsafe_doctor.log.sentinel_modes import MODES, SentinelMode
from unsafe_doctor.npu.backend import UnsafeBackend, active_emulation, npu_unavailable_reason, select_backend
from unsafe_doctor.sentinel import verdict
from unsafe_doctor.sentinel.walk import Found, HolderName, Limits, Walk, walk

__all__ = [
    "DEFAULT_LIMITS",
    "FRAMEWORK_PACKAGES",
    "Limits",
    "SentinelReport",
    "UnsafeStateError",
    "check",
    "chosen_backend",
    "examine",
    "unsafe_holders",
]

FRAMEWORK_PACKAGES = ("megatron", "mindspeed", "mindspeed_llm", "modellink")
DEFAULT_LIMITS = Limits()
PATHS_PER_GLOBAL = 5  # paths logged for each unsafe global (the line gives the count); the report keeps all
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SentinelReport:
    summary: Summary
    unsafe: tuple[UnsafeGlobal, ...]  # healed ones included, with healed=True

    @property
    def still_unsafe(self) -> tuple[UnsafeGlobal, ...]:
        """What the first step would die on: neither healed nor written by the step before it reads."""
        return tuple(item for item in self.unsafe if not item.healed and not item.written_by_step)

    def lines(self) -> list[str]:
        """The log lines: each global with its first paths (the report keeps them all) and its count."""
        records: list[Record] = [*(replace(item, paths=item.paths[:PATHS_PER_GLOBAL]) for item in self.unsafe), self.summary]
        return [format_line(record) for record in records]


class UnsafeStateError(RuntimeError):
    """The recovery left tensors unsafe: raised in ``raise`` mode (and ``heal`` mode, for what heal could not fix)."""

    def __init__(self, report: SentinelReport) -> None:
        self.report = report
        names = ", ".join(item.name.dotted for item in report.still_unsafe)
        summary = report.summary
        where = f"rank {summary.rank}" if summary.rank is not None else "this process"
        super().__init__(
            f"unsafe-doctor sentinel: the recovery left {len(report.still_unsafe)} global(s) unsafe on {where} "
            f"({summary.backend} backend): {names}. Stopping the recovery before the first step reads them; "
            "`unsafe-doctor diagnose` on this log names the fix for each."
        )


def check(
    *roots: object,
    mode: SentinelMode = "report",
    packages: Iterable[str] | None = None,
    rules: Sequence[str | Path] = (),
    limits: Limits = DEFAULT_LIMITS,
    backend: UnsafeBackend | None = None,
) -> SentinelReport:
    """Walk, check, log; then return, raise or heal by ``mode``. The walk never raises (what it cannot
    read it counts); in ``report`` mode nothing else does either: a failure is the summary's.

    ``roots``: what a step uses that no module global holds (models, optimizers, ``train_args``).
    ``packages``: top-level packages whose globals are walked; by default the frameworks' and the caller's.
    ``rules``: rule files or folders beside the shipped ones. ``backend``: the one that marked the
    tensors; by default the active emulation, else torch_npu's API when an NPU is here.
    """
    if packages is None:
        packages = (*FRAMEWORK_PACKAGES, sys._getframe(1).f_globals.get("__name__", "").partition(".")[0])
    started = time.perf_counter()
    try:
        report = examine(*roots, mode=mode, packages=packages, rules=rules, limits=limits, backend=backend)
    except Exception as error:  # noqa: BLE001 - report mode never fails the recovery: the summary says what went wrong
        if mode != "report":
            raise
        said = next((arg.splitlines()[0] for arg in error.args if type(arg) is str and arg.strip()), "")  # no __str__ runs
        why = f"nothing checked: the sentinel failed: {type(error).__name__}" + (f": {said}" if said else "")
        report = SentinelReport(Summary(None, "none", mode, 0, 0, 0, round(time.perf_counter() - started, 3), why), ())
    for line in report.lines():
        logger.warning(line)
    if mode != "report" and report.still_unsafe:
        raise UnsafeStateError(report)
    return report


def examine(
    *roots: object,
    mode: SentinelMode = "report",
    packages: Iterable[str] = FRAMEWORK_PACKAGES,
    rules: Sequence[str | Path] = (),
    limits: Limits = DEFAULT_LIMITS,
    backend: UnsafeBackend | None = None,
) -> SentinelReport:
    """``check`` without the log and the raise (heal mode still heals): what a replay asks."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    started = time.perf_counter()
    rank = _rank()
    chosen, why_none = (backend, None) if backend is not None else chosen_backend()
    if chosen is None:
        seconds = time.perf_counter() - started
        return SentinelReport(Summary(rank, "none", mode, 0, 0, 0, seconds, f"nothing checked: {why_none}"), ())
    wanted = frozenset(packages)
    paths = tuple(Path(rule) for rule in rules)  # the adaptor's block writes them as strings
    report, judged = _report(walk(roots, wanted, limits), chosen, rank, mode, paths, started=started)
    if mode == "heal" and report.unsafe:
        errors = {item.name: verdict.heal(judged[item.name]) for item in report.unsafe if judged[item.name].scenario == 1}
        after, _ = _report(walk(roots, wanted, limits), chosen, rank, mode, paths, started=started)
        report = _after_heal(report, after, errors)
    return report


def chosen_backend() -> tuple[UnsafeBackend | None, str | None]:
    """The emulation active in this process, else torch_npu's API when an NPU is here."""
    emulation = active_emulation()
    if emulation is not None:
        return emulation, None
    reason = npu_unavailable_reason()
    if reason is not None:
        return None, f"no unsafe backend here ({reason}; no emulation active)"
    return select_backend("npu"), None


def _rank() -> int | None:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    value = os.environ.get("RANK", "")
    return int(value) if value.isdigit() else None


def unsafe_holders(found: Walk, backend: UnsafeBackend) -> tuple[dict[HolderName, list[Found]], int]:
    """The walk's unsafe device tensors by holder, and how many device tensors were checked."""
    unsafe: dict[HolderName, list[Found]] = {}
    checked = 0
    for item in found.tensors:
        if backend.is_device_memory(item.tensor):
            checked += 1
            if not backend.is_safe(item.tensor):
                unsafe.setdefault(item.holder, []).append(item)
    return unsafe, checked


def _report(
    found: Walk, backend: UnsafeBackend, rank: int | None, mode: SentinelMode, rules: Sequence[Path], *, started: float
) -> tuple[SentinelReport, dict[HolderName, verdict.SentinelVerdict]]:
    """The records of one walk, and the knowledge's verdict on each holder (heal runs them)."""
    unsafe_found, checked = unsafe_holders(found, backend)
    unsafe = {holder: [item.path for item in items] for holder, items in unsafe_found.items()}
    asked = {holder: found.aliases.get(holder, []) for holder in unsafe}
    judged = verdict.verdicts(asked, found.caches, rules) if asked else {}
    globals_ = tuple(
        UnsafeGlobal(
            rank,
            backend.name,
            holder,
            len(paths),
            tuple(paths),
            judged[holder].scenario,
            judged[holder].rule,
            judged[holder].fix_function,
            cached=holder in found.caches,
            written_by_step=judged[holder].written_by_step,
        )
        for holder, paths in unsafe.items()
    )
    seconds = round(time.perf_counter() - started, 3)
    harmful = [item for item in globals_ if not item.written_by_step]
    summary = Summary(
        rank,
        backend.name,
        mode,
        checked,
        sum(item.tensors for item in harmful),
        len(harmful),
        seconds,
        found.stopped_early,
        found.not_walked.count,
        tuple(found.not_walked.first),
    )
    return SentinelReport(summary, globals_), judged


def _after_heal(before: SentinelReport, after: SentinelReport, errors: dict[HolderName, str | None]) -> SentinelReport:
    """Before's globals, each marked healed when heal ran for it and the second walk found it safe."""
    still = {item.name for item in after.unsafe}
    unsafe = []
    for item in before.unsafe:
        if item.name in errors:
            error = errors[item.name] or ("tensors still unsafe after the rule's fix" if item.name in still else None)
            item = replace(item, healed=error is None, heal_error=error)
        unsafe.append(item)
    return SentinelReport(after.summary, tuple(unsafe))  # its counts and time are the second walk's
