"""Inputs (stdin, files, folders, gzip) -> the few excerpts worth parsing.

A failure log can be gigabytes of iteration lines around one traceback. Parsing every line in Python
would be far slower than `grep`, so this stage only searches bytes: it finds the unsafe-data marker
with `find` (memchr speed), cuts a window of text around each hit, and looks for recovery markers in
a bounded span before the first hit. Lines that state a setting of the run are searched backwards
(`rfind`) in the same span, or at the end of an input without a hit: only the last of each counts.
Lines that carry a record (the sentinel's, `sentinel_lines.MARKER`) are kept wherever they stand, up
to RECORD_BUDGET bytes; so are the lines of a start-up dump (the arguments Megatron prints), up to
DUMP_BUDGET bytes of their own and in each input's first DUMP_SPAN bytes, so that neither kind
crowds out the other. Everything else is never decoded. Memory stays bounded whatever the input
size: every input is read in chunks with a rolling history, and the windows kept, all inputs
together, stop at EXCERPT_BUDGET bytes (later hits are counted, not parsed). Files are read, not
memory-mapped: a log truncated while mapped would kill the process with SIGBUS, and a pipe, `<(cmd)`
or `/dev/stdin` cannot be mapped or rewound at all.

One input that cannot be read (a truncated `.gz`, a core dump in a log folder, a file that vanished)
does not stop the others: it is returned as a `SkippedInput` with its reason; only when nothing is
left to read is that an error.
"""

from __future__ import annotations

import fcntl
import gzip
import io
import os
import re
import stat
import sys
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from unsafe_doctor.errors import UsageError, os_reason


