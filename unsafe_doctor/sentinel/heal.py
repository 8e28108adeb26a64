"""Heal in the repair: the faulty rank fetches each unsafe scenario-2 global from its replica, by path.

MindIO pairs a faulty rank with replicas that hold the same shard (the same tensor- and
pipeline-parallel coordinates, another data-parallel copy), so state that every data-parallel copy
keeps alike is the same object, at the same path of the sentinel's walk, on both ranks. The block
``sentinel install --mode heal`` writes at the end of the receive function calls ``receive_state``;
the one at the end of the send function calls ``send_state``. Each (replica, faulty rank) pair of
MindIO's lists then talks once, in four steps:

1. hello, both at once: a fixed-size header (magic, version, entries asked, bytes of the request),
   sent and received together, so that neither side waits on the other to begin;
2. the request: the paths of the unsafe device tensors of every global a rule (shipped, or the
   user's ``rules``) puts in scenario 2, each with the shape and dtype it has here (JSON);
3. the answer: one status per path: sent, not found on the replica, differs in shape or dtype,
   unsafe there too, or host memory the group cannot send;
4. the tensors marked sent, in order: received into fresh memory, then copied in (``copy_``), which
   makes the whole block safe.

A faulty rank asks its first replica for everything and a later one only for what was not sent, so
every replica gets one request (possibly empty). Every wait is bounded (``STEP_SECONDS``, and
``BUDGET_SECONDS`` for one call), well inside MindIO's limit for a callback
(``TTP_NORMAL_ACTION_TIME_LIMIT``, 180 s by default): a peer that does not answer ends the heal
there, and the rollback's sentinel finds what is left. What is never copied: a global no rule
names, one a rule puts in scenario 1 (the rollback re-initialises it), lru caches, and tensors the
step writes before reading. Nothing here raises into the job: every outcome is logged, one line per
global on each side (``log.sentinel_lines``), which ``diagnose`` reads.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

import torch
import torch.distributed as dist

from unsafe_doctor.log.sentinel_lines import REPAIR_FAILED_LINE, Served, UnsafeGlobal, format_line
from unsafe_doctor.npu.backend import UnsafeBackend
from unsafe_doctor.sentinel import DEFAULT_LIMITS, FRAMEWORK_PACKAGES, chosen_backend, unsafe_holders
from unsafe_doctor.sentinel import verdict as verdicts
from unsafe_doctor.sentinel.walk import Found, HolderName, walk

STEP_SECONDS = 30.0  # one wait on the peer
BUDGET_SECONDS = 90.0  # one call, all peers: half MindIO's default limit for a callback
MAGIC = 0x55444845  # "UDHE": a header from this protocol, not from another transfer on the group
VERSION = 1
logger = logging.getLogger("unsafe_doctor.sentinel")


class ReplicaAnswer(IntEnum):
    """The replica's answer for one path."""

    SENT = 0
    NOT_FOUND = 1
    DIFFERS = 2
    UNSAFE_THERE = 3
    HOST = 4


WHY = {
    ReplicaAnswer.NOT_FOUND: "the replica holds no tensor at this path",
    ReplicaAnswer.DIFFERS: "the replica's tensor differs in shape or dtype: not the same state, never copied",
    ReplicaAnswer.UNSAFE_THERE: "the replica's tensor is unsafe too",
    ReplicaAnswer.HOST: "the replica's tensor is in host memory, which this group does not send",
}


class _Silent(Exception):
    """The peer did not answer within the bound; the heal stops here."""


