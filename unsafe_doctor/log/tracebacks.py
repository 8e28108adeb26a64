"""One rank's clean lines -> Python traceback records.

Parses the text Python prints (there is no stdlib parser for it), including chained exceptions,
3.11+ position markers (kept as each frame's `Marker`), repeated-frame notes, frames without
source, truncated tracebacks, and torch_npu's error-code suffix (`ERR00003 PTA invalid value`,
`[ERROR] <time> (PID:…, Device:…, RankID:…)`) and its C++ `frame #N:` stack, which is skipped.

One pass: each line is classified by cheap prefix tests and anchored regexes, then an assembler
builds one traceback block at a time. Rules for text that Python alone does not disambiguate:

- Foreign lines: the same rank may log a line in the middle of a traceback. Up to
  `_FOREIGN_LINES_TOLERATED` consecutive lines that are not traceback syntax are skipped when a
  frame or the exception line follows; more end the block. A line that looks like an exception
  line (`Epoch: 3`) but is followed by a frame was foreign too (Python prints no frame after the
  exception line) and is dropped under the same limit.
- Multi-line messages: lines after the exception line are held. They join the message when the
  message ends the way Python ends one: a blank line, a chain separator, torch_npu's suffix or C++
  stack, or the end of the input. When a new traceback starts right after them they are dropped
  as foreign: that is how `logger.exception("msg")` output looks once prefixes are stripped.
  Python 3.11 notes (`add_note`) are printed after the message and end up in it.
- torch_npu's `[ERROR] … ERRnnnnn` line (own line, or joined to the message line) and the compact
  `ERRnnnnn PTA …` line are the last line of PTA's message; they fill `error_code`, `npu_rank`,
  `device` (None for the -1 torch_npu prints when unset) and close the message. Only C++ stack
  lines (`Exception raised from …`, `frame #N: …`) may follow; they are skipped.
- Incomplete blocks are kept with `truncated=True`: header without frames, frames without header,
  or no exception line (then `exception_type` and `message` are ''). Frames with neither header
  nor exception line (`traceback.print_stack`, logging's `stack_info`) are not an exception and
  are dropped. An exception line with no frames and no header (an "orphan", e.g. MindIO printing
  only the exception) is not a traceback, unless a chain separator joins it to one: Python prints
  a cause that was never raised exactly that way.
- Position markers (3.11+): the `~` / `^` line right under a frame's source line says which part
  of it raised. Python prints the source line without its indentation and the markers indented
  the same way, so their columns are counted from the source line's own indentation in the log
  (a rank prefix shifts both alike). A marker line that does not fit under its source line (a
  mangled or cut log) is skipped. Python prints markers for the printed line only: for a
  statement over several lines (3.11, 3.12) they stop at its end; 3.13 prints further lines
  (their middle as `...<N lines>...`) with their own markers, or the whole statement without
  markers; those lines are skipped, so a frame's source is always the statement's first line.
- A chain separator with no link above it (the excerpt starts there) still sets `chain_kind`
  on the next link; its `caused_by` is then None.
- Exception groups (3.11+): the group's own traceback (`  | `-prefixed, under
  `+ Exception Group Traceback`) is parsed as a normal one with its `ExceptionGroup: …` line; the
  sub-exception sections (`+-+---- 1 ----` and deeper) are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum, auto
from typing import Literal

from unsafe_doctor.log.lines import LogLine


@dataclass(frozen=True, slots=True)
class Marker:
    """Which part of a frame's printed source line raised: Python 3.11+'s `~~~^~~~` / `^^^^` line.

    Columns count characters of `Frame.source` (the line as printed, without indentation); ends
    are exclusive. `primary` is the `^` run: the operator of a binary operation, the index of a
    subscript, the whole call (3.11, 3.12) or its arguments (3.13, which marks the callee `~`); the
    `~` runs around it are the operands."""

    start: int
    end: int
    primary: tuple[int, int]


@dataclass(frozen=True, slots=True)
class Frame:
    file: str
    line: int | None
    function: str
    source: str | None  # the printed source line, stripped; None when the log has none
    marker: Marker | None = None  # None when the log printed no position markers for it


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
        chain: list[Traceback] = []
        current: Traceback | None = self
        while current is not None:
            chain.append(current)
            current = current.caused_by
        return chain


def parse_tracebacks(lines: Sequence[LogLine]) -> list[Traceback]:
    """All tracebacks in one rank's lines, in log order; each chain is returned once (its last link)."""
    assembler = _Assembler()
    for line in _outside_group_sections(lines):
        assembler.feed(line)
    return assembler.finish()


_FOREIGN_LINES_TOLERATED = 3
"""Consecutive foreign lines a traceback may contain; a real interleaved log line is one or two."""

