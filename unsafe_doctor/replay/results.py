"""What a rank of a replay found, as typed data that crosses process boundaries as JSON.

The harness (one process per rank) fills these; the launcher reads them back, and `verify` judges
from their fields. A rank that is killed leaves only its progress: one ``Milestone`` per line.
No torch here, so the judging side reads results without it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Blame = Literal["adaptor", "replay"]
"""Whose a rank's crash is: the adaptor's code (a fix, or the adaptor it patches, that ended its
rank), or the replay's (the harness, this machine's environment: a missing module, a process group
that does not start), which says nothing of the fix."""

FailureKind = Literal["unsafe-data", "timeout", "send-to-self", "other"]
"""How the adaptor's code failed: torch_npu's unsafe-data error, a transfer that waited past the
repair group's timeout, a send addressed to the sending rank itself, or anything else."""


@dataclass(frozen=True)
class FixFailure:
    """The adaptor's own code raised, in a replayed callback."""

    role: str  # rollback | send | recv
    function: str
    error: str  # "RuntimeError: <first line>"
    where: str | None  # the innermost frame of the user's code: file:line
    kind: FailureKind


@dataclass(frozen=True)
class StepOutcome:
    """The first step after recovery, run again for one global."""

    error: str | None = None  # first line of torch_npu's unsafe-data error; None when the step ran clean
    where: str | None = None  # file:line of the user's code that read the unsafe tensor
    unsafe_global: str | None = None  # the global it read there ("toytrain.state.LOSS_LOG"), when one is named on the line


@dataclass(frozen=True)
class RunResult:
    """One run (unpatched or patched) on one rank, by target key."""

    built: dict[str, str] = field(default_factory=dict)  # how each probe built its global
    not_modelled: dict[str, str] = field(default_factory=dict)  # why a global could not be built
    fix_failures: tuple[FixFailure, ...] = ()
    resume: dict[str, StepOutcome] = field(default_factory=dict)
    unsafe_left: dict[str, int] = field(default_factory=dict)  # faulty rank: unsafe tensors still reachable
    equal: dict[str, bool] = field(default_factory=dict)  # faulty rank, scenario 2: bytes equal the replica's
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> wall time
    adaptor_unavailable: str | None = None  # adaptor mode: why the adaptor's files could not be imported
    sentinel: tuple[str, ...] | None = None  # faulty rank: globals the sentinel names unsafe after the rollback
    alone: dict[str, str] = field(default_factory=dict)  # adaptor function -> why its own code cannot run here
    unmatched: tuple[str, ...] = ()  # faulty rank: repair transfers whose sender and receiver differ
    stood_in: tuple[str, ...] = ()  # items of train_args the adaptor's functions got as stand-ins ("train_args[2]")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        return cls(
            built=data["built"],
            not_modelled=data["not_modelled"],
            fix_failures=tuple(FixFailure(**item) for item in data["fix_failures"]),
            resume={key: StepOutcome(**value) for key, value in data["resume"].items()},
            unsafe_left=data["unsafe_left"],
            equal=data["equal"],
            seconds=data["seconds"],
            adaptor_unavailable=data["adaptor_unavailable"],
            sentinel=None if data.get("sentinel") is None else tuple(data["sentinel"]),
            alone=data.get("alone", {}),
            unmatched=tuple(data.get("unmatched", ())),
            stood_in=tuple(data.get("stood_in", ())),
        )


@dataclass(frozen=True)
class RankResult:
    """Both runs on one rank."""

    rank: int
    backend: str  # "emulated" | "npu": the one that ran
    unpatched: RunResult
    patched: RunResult
    notes: tuple[str, ...] = ()

    def run(self, name: str) -> RunResult:
        return self.patched if name == "patched" else self.unpatched

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankResult:
        data = json.loads(text)
        return cls(
            data["rank"],
            data["backend"],
            RunResult.from_dict(data["unpatched"]),
            RunResult.from_dict(data["patched"]),
            tuple(data["notes"]),
        )


@dataclass(frozen=True)
class Milestone:
    """One line of a rank's progress: the phase it entered, or the adaptor's code failing in it.
    What a launcher reads to say where a stopped rank was."""

    run: str
    phase: str  # build | fault | repair | rollback | check | resume
    function: str | None = None  # the adaptor function the phase runs on this rank
    failure: FixFailure | None = None

    def __str__(self) -> str:
        if self.failure is not None:
            return f"{self.run} {self.failure.role} {self.failure.function}() raised {self.failure.error}"
        return f"{self.run} {self.phase}" + (f" {self.function}()" if self.function else "")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Milestone:
        data = json.loads(text)
        failure = data["failure"]
        return cls(**{**data, "failure": FixFailure(**failure) if failure else None})


@dataclass(frozen=True)
class RankCrash:
    """An exception that ended a rank (not a failure of the adaptor's code, which the harness catches
    and reports as a FixFailure): what it was, where, and whose."""

    error: str  # "RuntimeError: <first line>"
    at: str | None  # the innermost frame: file:line
    where: str | None  # the innermost frame of the user's code (not torch's, not unsafe-doctor's): file:line
    blame: Blame
    time: float  # when it happened (time.time()): the first crash is the cause, the others often its echo

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankCrash:
        return cls(**json.loads(text))