@dataclass(frozen=True)
class _Link:
    """One pair's exchange: the repair group, the other rank, where the protocol's own tensors live
    (the host for a gloo group, else the device), and when the heal began (its budget)."""

    group: object
    peer: int
    device: torch.device
    started: float

    def hello(self, count: int, size: int) -> tuple[int, int]:
        """The fixed-size header, sent and received at once; the peer's (entries, bytes)."""
        outgoing = torch.tensor([MAGIC, VERSION, count, size], dtype=torch.int64, device=self.device)
        incoming = torch.zeros(4, dtype=torch.int64, device=self.device)
        sent = self._started(dist.isend, outgoing, "hello")
        received = self._started(dist.irecv, incoming, "hello")
        self._wait(received, "hello")
        self._wait(sent, "hello")
        magic, version, peer_count, peer_size = incoming.tolist()
        if magic != MAGIC or version != VERSION:
            raise _Silent(f"rank {self.peer} answered with no heal of version {VERSION} (header {magic:#x}, version {version})")
        return peer_count, peer_size

    def send(self, tensor: torch.Tensor, what: str) -> None:
        self._wait(self._started(dist.isend, tensor, what), what)

    def receive(self, tensor: torch.Tensor, what: str) -> None:
        self._wait(self._started(dist.irecv, tensor, what), what)

    def _started(self, transfer: Callable[..., object], tensor: torch.Tensor, what: str) -> object:
        """The transfer's work; a peer gone (its connection closed) is silent too."""
        try:
            return transfer(tensor, self.peer, group=self.group)
        except Exception as error:  # noqa: BLE001 - gloo raises at once where the peer's process ended
            raise _Silent(f"the {what} could not reach rank {self.peer} ({type(error).__name__}: {_first_line(error)})") from None

    def _wait(self, work: object, what: str) -> None:
        left = min(STEP_SECONDS, BUDGET_SECONDS - (time.monotonic() - self.started))
        if left <= 0:
            raise _Silent(f"the heal's {BUDGET_SECONDS:g} s were spent before the {what} with rank {self.peer}")
        try:
            work.wait(timeout=datetime.timedelta(seconds=left))  # type: ignore[attr-defined]
        except Exception as error:  # noqa: BLE001 - gloo and HCCL raise on a timeout; a closed pair raises too
            said = f"{type(error).__name__}: {_first_line(error)}"
            raise _Silent(f"the {what} with rank {self.peer} did not complete within {left:.0f} s ({said})") from None


@dataclass
class _Answers:
    """What the replicas answered the faulty rank, path by path."""

    sent_by: dict[str, int] = field(default_factory=dict)  # path -> the replica that sent it
    refused: dict[str, str] = field(default_factory=dict)  # path -> why the last replica asked did not
    stopped: str | None = None  # why an exchange ended early


@dataclass(frozen=True)
class _Asked:
    """One unsafe scenario-2 global on the faulty rank, and its unsafe device tensors."""

    holder: HolderName
    judged: verdicts.SentinelVerdict
    found: tuple[Found, ...]


def receive_state(
    group: object,
    src_ranks: object,
    dest_ranks: object,
    *roots: object,
    rules: Sequence[str | Path] = (),
    packages: Iterable[str] | None = None,
    backend: UnsafeBackend | None = None,
) -> tuple[UnsafeGlobal, ...]:
    """On the faulty rank, at the end of the receive function: each unsafe scenario-2 global copied
    from the replicas in MindIO's pairs whose destination is this rank; one record per global (healed
    from which rank, or why not), each also logged. Never raises."""
    started = time.monotonic()
    packages = _packages(packages)
    try:
        chosen = backend if backend is not None else chosen_backend()[0]
        rank = dist.get_rank()
        sources = dict.fromkeys(source for source, destination in _pairs(src_ranks, dest_ranks) if destination == rank)
        try:
            asked = _unsafe_scenario_2(roots, packages, rules, chosen) if chosen is not None else []
        except Exception:  # noqa: BLE001 - a walk that fails still asks (an empty list): the replica must not wait
            asked = []
        pending = {found.path: (item, found) for item in asked for found in item.found}
        answers = _Answers()
        for source in sources:  # every replica asked once: the first for all, a later one for what is left
            try:
                said = _ask(_Link(group, source, _device(group, chosen), started), list(pending.values()))
            except _Silent as silent:
                answers.stopped = str(silent)
                continue
            for path, status in said.items():
                if status is ReplicaAnswer.SENT:
                    answers.sent_by[path] = source
                    del pending[path]
                else:
                    answers.refused[path] = f"rank {source}: {WHY[status]}"
        records = tuple(_record(item, answers, rank=rank, backend=chosen) for item in asked)
    except Exception as error:  # noqa: BLE001 - the repair goes on: the rollback's sentinel finds what is left
        logger.warning(REPAIR_FAILED_LINE, _rank(), error)
        return ()
    for record in records:
        logger.warning(format_line(record))
    return records


