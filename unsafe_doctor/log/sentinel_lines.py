"""The sentinel's log lines: written in the training process, read back by ``diagnose``.

One line per event. Each starts with ``[unsafe-doctor sentinel]``, says what happened in words, and
ends with a JSON object whose ``schema`` is ``unsafe-doctor/sentinel/v1``::

    [unsafe-doctor sentinel] rank 3: unsafe megatron.core.utils._GLOBAL_MEMORY_BUFFER (2 tensors, ...) {"schema": ...}

The words are for people and may change; the JSON is the contract. A reader finds the schema key
anywhere in a line, so log prefixes (``[rank3]:``, timestamps, kubectl's pod names) do not matter.

Mode heal also logs from the repair (``sentinel.heal``): on the faulty rank one ``UnsafeGlobal``
per scenario-2 global it asked the replica for (``healed_from`` the replica's rank, or
``heal_error`` why not), on the replica one ``Served`` per global it was asked for.

One line has no JSON: the one the adaptor's block logs where the sentinel could not run at all
(unsafe-doctor missing or broken in the rank's Python), ``FAILED_LINE`` in the rollback and
``REPAIR_FAILED_LINE`` in the repair. The blocks write it with ``logging`` alone, so its words are
its contract (``parse_failure``); blocks written before it gave a rank say ``[unsafe-doctor
sentinel] failed, …``. No torch here: the log path imports this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal

from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.log.lines import RANK_DIGITS
from unsafe_doctor.log.sentinel_modes import SentinelMode

TAG = "[unsafe-doctor sentinel]"
SCHEMA = "unsafe-doctor/sentinel/v1"
JSON_START = '{"schema": "' + SCHEMA + '"'  # how every record's JSON begins, as `format_line` writes it
MARKER = TAG.encode()  # what the log scanner looks for
FAILED = "failed, the rollback goes on: "  # then the error's repr
REPAIR_FAILED = "failed, the repair goes on: "
FAILED_LINE = f"{TAG} rank %s: {FAILED}%r"  # as the block logs it: torchrun's RANK ("?" where unset), the error
REPAIR_FAILED_LINE = f"{TAG} rank %s: {REPAIR_FAILED}%r"  # the same, from the heal's blocks in the repair


@dataclass(frozen=True)
class UnsafeGlobal:
    """A global whose tensors are still unsafe after the recovery: the module global, class attribute
    or instance attribute (``owner`` set) that holds them, as rules name globals. Its line writes the
    name's parts as ``module``, ``owner`` and ``variable``, in its place."""

    rank: int | None
    backend: str  # "npu" or "emulated": the one that checked
    name: GlobalName[str | None, str]
    tensors: int  # unsafe tensors found behind it
    paths: tuple[str, ...]  # readable paths: every one in a report, the first few in a log line
    scenario: Literal[1, 2] | None  # what the knowledge base's rule says; None: no rule names it
    rule: str | None
    fix_function: str | None  # where the rule's fix goes (rollback function, or receive function)
    healed: bool = False  # heal mode ran the rule's fix and every tensor checked safe after it
    heal_error: str | None = None  # heal mode ran the rule's fix and it raised this, or left tensors unsafe
    cached: bool = False  # `variable` is an lru-cached function: the tensors are its cache's keys and results
    written_by_step: str | None = None  # the knowledge entry saying a step writes it before reading it: harmless
    healed_from: int | None = None  # heal mode copied every tensor from this replica rank in the repair
    event: Literal["unsafe"] = "unsafe"


@dataclass(frozen=True)
class Served:
    """On a replica, in the repair: what it sent a faulty rank of one global the faulty rank asked for
    (heal mode); `dotted` None when the exchange stopped before a request was read."""

    rank: int | None
    backend: str
    peer: int  # the faulty rank
    dotted: str | None  # the global's dotted name, as the faulty rank asked for it
    sent: int  # tensors sent
    refused: str | None  # why a tensor was not sent (the first), or why the exchange stopped
    event: Literal["served"] = "served"


@dataclass(frozen=True)
class Summary:
    """One per check: what was walked and checked, and whether the walk stopped early."""

    rank: int | None
    backend: str
    mode: SentinelMode
    tensors_checked: int
    unsafe_tensors: int
    unsafe_globals: int
    seconds: float
    stopped_early: str | None  # why the walk stopped before the end (a budget), or None
    not_walked: int = 0  # objects the walk could not read, so not checked behind them
    not_walked_first: tuple[str, ...] = ()  # the first few: "path (why)"
    event: Literal["summary"] = "summary"


@dataclass(frozen=True)
class Failure:
    """The adaptor's block could not run the sentinel: an import or call of it raised (`FAILED_LINE`)."""

    rank: int | None
    error: str  # the exception's repr, as the block logged it


Record = UnsafeGlobal | Summary | Served
_KINDS: dict[str, type[UnsafeGlobal] | type[Summary] | type[Served]] = {
    "unsafe": UnsafeGlobal,
    "summary": Summary,
    "served": Served,
}
_NAME_PARTS = ("module", "owner", "variable")  # a GlobalName's fields, as a line's JSON writes them


def format_line(record: Record) -> str:
    """The whole line: tag, words, JSON."""
    payload: dict[str, Any] = {"schema": SCHEMA}
    for field in fields(record):
        value = getattr(record, field.name)
        if isinstance(value, GlobalName):
            payload.update(zip(_NAME_PARTS, (value.module, value.owner, value.variable), strict=True))
        else:
            payload[field.name] = value
    return f"{TAG} {_words(record)} {json.dumps(payload, ensure_ascii=True)}"