_HEADER = re.compile(r"(?:Original |Exception Group )?Traceback \(most recent call last\):")
_SEPARATORS: dict[str, Literal["cause", "context"]] = {
    "The above exception was the direct cause of the following exception:": "cause",
    "During handling of the above exception, another exception occurred:": "context",
}
# Numbers read are at most nine digits: a longer run is no line or rank (and `int` refuses 4,300 digits).
_FRAME = re.compile(r'File "(?P<file>.*)", line (?P<line>\d{1,9}|None), in (?P<function>.*)')
_SYNTAX_ERROR_LOCATION = re.compile(r'File ".*", line \d+')  # SyntaxError's own location, no frame
_MARKER = re.compile(r"[~^][~^ ]*|\[Previous line repeated \d+ more times?\]")
_PRIMARY = re.compile(r"\^[\^ ]*\^|\^")
_EXCEPTION = re.compile(r"(?P<type>[^\W\d][\w.<>]*)(?:: (?P<message>.*)|:? *)")
_NPU_ERROR = re.compile(
    r"\[ERROR\] [0-9\-\:]* \(PID:\d*, Device:(?P<device>-?\d{0,9}), RankID:(?P<rank>-?\d{0,9})\) (?P<code>ERR\d{5})"
)
_NPU_COMPACT_ERROR = re.compile(r"(?P<code>ERR\d{5}) [A-Z]+\b")
_CPP_STACK = re.compile(r"Exception raised from .* \(most recent call first\):|frame #\d+: ")
_GROUP_HEADER = re.compile(r"(?P<indent> *)\+ Exception Group Traceback \(most recent call last\):")


class _Kind(Enum):
    BLANK = auto()
    HEADER = auto()
    SEPARATOR = auto()
    FRAME = auto()
    SKIPPED = auto()  # caret markers, "[Previous line repeated …]", SyntaxError's location line
    INDENTED = auto()  # a frame's source line, or text inside a message
    NPU_ERROR = auto()
    CPP_STACK = auto()
    EXCEPTION = auto()  # shaped like `Type: message` / `Type`; context decides whether it is one
    OTHER = auto()


def _classify(text: str) -> tuple[_Kind, re.Match[str] | None]:
    stripped = text.strip()
    if not stripped:
        return _Kind.BLANK, None
    if stripped.startswith('File "'):
        if match := _FRAME.fullmatch(stripped):
            return _Kind.FRAME, match
        if _SYNTAX_ERROR_LOCATION.fullmatch(stripped):
            return _Kind.SKIPPED, None
    if stripped.endswith("(most recent call last):") and _HEADER.fullmatch(stripped):
        return _Kind.HEADER, None
    if stripped in _SEPARATORS:
        return _Kind.SEPARATOR, None
    if text[0].isspace():
        return (_Kind.SKIPPED if _MARKER.fullmatch(stripped) else _Kind.INDENTED), None
    if text.startswith("[ERROR]") and (match := _NPU_ERROR.match(text)):
        return _Kind.NPU_ERROR, match
    if text.startswith("ERR") and (match := _NPU_COMPACT_ERROR.match(text)):
        return _Kind.NPU_ERROR, match
    if text.startswith(("Exception raised from ", "frame #")) and _CPP_STACK.match(text):
        return _Kind.CPP_STACK, None
    if match := _EXCEPTION.fullmatch(text):
        return _Kind.EXCEPTION, match
    return _Kind.OTHER, None


def _outside_group_sections(lines: Iterable[LogLine]) -> Iterator[LogLine]:
    """Unwrap an exception group's own `  | ` lines and drop its sub-exception sections."""
    group_indent: str | None = None
    for line in lines:
        text = line.text
        if group_indent is not None:
            own = group_indent + "|"
            if text.startswith(own):
                yield LogLine(line.rank, text[len(own) + 1 :], line.source, line.offset)
                continue
            nested = text[len(group_indent) :]
            if text.startswith(group_indent) and (nested.startswith("+-") or nested.lstrip().startswith(("|", "+"))):
                continue
            group_indent = None
        if match := _GROUP_HEADER.fullmatch(text):
            group_indent = match["indent"]
            yield LogLine(line.rank, "Exception Group Traceback (most recent call last):", line.source, line.offset)
            continue
        yield line


class _Phase(Enum):
    FRAMES = auto()  # header seen or frames coming; no exception line yet
    MESSAGE = auto()  # exception line seen; following lines may continue its message
    CPP_TAIL = auto()  # torch_npu suffix or C++ stack seen; only C++ stack lines may follow


