"""Stage 3: one rank's clean lines -> Python traceback records.

Parses the text Python prints (there is no stdlib parser for it), including chained exceptions,
3.11+ caret lines, repeated-frame notes, frames without source, truncated tracebacks, and torch_npu's
error-code suffix (`ERR00003 PTA invalid value`, `[ERROR] <time> (PID:…, Device:…, RankID:…)`)
and its C++ `frame #N:` stack, which is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from unsafe_doctor.logs import LogLine


@dataclass(frozen=True, slots=True)
class Frame:
    file: str
    line: int | None
    function: str
    source: str | None  # the printed source line, stripped; None when the log has none


@dataclass(frozen=True)
class Traceback:
    rank: int | None
    source: str  # input name
    offset: int  # byte offset of the traceback's first line in that input (log order)
    frames: tuple[Frame, ...]  # outermost first, as Python prints them; C++ frames excluded
    exception_type: str  # as printed: 'RuntimeError', 'torch.distributed.DistBackendError'
    message: str  # without torch_npu's error-code suffix lines
    error_code: str | None  # 'ERR00003'
    npu_rank: int | None  # RankID from torch_npu's [ERROR] line
    device: int | None  # Device from torch_npu's [ERROR] line
    truncated: bool  # header, frames or exception line missing (log cut, window edge)
    caused_by: Traceback | None  # the exception printed above this one in a chain
    chain_kind: Literal["cause", "context"] | None  # "direct cause" / "during handling"

    def chain(self) -> list[Traceback]:
        """This exception, then the ones printed above it, innermost cause last."""
        chain, current = [], self
        while current is not None:
            chain.append(current)
            current = current.caused_by
        return chain


def parse_tracebacks(lines: Sequence[LogLine]) -> list[Traceback]:
    """All tracebacks in one rank's lines, in log order; each chain is returned once (its last link)."""
    raise NotImplementedError