def send_state(
    group: object,
    src_ranks: object,
    dest_ranks: object,
    *roots: object,
    packages: Iterable[str] | None = None,
    backend: UnsafeBackend | None = None,
) -> tuple[Served, ...]:
    """On a replica, at the end of the send function: each faulty rank of MindIO's pairs whose
    source is this rank is answered once, the paths it asks resolved in this process; one record
    per global asked (what was sent, or why not), each also logged. Never raises."""
    started = time.monotonic()
    packages = _packages(packages)
    records: list[Served] = []
    try:
        chosen = backend if backend is not None else chosen_backend()[0]
        rank = dist.get_rank()
        destinations = dict.fromkeys(destination for source, destination in _pairs(src_ranks, dest_ranks) if source == rank)
        here: dict[str, torch.Tensor] | None = None  # path -> tensor, walked once, when the first request asks anything
        for destination in destinations:
            link = _Link(group, destination, _device(group, chosen), started)
            try:
                request = _requested(link)
                if request and here is None:
                    here = _tensors_here(roots, packages)
                records.extend(_answer(link, request, here or {}, rank=rank, backend=chosen))
            except _Silent as silent:  # this faulty rank is not answered; the others may still be
                records.append(Served(rank, chosen.name if chosen is not None else "none", destination, None, 0, str(silent)))
    except Exception as error:  # noqa: BLE001 - the repair goes on
        logger.warning(REPAIR_FAILED_LINE, _rank(), error)
    for record in records:
        logger.warning(format_line(record))
    return tuple(records)


# --- the faulty rank's side ------------------------------------------------------------------------


def _unsafe_scenario_2(
    roots: Sequence[object], packages: Iterable[str], rules: Sequence[str | Path], backend: UnsafeBackend
) -> list[_Asked]:
    """The unsafe globals a rule puts in scenario 2 (not lru caches, not written by the step first);
    where no rule names a holder, the class attributes that hold its tensors themselves are asked
    (an fp16 optimizer's `grad_scaler`: `DynamicGradScaler._scale` is what a rule names)."""
    found = walk(roots, packages, DEFAULT_LIMITS)
    unsafe = {holder: items for holder, items in unsafe_holders(found, backend)[0].items() if holder not in found.caches}
    if not unsafe:
        return []
    paths = [Path(rule) for rule in rules]
    judged = verdicts.verdicts({holder: found.aliases.get(holder, []) for holder in unsafe}, found.caches, paths)
    inner: dict[HolderName, list[Found]] = {}
    for holder, items in unsafe.items():
        if judged[holder] == verdicts.NO_RULE:
            for item in items:
                if item.named is not None:
                    inner.setdefault(item.named, []).append(item)
    by_name = verdicts.verdicts(dict.fromkeys(inner, ()), found.caches, paths) if inner else {}
    named = [(holder, judged[holder], items) for holder, items in unsafe.items()]
    named += [(name, by_name[name], items) for name, items in inner.items()]
    return [
        _Asked(holder, judged_one, tuple(items))
        for holder, judged_one, items in named
        if judged_one.scenario == 2 and judged_one.written_by_step is None
    ]


def _ask(link: _Link, pending: list[tuple[_Asked, Found]]) -> dict[str, ReplicaAnswer]:
    """One request: the paths still pending, each answered; those sent are copied in."""
    request = [
        {"path": found.path, "shape": list(found.tensor.shape), "dtype": str(found.tensor.dtype), "global": item.holder.dotted}
        for item, found in pending
    ]
    payload = json.dumps(request).encode()
    link.hello(len(request), len(payload))
    if not request:
        return {}
    link.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(link.device), "request")
    statuses = torch.empty(len(request), dtype=torch.int64, device=link.device)
    link.receive(statuses, "answer")
    said = {}
    for (_, found), code in zip(pending, statuses.tolist(), strict=True):
        status = ReplicaAnswer(code) if code in ReplicaAnswer._value2member_map_ else ReplicaAnswer.NOT_FOUND
        if status is ReplicaAnswer.SENT:
            fresh = torch.empty(found.tensor.shape, dtype=found.tensor.dtype, device=found.tensor.device)
            link.receive(fresh, f"tensor at {found.path}")
            found.tensor.copy_(fresh)  # writes the whole block: safe again
        said[found.path] = status
    return said


def _record(asked: _Asked, answers: _Answers, *, rank: int, backend: UnsafeBackend | None) -> UnsafeGlobal:
    """Healed from the replica that sent its last tensor, when every one was sent and checks safe
    after; else why not (the first refusal, the silence that ended an exchange, or no replica)."""
    paths = [found.path for found in asked.found]
    source = answers.sent_by.get(paths[-1]) if all(path in answers.sent_by for path in paths) else None
    healed = source is not None and backend is not None and all(backend.is_safe(found.tensor) for found in asked.found)
    error = None
    if source is not None and not healed:
        error = "tensors still unsafe after the copy from the replica"
    elif not healed:
        refused = next((answers.refused[path] for path in paths if path in answers.refused), None)
        error = refused or answers.stopped or "no replica in MindIO's pairs sends to this rank"
    judged = asked.judged
    return UnsafeGlobal(
        rank,
        backend.name if backend is not None else "none",
        asked.holder,
        len(asked.found),
        tuple(paths),
        judged.scenario,
        judged.rule,
        judged.fix_function,
        healed=healed,
        heal_error=error,
        healed_from=source if healed else None,
    )