def parse_line(line: str) -> Record | None:
    """The record in a line, or None when the line holds none (or a damaged one: a log is untrusted)."""
    start = line.find(JSON_START)
    if start < 0:
        return None
    try:
        payload, _end = json.JSONDecoder().raw_decode(line, start)
    except (ValueError, RecursionError):  # damaged, or nested deeper than the decoder recurses
        return None
    return _record(payload) if isinstance(payload, dict) else None


def parse_failure(line: str) -> Failure | None:
    """The block's failure in a line, or None when the line holds none; its rank None when the line
    gives none (a block written before the rank, or RANK unset)."""
    start = line.find(TAG)
    if start < 0:
        return None
    rest = line[start + len(TAG) + 1 :]
    rank = None
    if rest.startswith("rank "):
        said, _, rest = rest[len("rank ") :].partition(": ")
        rank = int(said) if said.isascii() and said.isdigit() and len(said) <= RANK_DIGITS else None
    prefix = next((prefix for prefix in (FAILED, REPAIR_FAILED) if rest.startswith(prefix)), None)
    return Failure(rank, rest.removeprefix(prefix)) if prefix is not None else None


def _record(payload: dict[str, Any]) -> Record | None:
    event = payload.get("event")
    kind = _KINDS.get(event) if isinstance(event, str) else None
    if kind is None:
        return None
    names = {field.name for field in fields(kind)}
    values = {key: value for key, value in payload.items() if key in names}
    if "name" in names:
        if not all(part in payload for part in _NAME_PARTS):  # a field missing
            return None
        values["name"] = GlobalName(*(payload[part] for part in _NAME_PARTS))
    for key in ("paths", "not_walked_first"):
        if key in values:
            values[key] = tuple(values[key]) if isinstance(values[key], list) else ()
    try:
        record = kind(**values)
    except TypeError:  # a field missing
        return None
    return record if _well_typed(record) else None


def _well_typed(record: Record) -> bool:
    """The fields a reader relies on have their types: names are strings, counts integers."""
    if not isinstance(record.rank, int | None) or isinstance(record.rank, bool) or not isinstance(record.backend, str):
        return False
    if isinstance(record, Summary):
        counts = (record.tensors_checked, record.unsafe_globals, record.not_walked)
        return all(isinstance(count, int) for count in counts) and all(isinstance(path, str) for path in record.not_walked_first)
    if isinstance(record, Served):
        texts_ok = isinstance(record.dotted, str | None) and isinstance(record.refused, str | None)
        return texts_ok and all(type(count) is int for count in (record.peer, record.sent))
    name = record.name
    names_ok = isinstance(name.variable, str) and all(isinstance(part, str | None) for part in (name.module, name.owner))
    source_ok = record.healed_from is None or type(record.healed_from) is int
    return names_ok and source_ok and record.scenario in (1, 2, None) and all(isinstance(path, str) for path in record.paths)


def _words(record: Record) -> str:
    where = f"rank {record.rank}" if record.rank is not None else "this process"
    if isinstance(record, Summary):
        checked = f"{_counted(record.tensors_checked, 'tensor')} checked"
        if record.unsafe_globals:
            unsafe = f"{_counted(record.unsafe_globals, 'unsafe global')}, {_counted(record.unsafe_tensors, 'tensor')}"
            checked = f"{unsafe}; {checked}"
        elif record.tensors_checked == 0:  # nothing is known safe: "clean" would claim it
            checked = "no tensors checked"
        else:
            checked = f"clean; {checked}"
        early = f"; stopped early: {record.stopped_early}" if record.stopped_early else ""
        unread = ""
        if record.not_walked:
            first = f", the first {record.not_walked_first[0]}" if record.not_walked_first else ""
            unread = f"; could not walk {_counted(record.not_walked, 'object')}{first}"
        return f"{where}: {checked} in {record.seconds:.2f} s ({record.backend} backend, mode {record.mode}){early}{unread}"
    if isinstance(record, Served):
        if record.dotted is None:
            return f"{where}: heal stopped with rank {record.peer}: {record.refused}"
        sent = f"sent {_counted(record.sent, 'tensor')} of {record.dotted} to rank {record.peer}"
        return f"{where}: {sent}" + (f"; not sent: {record.refused}" if record.refused else "")
    state = "healed" if record.healed else "unsafe"
    scenario = f", scenario {record.scenario}" if record.scenario else ", no rule"
    if record.written_by_step:
        scenario = f", harmless: the step writes it before reading it ({record.written_by_step})"
    tensors = _counted(record.tensors, "tensor")
    said = f"{where}: {state} {record.name.dotted} ({tensors}{scenario}, {record.backend} backend)"
    if record.healed_from is not None:
        return f"{said}, copied from rank {record.healed_from} in the repair"
    if record.heal_error and record.scenario == 2:  # the repair's heal, which asked the replica
        return f"{said}; the repair's heal did not copy it: {record.heal_error}"
    return said


def _counted(count: int, noun: str) -> str:
    number = f"{count:,}" if type(count) is int else repr(count)  # a record built from a hostile line is still written
    return f"{number} {noun}" + ("" if count == 1 else "s")