@dataclass
class _Block:
    """A traceback being assembled."""

    first: LogLine
    has_header: bool
    caused_by: Traceback | None
    chain_kind: Literal["cause", "context"] | None
    phase: _Phase = _Phase.FRAMES
    frames: list[Frame] = field(default_factory=list)
    source_open: bool = False  # the last frame may still receive its source line
    marker_indent: int | None = None  # the last line was the last frame's source line, indented this much
    foreign: int = 0  # foreign lines since the last frame
    exception_type: str | None = None
    message: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)  # lines after the exception line, not yet known to be message
    error_code: str | None = None
    npu_rank: int | None = None
    device: int | None = None

    def add_frame(self, match: re.Match[str]) -> None:
        line = None if match["line"] == "None" else int(match["line"])
        self.frames.append(Frame(match["file"], line, match["function"], None))
        self.source_open = True
        self.marker_indent = None
        self.foreign = 0

    def add_source(self, text: str) -> None:
        source = text.strip()
        self.frames[-1] = replace(self.frames[-1], source=source)
        self.source_open = False
        self.marker_indent = len(text) - len(text.lstrip())

    def add_marker(self, text: str) -> None:
        """Keep the marker line right under a source line, when it fits under that line."""
        indent, self.marker_indent = self.marker_indent, None
        source = self.frames[-1].source if self.frames else None  # a marker line right after the header
        stripped = text.strip()
        if indent is None or source is None or not stripped.startswith(("~", "^")):
            return
        start = len(text) - len(text.lstrip()) - indent
        end = start + len(stripped)
        primary = _PRIMARY.search(stripped)
        if start < 0 or end > len(source) or primary is None:
            return
        marker = Marker(start, end, (start + primary.start(), start + primary.end()))
        self.frames[-1] = replace(self.frames[-1], marker=marker)

    def set_exception(self, match: re.Match[str]) -> None:
        self.exception_type = match["type"]
        self.phase = _Phase.MESSAGE
        message, npu_error = _split_npu_error(match["message"] or "")
        self.message = [message]
        if npu_error is not None:
            self.end_message(npu_error)

    def add_message_line(self, text: str) -> None:
        """A line after the exception line: held until it is known to belong to the message."""
        text, npu_error = _split_npu_error(text)
        if text or npu_error is None:
            self.held.append(text)
        if npu_error is not None:
            self.end_message(npu_error)

    def end_message(self, npu_error: re.Match[str] | None) -> None:
        """PTA's suffix or c10's C++ stack follows the whole message: what was held belongs to it."""
        self.message += self.held
        self.held = []
        self.phase = _Phase.CPP_TAIL
        if npu_error is not None and self.error_code is None:
            self.error_code = npu_error["code"]
            self.device = _known_id(npu_error.groupdict().get("device"))
            self.npu_rank = _known_id(npu_error.groupdict().get("rank"))

    def retract_exception(self) -> None:
        """The exception line and what followed were foreign lines: frames go on."""
        self.exception_type = None
        self.message, self.held = [], []
        self.phase = _Phase.FRAMES

    def is_orphan(self) -> bool:
        return not self.has_header and not self.frames and self.chain_kind is None

    def build(self) -> Traceback:
        return Traceback(
            rank=self.first.rank,
            source=self.first.source,
            offset=self.first.offset,
            frames=tuple(self.frames),
            exception_type=self.exception_type or "",
            message="\n".join(self.message),
            error_code=self.error_code,
            npu_rank=self.npu_rank,
            device=self.device,
            truncated=self.has_header != bool(self.frames) or self.exception_type is None,
            caused_by=self.caused_by,
            chain_kind=self.chain_kind,
        )


def _split_npu_error(text: str) -> tuple[str, re.Match[str] | None]:
    """Cut torch_npu's `[ERROR] …` suffix off a line the launcher joined it to."""
    npu_error = _NPU_ERROR.search(text) if "[ERROR]" in text else None
    if npu_error is None:
        return text, None
    return text[: npu_error.start()].rstrip(), npu_error


def _carried(match: re.Match[str] | None) -> re.Match[str]:
    """The match `_classify` returns with every FRAME, EXCEPTION and NPU_ERROR line."""
    assert match is not None, "a frame or exception line is classified with its match"
    return match


def _known_id(text: str | None) -> int | None:
    """torch_npu prints -1 (or nothing) when RANK or the device is unset."""
    return int(text) if text and not text.startswith("-") else None