# --- the replica's side ----------------------------------------------------------------------------


def _requested(link: _Link) -> list[dict[str, object]]:
    """The faulty rank's request: the paths it asks, each with its shape, dtype and global there."""
    count, size = link.hello(0, 0)
    if not count:
        return []
    payload = torch.empty(size, dtype=torch.uint8, device=link.device)
    link.receive(payload, "request")
    try:
        request = json.loads(bytes(payload.cpu().tolist()).decode())
    except (ValueError, UnicodeDecodeError):
        request = []
    entries = [entry if isinstance(entry, dict) else {} for entry in request] if isinstance(request, list) else []
    return (entries + [{}] * count)[:count]  # as many answers as it counted, whatever it sent


def _tensors_here(roots: Sequence[object], packages: Iterable[str]) -> dict[str, torch.Tensor]:
    try:
        return {found.path: found.tensor for found in walk(roots, packages, DEFAULT_LIMITS).tensors}
    except Exception:  # noqa: BLE001 - nothing found: every path is answered "not found"
        return {}


def _answer(
    link: _Link, request: list[dict[str, object]], here: dict[str, torch.Tensor], *, rank: int, backend: UnsafeBackend | None
) -> list[Served]:
    """The statuses, then each tensor marked sent; one record per global asked, in the request's order."""
    if not request:
        return []
    statuses = [_status(entry, here, link.device, backend) for entry in request]
    link.send(torch.tensor([int(status) for status in statuses], dtype=torch.int64, device=link.device), "answer")
    per_global: dict[str, list[ReplicaAnswer]] = {}
    for entry, status in zip(request, statuses, strict=True):
        if status is ReplicaAnswer.SENT:
            tensor = here[str(entry["path"])]
            link.send(tensor if tensor.is_contiguous() else tensor.contiguous(), "tensor")
        per_global.setdefault(str(entry.get("global", "?"))[:300], []).append(status)
    name = backend.name if backend is not None else "none"
    return [
        Served(
            rank,
            name,
            link.peer,
            dotted,
            sum(status is ReplicaAnswer.SENT for status in said),
            next((WHY[status] for status in said if status is not ReplicaAnswer.SENT), None),
        )
        for dotted, said in per_global.items()
    ]


def _status(
    entry: dict[str, object], here: dict[str, torch.Tensor], device: torch.device, backend: UnsafeBackend | None
) -> ReplicaAnswer:
    tensor = here.get(str(entry.get("path")))
    if tensor is None:
        return ReplicaAnswer.NOT_FOUND
    if list(tensor.shape) != entry.get("shape") or str(tensor.dtype) != entry.get("dtype"):
        return ReplicaAnswer.DIFFERS
    if tensor.device.type != device.type:
        return ReplicaAnswer.HOST
    if backend is not None and not backend.is_safe(tensor):
        return ReplicaAnswer.UNSAFE_THERE
    return ReplicaAnswer.SENT


# --- what both sides share -------------------------------------------------------------------------


def _pairs(src_ranks: object, dest_ranks: object) -> list[tuple[int, int]]:
    """MindIO's (source, destination) pairs: parallel lists (one entry per optimizer index), or two ranks."""
    sources = list(src_ranks) if isinstance(src_ranks, (list, tuple)) else [src_ranks]
    destinations = list(dest_ranks) if isinstance(dest_ranks, (list, tuple)) else [dest_ranks]
    return [(int(source), int(destination)) for source, destination in zip(sources, destinations, strict=False)]  # type: ignore[call-overload]


def _device(group: object, backend: UnsafeBackend | None) -> torch.device:
    """Where the protocol's own tensors live: the host for a gloo group, else the backend's device."""
    if backend is None or dist.get_backend(group) == "gloo":  # type: ignore[arg-type]
        return torch.device("cpu")
    return backend.device


def _packages(packages: Iterable[str] | None) -> tuple[str, ...]:
    """The frameworks' packages and the one of the adaptor that called (two frames up), as ``check`` walks."""
    if packages is not None:
        return tuple(packages)
    return (*FRAMEWORK_PACKAGES, sys._getframe(2).f_globals.get("__name__", "").partition(".")[0])


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [""])[0][:160]


def _rank() -> str:
    try:
        return str(dist.get_rank())
    except Exception:  # noqa: BLE001 - no group: the line says "?"
        return "?"