def is_regular(path: Path) -> bool:
    """A regular file (links followed): never a FIFO that would block a reader, nor a device."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


ERROR_MARKER = b"unsafe data in the input tensor"
BEFORE = 1 << 20  # bytes kept before a hit: the traceback's frames come before its message
AFTER = 256 << 10  # bytes kept after a hit: error-code lines, C++ stack, chained exceptions
CONTEXT_SPAN = 32 << 20  # how far before the first hit recovery lines are looked for
TAIL = 256 << 10  # end of an input kept when it has no hit, to tell what it ended with instead
WINDOW_MAX = 16 << 20  # one window stops growing here, so a flood of hits cannot grow it forever
EXCERPT_BUDGET = 64 << 20  # total window bytes kept; hits past it are counted, not parsed
RECORD_LINE_MAX = 64 << 10  # a record line longer than this is no line a writer of records wrote: not kept
RECORD_BUDGET = 16 << 20  # total record-line bytes kept; lines past it are counted, not kept
DUMP_BUDGET = 4 << 20  # total dump-line bytes kept: a few thousand argument lines of a few jobs
DUMP_SPAN = 64 << 20  # dumps are looked for in each input's first bytes only: a job prints them at start-up
CHUNK = 8 << 20
PIPE_SIZE = 1 << 20  # Linux's default /proc/sys/fs/pipe-max-size
LOG_SUFFIXES = (".log", ".txt", ".out")
GZIP_MAGIC = b"\x1f\x8b"

Progress = Callable[[int], None]  # called with the number of bytes just read


@dataclass(frozen=True, slots=True)
class InputInfo:
    name: str
    bytes: int  # bytes read (decompressed size for gzip)
    rank_hint: int | None  # rank from the file name or torchrun folder, when it tells one


@dataclass(frozen=True, slots=True)
class Excerpt:
    source: str  # input name
    rank_hint: int | None
    start: int  # byte offset of `text` in the (decompressed) input
    text: str  # whole lines, decoded with replacement


@dataclass(frozen=True, slots=True)
class SkippedInput:
    name: str
    reason: str  # why it was not read: "corrupt gzip data (...)", "not a text log (binary data)"


class _Unreadable(Exception):
    """One input cannot be read; the others still are."""


@dataclass(frozen=True)
class Scan:
    inputs: tuple[InputInfo, ...]
    windows: tuple[Excerpt, ...]  # text around unsafe-data hits
    context: tuple[Excerpt, ...]  # single lines holding a recovery marker, before the first hit
    tails: tuple[Excerpt, ...]  # ends of inputs without hits (only when no input has a hit)
    hits: int  # unsafe-data markers found
    hits_not_parsed: int  # hits past EXCERPT_BUDGET
    # Per input and fact marker, the last whole line holding it: before the first hit, in the span
    # searched for context; in an input without a hit, in its last BEFORE bytes.
    facts: tuple[Excerpt, ...] = ()
    skipped: tuple[SkippedInput, ...] = ()  # inputs not read, each with its reason
    records: tuple[Excerpt, ...] = ()  # every whole line holding a record marker, anywhere, in input order
    records_not_kept: int = 0  # record lines past RECORD_BUDGET, or longer than RECORD_LINE_MAX
    dumps: tuple[Excerpt, ...] = ()  # every whole line holding a dump marker, anywhere, in input order


@dataclass
class _InputScan:
    windows: list[Excerpt] = field(default_factory=list)
    context: list[Excerpt] = field(default_factory=list)
    facts: list[Excerpt] = field(default_factory=list)
    tail: Excerpt | None = None
    hits: int = 0
    hits_not_parsed: int = 0
    size: int = 0
    records: list[Excerpt] = field(default_factory=list)
    records_not_kept: int = 0
    dumps: list[Excerpt] = field(default_factory=list)


class _Budget:
    """Total window bytes still allowed across all inputs."""

    def __init__(self, total: int) -> None:
        self.left = total


@dataclass(frozen=True)
class _Reading:
    """What every reader of one input needs besides the bytes."""

    name: str
    rank_hint: int | None
    markers: Sequence[bytes]
    fact_markers: Sequence[bytes]
    budget: _Budget
    progress: Progress | None
    record_markers: Sequence[bytes] = ()
    record_budget: _Budget = field(default_factory=lambda: _Budget(RECORD_BUDGET))
    dump_markers: Sequence[bytes] = ()
    dump_budget: _Budget = field(default_factory=lambda: _Budget(DUMP_BUDGET))


def scan(
    paths: Sequence[str],
    context_markers: Sequence[bytes],
    *,
    fact_markers: Sequence[bytes] = (),
    record_markers: Sequence[bytes] = (),
    dump_markers: Sequence[bytes] = (),
    stdin: BinaryIO | None = None,
    progress: Progress | None = None,
) -> Scan:
    """Read every input once and keep only what later stages parse. No paths means stdin.

    `fact_markers` mark a setting the run logs at start-up or every step: only the latest line of
    each is worth keeping. `record_markers` mark lines that each tell something on their own
    (the sentinel's): every one is kept, wherever it stands. `dump_markers` mark the lines of a
    start-up dump (Megatron's arguments), kept the same way under a budget of their own. An input that cannot be read is
    skipped with its reason; a UsageError only when none can be.
    """
    sources = _expand(paths) if paths else [("<stdin>", None, None)]
    budget = _Budget(EXCERPT_BUDGET)
    record_budget = _Budget(RECORD_BUDGET)
    dump_budget = _Budget(DUMP_BUDGET)
    infos: list[InputInfo] = []
    results: list[_InputScan] = []
    skipped: list[SkippedInput] = []
    for name, path, rank_hint in sources:
        reading = _Reading(
            name, rank_hint, context_markers, fact_markers, budget, progress, record_markers, record_budget, dump_markers,
            dump_budget,
        )
        try:
            result = _scan_one(path, stdin, reading)
        except _Unreadable as error:
            skipped.append(SkippedInput(name, str(error)))
            continue
        infos.append(InputInfo(name, result.size, rank_hint))
        results.append(result)
    if not results:
        raise UsageError(_nothing_readable(skipped))
    if sum(info.bytes for info in infos) == 0:
        raise UsageError("no log text to read: " + ("stdin is empty" if not paths else "the inputs are empty"))
    any_hit = any(r.hits for r in results)
    return Scan(
        inputs=tuple(infos),
        windows=tuple(w for r in results for w in r.windows),
        context=tuple(c for r in results for c in r.context),
        tails=() if any_hit else tuple(r.tail for r in results if r.tail is not None),
        hits=sum(r.hits for r in results),
        hits_not_parsed=sum(r.hits_not_parsed for r in results),
        facts=tuple(f for r in results for f in r.facts),
        skipped=tuple(skipped),
        records=tuple(line for r in results for line in r.records),
        records_not_kept=sum(r.records_not_kept for r in results),
        dumps=tuple(line for r in results for line in r.dumps),
    )


def _nothing_readable(skipped: Sequence[SkippedInput]) -> str:
    first = f"{skipped[0].name}: {skipped[0].reason}"
    if len(skipped) == 1:
        return first
    return f"none of the {len(skipped)} inputs could be read ({first}; and {len(skipped) - 1} more)"


def total_size(paths: Sequence[str]) -> int | None:
    """Bytes on disk of all inputs (for a progress bar), None for stdin."""
    if not paths:
        return None
    return sum(_size(path) for _, path, _ in _expand(paths) if path is not None)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0  # it vanished since it was listed: the scan skips it and says why


# --- discovering inputs -------------------------------------------------------------------------

_RANK_IN_NAME = re.compile(r"(?:rank|worker|proc|process)[_\-.]?(\d+)", re.IGNORECASE)
_TORCHRUN_DIR = re.compile(r"(?:^|/)attempt_\d+/(\d+)/(?:stdout|stderr)\.log(?:\.gz)?$")


def rank_from_path(path: str) -> int | None:
    """Rank told by a torchrun --log-dir folder (attempt_0/3/stderr.log) or a file name (rank_3.log)."""
    posix = path.replace(os.sep, "/")
    if match := _TORCHRUN_DIR.search(posix):
        return int(match.group(1))
    if match := _RANK_IN_NAME.search(posix.rsplit("/", 1)[-1]):
        return int(match.group(1))
    return None


def _expand(paths: Sequence[str]) -> list[tuple[str, str | None, int | None]]:
    """(display name, path, rank hint) for each file; folders are searched recursively.

    A path named on the command line must exist (a typo is a usage error); files found in a folder
    are read later, each skipped on its own if it cannot be."""
    found: list[tuple[str, str | None, int | None]] = []
    for arg in paths:
        if arg == "-":
            found.append(("<stdin>", None, None))
            continue
        try:
            mode = os.stat(arg).st_mode
        except (OSError, ValueError) as error:
            raise UsageError(f"{arg}: {os_reason(error)}") from None
        if stat.S_ISDIR(mode):
            logs = sorted(_logs_under(Path(arg)), key=_natural_key)
            if not logs:
                raise UsageError(f"{arg}: no log files in this folder (looked for *.log, *.txt, *.out, *.gz)")
            found.extend((str(p), str(p), rank_from_path(str(p.relative_to(arg)))) for p in logs)
        else:
            found.append((arg, arg, rank_from_path(arg)))
    return found


def _logs_under(folder: Path) -> Iterator[Path]:
    """Regular files named like logs; symlinked folders are not followed (a link to `..` would
    loop), subfolders that cannot be listed are passed over, FIFOs and devices never opened."""
    for parent, _, names in os.walk(folder):
        for name in names:
            lower = name.lower().removesuffix(".gz")
            path = Path(parent, name)
            if lower.endswith(LOG_SUFFIXES) and is_regular(path):
                yield path


def _natural_key(path: Path) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


# --- scanning one input -------------------------------------------------------------------------


def _scan_one(path: str | None, stdin: BinaryIO | None, reading: _Reading) -> _InputScan:
    """Files, pipes, `<(cmd)`, `/dev/stdin` and stdin alike: read front to back, never rewound."""
    if path is None:
        stream = stdin if stdin is not None else (sys.stdin.buffer if sys.stdin is not None else None)
        if stream is None:
            raise UsageError("stdin is closed: name a log file or folder, or pipe a log in")
        _widen_pipe(stream)
        if not hasattr(stream, "peek"):
            stream = io.BufferedReader(stream)
        return _scan_readable(stream, reading)
    try:
        handle = open(path, "rb", buffering=CHUNK)
    except (OSError, ValueError) as error:
        raise _Unreadable(os_reason(error)) from None
    with handle:
        return _scan_readable(handle, reading)


def _scan_readable(stream: BinaryIO, reading: _Reading) -> _InputScan:
    """gzip is told by its magic bytes, seen with `peek`: a pipe cannot seek back to them."""
    try:
        if stream.peek(2)[:2] == GZIP_MAGIC:  # type: ignore[attr-defined]
            return _scan_gzip(gzip.GzipFile(fileobj=stream), reading)
        return _scan_stream(stream, reading)
    except OSError as error:  # EIO, a folder named like a log, a file on a vanished mount
        raise _Unreadable(f"read failed ({os_reason(error)})") from None


def _widen_pipe(stream: BinaryIO) -> None:
    """A 1 MB pipe buffer instead of 64 KB cuts the syscalls of `cat big.log | unsafe-doctor` by 16."""
    try:
        if stat.S_ISFIFO(os.fstat(stream.fileno()).st_mode):
            fcntl.fcntl(stream.fileno(), fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass  # not a pipe, not Linux, or the system caps the size lower: the default still works


def _scan_gzip(
    unzipped: gzip.GzipFile,
    reading: _Reading,
) -> _InputScan:
    try:
        with unzipped:
            return _scan_stream(unzipped, reading)
    except (OSError, EOFError, zlib.error) as error:
        raise _Unreadable(f"corrupt gzip data ({error})") from None


def _refuse_binary(head: bytes) -> None:
    """A log may carry a few NULs or bad bytes; a file that is mostly control bytes is not a log."""
    if not head:
        return
    control = sum(1 for b in head if b < 32 and b not in (9, 10, 13, 27))
    if control > len(head) // 10:
        raise _Unreadable("not a text log (binary data)")


def _scan_stream(
    stream: BinaryIO | gzip.GzipFile,
    reading: _Reading,
) -> _InputScan:
    """Find the hits chunk by chunk, keeping a bounded history of recent bytes to cut windows from."""
    result = _InputScan()
    history = _History(keep=CONTEXT_SPAN + 2 * BEFORE + WINDOW_MAX)
    overlap = len(ERROR_MARKER) - 1
    pending: list[list[int]] = []  # [start, end) of windows still collecting bytes; the last may grow
    records = _MarkedLines(reading, reading.record_markers, reading.record_budget, result.records)
    dumps = _MarkedLines(reading, reading.dump_markers, reading.dump_budget, result.dumps, span=DUMP_SPAN)
    first_chunk = True
    seen_hit = False
    while chunk := stream.read(CHUNK):
        if first_chunk:
            _refuse_binary(chunk[:65536])
            first_chunk = False
        if reading.progress:
            reading.progress(len(chunk))
        chunk_start = history.end
        seam_start = max(history.start, chunk_start - overlap)
        seam = history.slice(seam_start, chunk_start) + chunk[:overlap]
        history.append(chunk)
        # Hits across the seam with the previous chunk, then inside the chunk: no chunk is copied.
        hits = [seam_start + at for at in _find_all(seam, ERROR_MARKER, 0, len(seam))]
        hits += [chunk_start + at for at in _find_all(chunk, ERROR_MARKER, 0, len(chunk))]
        for hit in hits:
            result.hits += 1
            if pending and hit - BEFORE <= pending[-1][1] and hit + AFTER - pending[-1][0] <= WINDOW_MAX:
                growth = hit + AFTER - pending[-1][1]  # hits come in order: >= 0; every byte of it is charged
                if growth <= reading.budget.left:
                    pending[-1][1] = hit + AFTER
                    reading.budget.left -= growth
                else:
                    result.hits_not_parsed += 1
                continue
            if reading.budget.left <= 0:
                result.hits_not_parsed += 1
                continue
            if not seen_hit:
                seen_hit = True
                context_end = max(history.start, hit - BEFORE)
                region_start = max(history.start, context_end - CONTEXT_SPAN)
                before_hit = history.slice(region_start, hit)
                result.context = _marker_lines(before_hit, region_start, 0, context_end - region_start, reading)
                result.facts = _fact_lines(before_hit, region_start, 0, len(before_hit), reading, at_input_end=False)
            pending.append([max(history.start, hit - BEFORE), hit + AFTER])
            reading.budget.left -= BEFORE + AFTER
        while pending and pending[0][1] + BEFORE < history.end - overlap:  # whole, and no later hit joins it
            _close_window(pending.pop(0), history, result, reading, at_end=False)
        _keep_marked((records, dumps), chunk, chunk_start, history)
        history.trim()
    result.size = history.end
    records.take(history, at_end=True)
    dumps.take(history, at_end=True)
    result.records_not_kept = records.not_kept
    for window in pending:
        _close_window(window, history, result, reading, at_end=window[1] >= history.end)
    if not result.hits and history.end:
        tail_start = max(history.start, history.end - TAIL)
        tail = history.slice(tail_start, history.end)
        result.tail = _excerpt(tail, 0, len(tail), len(tail), reading, offset=tail_start, starts_input=tail_start == 0)
        last_start = max(history.start, history.end - BEFORE)
        last = history.slice(last_start, history.end)
        result.facts = _fact_lines(last, last_start, 0, len(last), reading, at_input_end=True)
    return result


def _close_window(
    window: list[int], history: _History, result: _InputScan, reading: _Reading, *, at_end: bool
) -> None:
    start, end = window[0], min(window[1], history.end)
    data = history.slice(start, end)
    whole_until = len(data) if at_end else len(data) + 1  # mid-stream, the last line may be cut
    result.windows.append(_excerpt(data, 0, len(data), whole_until, reading, offset=start, starts_input=start == 0))


def _keep_marked(keepers: Sequence[_MarkedLines], chunk: bytes, chunk_start: int, history: _History) -> None:
    for keeper in keepers:
        keeper.find(chunk, chunk_start, history)
        keeper.take(history, at_end=False)


class _MarkedLines:
    """The whole lines around marker hits, into `kept` under `budget`: a hit waits until its line's end has been read."""

    def __init__(
        self, reading: _Reading, markers: Sequence[bytes], budget: _Budget, kept: list[Excerpt], span: int | None = None
    ) -> None:
        self.reading = reading
        self.span = span  # markers are looked for in the input's first `span` bytes only; None: everywhere
        self.markers = markers
        self.budget = budget
        self.kept = kept
        self.not_kept = 0  # lines past the budget, or longer than RECORD_LINE_MAX
        self.hits: list[int] = []  # absolute offsets of hits whose line is not taken yet
        self.taken_until = 0  # end of the last line taken: a second marker on it is the same line

    def find(self, chunk: bytes, chunk_start: int, history: _History) -> None:
        """Hits across the seam with the previous chunk, then inside the chunk (just appended to `history`)."""
        if self.span is not None and chunk_start >= self.span:
            return
        for marker in self.markers:
            overlap = len(marker) - 1
            seam_start = max(history.start, chunk_start - overlap)
            seam = history.slice(seam_start, chunk_start) + chunk[:overlap]
            self.hits += [seam_start + at for at in _find_all(seam, marker, 0, len(seam))]
            self.hits += [chunk_start + at for at in _find_all(chunk, marker, 0, len(chunk))]
        self.hits.sort()

    def take(self, history: _History, *, at_end: bool) -> None:
        waiting = []
        for hit in dict.fromkeys(self.hits):
            if hit < self.taken_until:
                continue
            after = history.slice(hit, min(history.end, hit + RECORD_LINE_MAX))
            newline = after.find(b"\n")
            if newline == -1 and not at_end and len(after) < RECORD_LINE_MAX:
                waiting.append(hit)  # the line goes on in bytes not read yet
                continue
            before_start = max(history.start, hit - RECORD_LINE_MAX)
            before = history.slice(before_start, hit)
            line_start = before.rfind(b"\n") + 1
            whole_start = line_start > 0 or before_start == 0
            if newline == -1 and len(after) >= RECORD_LINE_MAX or not whole_start:
                self.not_kept += 1  # too long to be a line its writer wrote
                self.taken_until = hit + 1
                continue
            end = hit + (len(after) if newline == -1 else newline + 1)
            self.taken_until = end
            self._keep(before_start + line_start, history.slice(before_start + line_start, end))
        self.hits = waiting

    def _keep(self, start: int, line: bytes) -> None:
        if len(line) > self.budget.left:
            self.not_kept += 1
            return
        self.budget.left -= len(line)
        text = line.decode("utf-8", "replace")
        self.kept.append(Excerpt(self.reading.name, self.reading.rank_hint, start, text))


class _History:
    """The most recent bytes of a stream, as a deque of chunks with absolute offsets."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.chunks: deque[bytes] = deque()
        self.start = 0  # absolute offset of the first byte held
        self.end = 0  # absolute offset just past the last byte held

    def append(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.end += len(chunk)

    def trim(self) -> None:
        while self.chunks and self.end - self.start - len(self.chunks[0]) >= self.keep:
            self.start += len(self.chunks.popleft())

    def slice(self, start: int, end: int) -> bytes:
        parts, offset = [], self.start
        for chunk in self.chunks:
            chunk_end = offset + len(chunk)
            if chunk_end > start and offset < end:
                parts.append(chunk[max(0, start - offset) : min(len(chunk), end - offset)])
            offset = chunk_end
        return b"".join(parts)


# --- shared helpers ---------------------------------------------------------------------------


def _find_all(buf: bytes, needle: bytes, start: int, end: int) -> Iterator[int]:
    position = buf.find(needle, start, end)
    while position != -1:
        yield position
        position = buf.find(needle, position + len(needle), end)


def _excerpt(
    buf: bytes,
    start: int,
    end: int,
    size: int,
    reading: _Reading,
    *,
    offset: int = 0,
    starts_input: bool | None = None,
) -> Excerpt:
    """Whole lines of buf[start:end]: a line cut by the window's edge is dropped, not half-parsed.

    `offset` is the absolute position of buf[0] in the input; `size` is where the input ends within
    buf (a line reaching it is whole).
    """
    if starts_input is None:
        starts_input = offset + start == 0
    if not starts_input:
        newline = buf.find(b"\n", start, end)
        start = end if newline == -1 else newline + 1
    if end < size:
        newline = buf.rfind(b"\n", start, end)
        end = start if newline == -1 else newline + 1
    return Excerpt(reading.name, reading.rank_hint, offset + start, bytes(buf[start:end]).decode("utf-8", "replace"))


def _marker_lines(
    buf: bytes, offset: int, start: int, end: int, reading: _Reading
) -> list[Excerpt]:
    """The whole line around every marker hit in buf[start:end], once each, in input order."""
    line_starts: set[int] = set()
    for marker in reading.markers:
        for hit in _find_all(buf, marker, start, end):
            line_starts.add(buf.rfind(b"\n", 0, hit) + 1)
    lines = []
    for line_start in sorted(line_starts):
        line_end = buf.find(b"\n", line_start)
        line_end = len(buf) if line_end == -1 else line_end + 1
        text = bytes(buf[line_start:line_end]).decode("utf-8", "replace")
        lines.append(Excerpt(reading.name, reading.rank_hint, offset + line_start, text))
    return lines


def _fact_lines(
    buf: bytes, offset: int, start: int, end: int, reading: _Reading, *, at_input_end: bool
) -> list[Excerpt]:
    """For each fact marker, the whole line around its last hit in buf[start:end], in input order.

    `offset` is the absolute position of buf[0]. A line must lie inside the span (or begin the
    input, or end it when the span reaches the input's end), so a window's lines do not depend on where
    the reader's buffers happen to end.
    """
    lines = []
    for marker in reading.fact_markers:
        hit = buf.rfind(marker, start, end)
        if hit == -1:
            continue
        line_start = buf.rfind(b"\n", start, hit) + 1
        if line_start == 0 and offset + start > 0:
            continue  # the line began before the span
        line_end = buf.find(b"\n", hit, end)
        if line_end == -1 and not at_input_end:
            continue  # the line runs on past the span
        line_end = end if line_end == -1 else line_end + 1
        text = bytes(buf[line_start:line_end]).decode("utf-8", "replace")
        lines.append(Excerpt(reading.name, reading.rank_hint, offset + line_start, text))
    return sorted(lines, key=lambda line: line.start)