class _Assembler:
    """Feeds lines into the current block; keeps each finished link until it is known whether a
    chain separator makes it the `caused_by` of the next one."""

    def __init__(self) -> None:
        self.tracebacks: list[Traceback] = []
        self.block: _Block | None = None
        self.previous: Traceback | None = None
        self.previous_is_orphan = False
        self.chain_kind: Literal["cause", "context"] | None = None  # set by a separator after `previous`
        self.foreign_after_separator = 0

    def feed(self, line: LogLine) -> None:
        kind, match = _classify(line.text)
        if self.block is not None and self._continue_block(self.block, line, kind, match):
            return
        self._between_blocks(line, kind, match)

    def finish(self) -> list[Traceback]:
        if self.block is not None:
            self._close_block(self.block, keep_held=True)
        self._emit_previous()
        return self.tracebacks

    def _continue_block(self, block: _Block, line: LogLine, kind: _Kind, match: re.Match[str] | None) -> bool:
        """Add the line to the block; False when the line ends the block and is not part of it."""
        if block.phase is _Phase.FRAMES:
            return self._frames_line(block, line, kind, match)
        if block.phase is _Phase.MESSAGE:
            return self._message_line(block, line, kind, match)
        if kind is _Kind.CPP_STACK:
            return True
        if kind is _Kind.NPU_ERROR:
            block.end_message(match)
            return True
        self._close_block(block, keep_held=True)
        return kind is _Kind.BLANK

    def _frames_line(self, block: _Block, line: LogLine, kind: _Kind, match: re.Match[str] | None) -> bool:
        if kind is _Kind.FRAME:
            block.add_frame(_carried(match))
        elif kind is _Kind.EXCEPTION:
            block.set_exception(_carried(match))
        elif kind in (_Kind.HEADER, _Kind.SEPARATOR):
            self._close_block(block, keep_held=True)
            return False
        elif kind is _Kind.SKIPPED:
            block.source_open = False
            block.add_marker(line.text)
        elif kind is _Kind.INDENTED and block.foreign == 0:
            if block.source_open:
                block.add_source(line.text)
            else:
                block.marker_indent = None
        else:
            block.foreign += 1
            block.source_open = False
            block.marker_indent = None
            if block.foreign > _FOREIGN_LINES_TOLERATED:
                self._close_block(block, keep_held=True)
                return False
        return True

    def _message_line(self, block: _Block, line: LogLine, kind: _Kind, match: re.Match[str] | None) -> bool:
        if kind is _Kind.BLANK:
            self._close_block(block, keep_held=True)
            return True
        if kind is _Kind.SEPARATOR:
            self._close_block(block, keep_held=True)
            return False
        if kind is _Kind.HEADER:
            self._close_block(block, keep_held=False)
            return False
        if kind is _Kind.FRAME:
            if block.foreign + 1 + len(block.held) > _FOREIGN_LINES_TOLERATED:
                self._close_block(block, keep_held=False)
                return False
            block.retract_exception()
            if not block.frames and not block.has_header:
                block.first = line
            block.add_frame(_carried(match))
        elif kind is _Kind.NPU_ERROR:
            block.end_message(match)
        elif kind is _Kind.CPP_STACK:
            block.end_message(None)
        else:
            block.add_message_line(line.text)
        return True

    def _between_blocks(self, line: LogLine, kind: _Kind, match: re.Match[str] | None) -> None:
        if kind is _Kind.BLANK:
            return
        if kind is _Kind.SEPARATOR:
            self.chain_kind = _SEPARATORS[line.text.strip()]
            self.previous_is_orphan = False  # a chain makes an exception-only link legitimate
            self.foreign_after_separator = 0
            return
        if kind in (_Kind.HEADER, _Kind.FRAME, _Kind.EXCEPTION):
            self._start_block(line, kind, match)
            return
        if self.chain_kind is not None:
            self.foreign_after_separator += 1
            if self.foreign_after_separator <= _FOREIGN_LINES_TOLERATED:
                return
        self._emit_previous()

    def _start_block(self, line: LogLine, kind: _Kind, match: re.Match[str] | None) -> None:
        if self.chain_kind is None:
            self._emit_previous()
        block = _Block(line, kind is _Kind.HEADER, self.previous, self.chain_kind)
        self.previous, self.chain_kind = None, None
        if kind is _Kind.FRAME:
            block.add_frame(_carried(match))
        elif kind is _Kind.EXCEPTION:
            block.set_exception(_carried(match))
        self.block = block

    def _close_block(self, block: _Block, *, keep_held: bool) -> None:
        self.block = None
        if keep_held:
            block.message += block.held
        if block.exception_type is None and not block.has_header and block.chain_kind is None:
            return  # frames only: a printed stack, not an exception
        self.previous = block.build()
        self.previous_is_orphan = block.is_orphan()

    def _emit_previous(self) -> None:
        if self.previous is not None and not self.previous_is_orphan:
            self.tracebacks.append(self.previous)
        self.previous, self.chain_kind = None, None
