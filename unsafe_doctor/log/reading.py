"""One input, read front to back once: the windows around unsafe-data hits, and the marked lines.

Parsing every line of a multi-gigabyte log in Python would be far slower than `grep`, so this stage
only searches bytes, with StringZilla's SIMD substring search (four times `bytes.find`'s speed on a
marker of some 30 bytes), in buffers of 512 KB that are read into and reused: no fresh memory is
touched per chunk, and no chunk is copied. Two passes share each read:

- the windows pass finds the unsafe-data marker, cuts a window of text around each hit, and looks
  for recovery markers in a bounded span before the first hit. Lines that state a setting of the run
  are searched backwards (`rfind`) in the same span, or at the end of an input without a hit: only
  the last of each counts. It cuts windows from a rolling history of recent bytes, or, in a
  regular file, reads them again with `pread`.
- the lines pass keeps the whole lines holding a record marker (the sentinel's), wherever they
  stand, and the lines of a start-up dump (the arguments Megatron prints) in the input's first
  DUMP_SPAN bytes. After a hit it goes on from the end of that line: a line packed with markers is
  one line, found once.

Each pass keeps at most its own budget of bytes; `inputs` applies the budgets across inputs, which
it may read in several processes.
Files are read, not memory-mapped: a log truncated while mapped would kill the process with SIGBUS,
and a pipe, `<(cmd)` or `/dev/stdin` cannot be mapped or rewound at all.
"""

from __future__ import annotations

import functools
import gzip
import os
import re
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import re2  # type: ignore[import-untyped]
import stringzilla

from unsafe_doctor.errors import os_reason
from unsafe_doctor.log.lines import RANK_NUMBER

ERROR_MARKER = b"unsafe data in the input tensor"
BEFORE = 1 << 20  # bytes kept before a hit: the traceback's frames come before its message
AFTER = 256 << 10  # bytes kept after a hit: error-code lines, C++ stack, chained exceptions
CONTEXT_SPAN = 32 << 20  # how far before the first hit recovery lines are looked for
TAIL = 256 << 10  # end of an input kept when it has no hit, to tell what it ended with instead
WINDOW_MAX = 16 << 20  # one window stops growing here, so a flood of hits cannot grow it forever
EXCERPT_BUDGET = 64 << 20  # total window bytes kept; hits past it are counted, not parsed
HITS_PARSED = 4096  # hits parsed, all inputs together; a log with a marker on every line counts the rest
RECORD_LINE_MAX = 64 << 10  # a marked line longer than this is no line a writer of records wrote: not kept
RECORD_BUDGET = 16 << 20  # total record-line bytes kept; lines past it are counted, not kept
DUMP_BUDGET = 4 << 20  # total dump-line bytes kept: a few thousand argument lines of a few jobs
DUMP_SPAN = 64 << 20  # dumps are looked for in each input's first bytes only: a job prints them at start-up
CHUNK = 512 << 10  # each read: 14% less CPU per GB than 128 KB; into a few MB, the kernel's copy is much slower (measured)
LEAD = 64  # bytes of the previous chunk repeated before each: every marker is shorter
GZIP_MAGIC = b"\x1f\x8b"

BytesProgress = Callable[[int], None]  # called with the number of bytes just read


@dataclass(frozen=True, slots=True)
class Excerpt:
    source: str  # input name
    rank_hint: int | None
    start: int  # byte offset of `text` in the (decompressed) input
    text: str  # whole lines, decoded with replacement


class Unreadable(Exception):
    """One input cannot be read; the others still are."""


@dataclass(frozen=True)
class Reading:
    """What the passes over one input need besides the bytes."""

    name: str
    rank_hint: int | None
    markers: Sequence[bytes] = ()  # recovery markers, looked for before the first hit
    fact_markers: Sequence[bytes] = ()
    record_markers: Sequence[bytes] = ()
    dump_markers: tuple[bytes, bytes, bytes] | tuple[()] = ()  # a dump's argument lines', frame lines', and end line's words
    progress: BytesProgress | None = None


@dataclass(frozen=True, slots=True)
class Window:
    excerpt: Excerpt
    hits: int  # hits it was cut for
    charge: int  # bytes charged to the excerpt budget: what the window could have grown to
    first_hit: int
    span: tuple[int, int]  # the bytes it was cut from: [start, end)


@dataclass(frozen=True)
class Part:
    """The share of a regular file one worker reads: the hits that begin in [first, stop) of `size` bytes.

    It reads from RECORD_LINE_MAX before `first` to as far past `stop`, so that a line across either
    edge is whole; windows and the context reach further with `pread`."""

    first: int
    stop: int
    size: int


@dataclass(frozen=True, slots=True)
class Unread:
    """The end of a regular file without a hit, [start, end): cut into text only if no input has a hit
    (`tail_of`), so that a folder of ranks does not decode and send back a tail per file for nothing."""

    start: int
    end: int
    file: tuple[int, int]  # the file's device and inode: a file put in its place since is not read as its end


@dataclass
class WindowsRead:
    """What the windows pass found in one input."""

    windows: list[Window] = field(default_factory=list)
    context: list[Excerpt] = field(default_factory=list)
    facts: list[Excerpt] = field(default_factory=list)
    tail: Excerpt | Unread | None = None  # the end of an input without a hit; a regular file's, unread
    hits: int = 0
    hits_not_parsed: int = 0
    size: int = 0
    ranks: set[int] = field(default_factory=set)  # every `[rankN]:` tag in the bytes read (`_RankTags`)


@dataclass
class LinesRead:
    """What the lines pass found in one input: each line's text, not counted against any other input yet."""

    records: list[Excerpt] = field(default_factory=list)
    records_not_kept: int = 0  # past RECORD_BUDGET, or longer than RECORD_LINE_MAX
    dumps: list[Excerpt] = field(default_factory=list)


def read(stream: BinaryIO, reading: Reading, *, regular: bool = False, part: Part | None = None) -> tuple[WindowsRead, LinesRead]:
    """Both passes over a stream from its start, or over a `part` of a regular file; `regular`: read again where a window needs.

    gzip is told by its magic bytes, seen with `peek` (a pipe cannot seek back to them)."""
    try:
        if stream.peek(2)[:2] == GZIP_MAGIC:  # type: ignore[attr-defined]
            return _read_gzip(gzip.GzipFile(fileobj=stream), reading)
        return _read(stream, reading, stream.fileno() if regular else None, part)
    except OSError as error:  # EIO, a folder named like a log, a file on a vanished mount
        raise Unreadable(f"read failed ({os_reason(error)})") from None


def _read_gzip(unzipped: gzip.GzipFile, reading: Reading) -> tuple[WindowsRead, LinesRead]:
    try:
        with unzipped:
            return _read(unzipped, reading)
    except (OSError, EOFError, zlib.error) as error:
        raise Unreadable(f"corrupt gzip data ({error})") from None


def _read(
    stream: BinaryIO | gzip.GzipFile, reading: Reading, file: int | None = None, part: Part | None = None
) -> tuple[WindowsRead, LinesRead]:
    first, stop = (part.first, part.stop) if part else (0, None)
    windows = _Windows(reading, first, stop)
    records = _MarkedLines(reading, reading.record_markers, RECORD_BUDGET, first, stop)
    dumps = _DumpLines(reading, DUMP_BUDGET, first, min(stop or DUMP_SPAN, DUMP_SPAN))
    keepers = [keeper for keeper in (records, dumps) if keeper.markers and not keeper.done]
    ranks = _RankTags()
    # A window or the context is cut from the bytes held, unless the file can be read again there.
    keep = CONTEXT_SPAN + 2 * BEFORE + WINDOW_MAX if file is None else 2 * RECORD_LINE_MAX
    history = _History(keep, file, _shared_part((ERROR_MARKER, *reading.record_markers)) if reading.record_markers else b"")
    read_until = 0
    if part is not None:
        history.start = history.end = max(0, first - RECORD_LINE_MAX)
        stream.seek(history.start)
        read_until = min(part.size, part.stop + RECORD_LINE_MAX)
    while (not part or history.end < read_until) and (chunk := history.read(stream)) is not None:
        if chunk.start == 0:
            _refuse_binary(chunk.data[LEAD : LEAD + min(chunk.size, 65536)])
        if reading.progress:  # a part's own bytes only: the bars of all parts add up to the file
            reading.progress(max(0, min(chunk.end, stop or chunk.end) - max(chunk.start, first)))
        windows.feed(chunk, history)
        ranks.feed(chunk)
        for keeper in keepers:
            keeper.feed(history, at_end=False)
        keepers = [keeper for keeper in keepers if not keeper.done]
        history.trim()
    for keeper in keepers:
        keeper.feed(history, at_end=True)
    size = part.size if part and history.end >= read_until else history.end  # a file that shrank ends where reading did
    found = windows.finish(history, size)
    found.ranks = ranks.seen
    return found, LinesRead(records.kept, records.not_kept, dumps.kept)


_CONTROL = bytes(b for b in range(32) if b not in (9, 10, 13, 27))  # no text log holds many of these


def _refuse_binary(head: bytes | bytearray) -> None:
    """A log may carry a few NULs or bad bytes; a file that is mostly control bytes is not a log."""
    control = len(head) - len(head.translate(None, _CONTROL))
    if control > len(head) // 10:
        raise Unreadable("not a text log (binary data)")


# --- the history of recent bytes ----------------------------------------------------------------


@dataclass(slots=True)
class _Chunk:
    """`size` bytes read at absolute offset `start`, in data[LEAD:]; data[:LEAD] repeats the bytes before them."""

    data: bytearray  # a reused buffer; bytes past LEAD + size are stale
    size: int
    start: int
    holds_shared: bool = True  # whether data holds the history's `shared` bytes: no marker holding them is in it if not

    @property
    def base(self) -> int:
        """The absolute offset of data[0]: a marker across the edge with the chunk before lies whole in data."""
        return self.start - LEAD

    @property
    def end(self) -> int:
        return self.start + self.size


class _History:
    """The most recent bytes of a stream, in reused buffers with absolute offsets; searched in place.

    Every chunk but the last is one full buffer, so the chunk holding an offset is found by division.
    Of a regular file (`file`: its descriptor) only a few chunks stay in memory: older bytes a window
    or the context needs are read again with `pread`. `shared`: bytes that the markers searched in
    every chunk all hold (`unsafe`, of the error's and the sentinel's), looked for once per chunk: a
    chunk without them, nearly every chunk of a log, is not searched for those markers at all.
    """

    def __init__(self, keep: int, file: int | None, shared: bytes = b"") -> None:
        self.keep = keep
        self.file = file
        self.shared = shared
        self.size = CHUNK
        self.chunks: deque[_Chunk] = deque()
        self.spare: list[bytearray] = []  # buffers trimmed off, to read into again
        self.start = 0  # absolute offset of the first byte held
        self.end = 0  # absolute offset just past the last byte held

    def read(self, stream: BinaryIO | gzip.GzipFile) -> _Chunk | None:
        buffer = self.spare.pop() if self.spare else bytearray(LEAD + self.size)
        size = _fill(stream, memoryview(buffer)[LEAD:])  # straight into the history: a staging copy cost more (measured)
        if not size:
            self.spare.append(buffer)
            return None
        if self.chunks:
            last = self.chunks[-1]
            buffer[:LEAD] = last.data[last.size : LEAD + last.size]
        holds_shared = not self.shared or stringzilla.find(buffer, self.shared, 0, LEAD + size) != -1
        chunk = _Chunk(buffer, size, self.end, holds_shared)
        self.chunks.append(chunk)
        self.end += size
        return chunk

    def trim(self) -> None:
        while len(self.chunks) > 1 and self.end - self.start - self.chunks[0].size >= self.keep:
            chunk = self.chunks.popleft()
            self.start += chunk.size
            self.spare.append(chunk.data)

    @property
    def reach(self) -> int:
        """The first byte `slice` can still give (a regular file's bytes past `end` too)."""
        return 0 if self.file is not None else self.start

    def _held(self, start: int, end: int) -> range:
        """The indexes of the chunks that read bytes of [start, end), in order."""
        return range(max(0, (start - self.start) // self.size), min(len(self.chunks), (end - 1 - self.start) // self.size + 1))

    def slice(self, start: int, end: int) -> bytes:
        parts: list[bytes | memoryview] = []
        if start < self.start and self.file is not None:
            parts.append(os.pread(self.file, min(end, self.start) - start, start))
        for index in self._held(start, end):
            chunk = self.chunks[index]
            parts.append(memoryview(chunk.data)[max(start, chunk.start) - chunk.base : min(end, chunk.end) - chunk.base])
        if end > self.end and self.file is not None:
            parts.append(os.pread(self.file, end - max(start, self.end), max(start, self.end)))
        return b"".join(parts)

    def find(self, needle: bytes, start: int, end: int) -> int:
        """The first `needle` wholly inside [start, end); -1 if none. One across two chunks is found in the later one."""
        needs_shared = bool(self.shared) and self.shared in needle
        for index in self._held(start + len(needle) - 1, end):
            chunk = self.chunks[index]
            if needs_shared and not chunk.holds_shared:
                continue
            first = max(start, chunk.start - len(needle) + 1) - chunk.base
            at = stringzilla.find(chunk.data, needle, first, min(end, chunk.end) - chunk.base)
            if at != -1:
                return chunk.base + at
        return -1

    def count(self, needle: bytes, start: int, end: int) -> int:
        """How many `needle` lie wholly inside [start, end)."""
        needs_shared = bool(self.shared) and self.shared in needle
        return sum(
            stringzilla.count(
                self.chunks[index].data,
                needle,
                max(start, self.chunks[index].start - len(needle) + 1) - self.chunks[index].base,
                min(end, self.chunks[index].end) - self.chunks[index].base,
            )
            for index in self._held(start + len(needle) - 1, end)
            if not needs_shared or self.chunks[index].holds_shared
        )

    def rfind_newline(self, start: int, end: int) -> int:
        """The last newline in [start, end); -1 if none."""
        for index in reversed(self._held(start, end)):
            chunk = self.chunks[index]
            at = stringzilla.rfind(chunk.data, b"\n", max(start, chunk.start) - chunk.base, min(end, chunk.end) - chunk.base)
            if at != -1:
                return chunk.base + at
        return -1


@functools.cache
def _shared_part(markers: tuple[bytes, ...]) -> bytes:
    """The longest run of bytes that every marker holds, of 4 bytes or more (shorter ones are found
    nearly everywhere); empty if there is none."""
    shortest = min(markers, key=len)
    for size in range(len(shortest), 3, -1):
        for start in range(len(shortest) - size + 1):
            part = shortest[start : start + size]
            if all(part in marker for marker in markers):
                return part
    return b""


def _fill(stream: BinaryIO | gzip.GzipFile, buffer: bytearray | memoryview) -> int:
    """Read until the buffer is full or the stream ends: a pipe hands over at most its own buffer per read."""
    filled = 0
    with memoryview(buffer) as view:
        while filled < len(view):
            count = stream.readinto(view[filled:])  # type: ignore[union-attr]
            if not count:
                break
            filled += count
    return filled


# --- the ranks that tagged their lines ------------------------------------------------------------


class _RankTags:
    """The N of every `[rankN]:` tag (PyTorch's line prefix, as `lines` reads it) in the whole input,
    however little of it is parsed. Each chunk holding `[rank` is searched, in C, from there, by one
    RE2 pattern that matches only the tags not seen yet: a chunk of known ranks costs one linear
    scan, about twice what the search for the error's marker costs. Only a chunk holding a new tag
    is searched for all of its tags.
    The pattern is built again when the tags seen have doubled since, or when chunks it matched for
    tags seen since have cost about what building it costs (compiling it for thousands of ranks
    takes a tenth of a second; a chunk searched for all its tags, some milliseconds): a log however
    made costs time linear in its size. Past TAGS_SEEN spellings (no job has so many ranks) this
    reader's search stops."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.spelled: set[bytes] = set()  # the tags' digits as written (`03` is not `3`)
        self.new_tag: Any = _tags_but(frozenset())
        self.excluded = 0  # how many spellings `new_tag` leaves out
        self.wasted = 0  # chunks `new_tag` matched for tags seen since it was built
        self.first = True

    def feed(self, chunk: _Chunk) -> None:
        start = LEAD if self.first else 0  # before the first chunk, data[:LEAD] holds no bytes of the input
        self.first = False
        if self.new_tag is None or (start := stringzilla.find(chunk.data, b"[rank", start, LEAD + chunk.size)) == -1:
            return  # a chunk without a tag, as in a log each rank writes to a file of its own, is not searched twice
        view = memoryview(chunk.data)[start : LEAD + chunk.size]
        if self.new_tag.search(view) is None:
            return
        found = set(_RANK_TAG.findall(bytes(view))) - self.spelled
        self.spelled |= found
        self.seen |= {int(digits) for digits in found}
        self.wasted += not found
        if len(self.spelled) > TAGS_SEEN:
            self.new_tag = None
        elif len(self.spelled) >= 2 * self.excluded or self.wasted > len(self.spelled) // 256:
            self.new_tag, self.excluded, self.wasted = _tags_but(frozenset(self.spelled)), len(self.spelled), 0


TAGS_SEEN = 1 << 14
# As `lines` reads one. Python's own `re`, for the few chunks that hold a new tag: its findall builds the
# list in C, where RE2's wrapper makes a match object per tag in Python (17 times slower on a chunk of
# one rank's lines); the pattern cannot backtrack (digits between literals, at most RANK_NUMBER's).
_RANK_TAG = re.compile(rf"\[rank({RANK_NUMBER})\]:".encode())


def _tags_but(spelled: frozenset[bytes]) -> Any:
    """An RE2 pattern for a `[rankN]:` tag whose N is none of `spelled`, N captured. The numbers not
    in a finite set are written as a trie of its digits, each branch closed by the digits it lacks.
    A branch's digits are not bounded to RANK_DIGITS (that made the pattern of 8,192 ranks 12 times
    slower to build): a chunk whose only new tag is too long for a rank is searched for nothing,
    and counts toward the next build as a chunk searched for tags seen since."""

    def other(node: dict[int, list[Any]], depth: int, *, spelled_here: bool) -> str:
        branches = [] if spelled_here or not depth else [""]
        free = "".join(chr(digit) for digit in b"0123456789" if digit not in node)
        if free:
            branches.append(f"[{free}]\\d*")
        branches += [chr(digit) + other(child, depth + 1, spelled_here=ends) for digit, (child, ends) in sorted(node.items())]
        return f"(?:{'|'.join(branches)})" if branches else "[^\\d\\D]"  # nothing: every number here is spelled

    trie: dict[int, list[Any]] = {}
    for digits in spelled:
        node, entry = trie, None
        for digit in digits:
            entry = node.setdefault(digit, [{}, False])
            node = entry[0]
        if entry is not None:
            entry[1] = True
    options = re2.Options()
    options.max_mem = 64 << 20  # the pattern of many thousand ranks needs more than the default 8 MB
    return re2.compile(rb"\[rank(" + other(trie, 0, spelled_here=False).encode() + rb")\]:", options)


# --- the windows pass ---------------------------------------------------------------------------


class _Windows:
    """Windows around hits, closed once no later hit can join them; context and facts at the first hit."""

    def __init__(self, reading: Reading, first: int, stop: int | None) -> None:
        self.reading = reading
        self.found = WindowsRead()
        self.pending: list[list[int]] = []  # [start, end, hits, charge, first hit] of windows still collecting bytes
        self.searched = first  # hits before this offset are counted
        self.stop = stop  # hits from this offset on are another part's
        self.budget_left = EXCERPT_BUDGET
        self.hits_left = HITS_PARSED

    def feed(self, chunk: _Chunk, history: _History) -> None:
        position = max(self.searched, chunk.start - len(ERROR_MARKER) + 1, history.start)
        end = history.end if self.stop is None else min(history.end, self.stop + len(ERROR_MARKER) - 1)
        while self._parsing and (hit := history.find(ERROR_MARKER, position, end)) != -1:
            self._hit(hit, history)
            position = hit + len(ERROR_MARKER)
        if not self._parsing:  # the rest is only counted
            counted = history.count(ERROR_MARKER, position, end)
            self.found.hits += counted
            self.found.hits_not_parsed += counted
        self.searched = max(position, history.end - len(ERROR_MARKER) + 1)
        while self.pending and self.pending[0][1] + BEFORE < history.end - len(ERROR_MARKER) + 1:
            self._close(self.pending.pop(0), history, history.end + 1)  # whole, and no later hit joins it

    @property
    def _parsing(self) -> bool:
        return self.hits_left > 0 and self.budget_left > 0

    def _hit(self, hit: int, history: _History) -> None:
        self.found.hits += 1
        last = self.pending[-1] if self.pending else None
        if last and hit - BEFORE <= last[1] and hit + AFTER - last[0] <= WINDOW_MAX:
            growth = hit + AFTER - last[1]  # hits come in order: >= 0; every byte of it is charged
            if growth <= self.budget_left:
                last[1], last[2], last[3] = hit + AFTER, last[2] + 1, last[3] + growth
                self.budget_left -= growth
                self.hits_left -= 1
            else:
                self.found.hits_not_parsed += 1
            return
        if self.budget_left <= 0:
            self.found.hits_not_parsed += 1
            return
        if not self.found.windows and not self.pending:
            self._context(hit, history)
        self.pending.append([max(history.reach, hit - BEFORE), hit + AFTER, 1, BEFORE + AFTER, hit])
        self.budget_left -= BEFORE + AFTER
        self.hits_left -= 1

    def _context(self, hit: int, history: _History) -> None:
        context_end = max(history.reach, hit - BEFORE)
        region_start = max(history.reach, context_end - CONTEXT_SPAN)
        before_hit = history.slice(region_start, hit)
        self.found.context = _marker_lines(before_hit, region_start, context_end - region_start, self.reading)
        self.found.facts = _fact_lines(before_hit, region_start, self.reading, at_input_end=False)

    def _close(self, window: list[int], history: _History, size: int) -> None:
        start, end = window[0], min(window[1], size)
        excerpt = cut(history.slice(start, end), start, size, self.reading)
        self.found.windows.append(Window(excerpt, window[2], window[3], window[4], (start, end)))

    def finish(self, history: _History, size: int) -> WindowsRead:
        """`size`: where the input ends (past what was read, for a part of a file)."""
        self.found.size = size
        for window in self.pending:
            self._close(window, history, size)
        if not self.found.hits and size:
            tail_start = max(history.reach, size - TAIL)
            if history.file is not None:
                status = os.fstat(history.file)
                self.found.tail = Unread(tail_start, size, (status.st_dev, status.st_ino))
            else:
                tail = history.slice(tail_start, size)
                self.found.tail = _excerpt(tail, len(tail), self.reading, offset=tail_start)
            last_start = max(history.reach, size - BEFORE)
            self.found.facts = _fact_lines(history.slice(last_start, size), last_start, self.reading, at_input_end=True)
        return self.found


def tail_of(path: str, unread: Unread, reading: Reading) -> Excerpt:
    """The text of a regular file's end, read again: the lines of [start, end) as the input was read.
    A file that another took the place of (rotated, written anew) or that was cut shorter has no end
    to give: the bytes there are not those the scan read."""
    try:
        with open(path, "rb") as handle:
            status = os.fstat(handle.fileno())
            if (status.st_dev, status.st_ino) != unread.file or status.st_size < unread.end:
                raise Unreadable("replaced or cut shorter since it was read")
            data = os.pread(handle.fileno(), unread.end - unread.start, unread.start)
    except OSError as error:  # it vanished or lost its mount since it was read
        raise Unreadable(f"read failed ({os_reason(error)})") from None
    return _excerpt(data, len(data), reading, offset=unread.start)


def cut(data: bytes, start: int, size: int, reading: Reading) -> Excerpt:
    """The window of `data` read at `start` of an input of `size` bytes: its whole lines (the last is whole at the end)."""
    whole_until = len(data) if start + len(data) >= size else len(data) + 1
    return _excerpt(data, whole_until, reading, offset=start)


# --- the lines pass -----------------------------------------------------------------------------


class _MarkedLines:
    """The whole lines holding a marker, into `kept` under `budget`, each found once however many markers it holds."""

    def __init__(self, reading: Reading, markers: Sequence[bytes], budget: int, first: int, stop: int | None) -> None:
        self.reading = reading
        self.markers = markers
        self.budget_left = budget
        self.stop = stop  # markers that begin here or later are not looked for (another part's, or past a span)
        self.kept: list[Excerpt] = []
        self.not_kept = 0  # lines past the budget, or longer than RECORD_LINE_MAX
        self.searched = first  # where the search goes on: past the last line taken, or the bytes searched
        self.waiting: int | None = None  # a hit whose line goes on in bytes not read yet
        self.skipping = False  # inside a line too long to keep: the search goes on after its end
        self.next_hit: dict[bytes, int] = {}  # per marker, its first hit at or after `searched`, once found
        self.clear_until: dict[bytes, int] = {}  # per marker, no hit of it starts before this offset

    @property
    def done(self) -> bool:
        """Past the span, with no line left to finish."""
        return self.stop is not None and self.searched >= self.stop and self.waiting is None and not self.skipping

    def feed(self, history: _History, *, at_end: bool) -> None:
        if self.waiting is not None:
            if not self._take(self.waiting, history, at_end=at_end):
                return
            self.waiting = None
        if self.skipping and not self._skip(history):
            return
        while (hit := self._first_hit(history, max(self.searched, history.start), history.end)) != -1:
            if not self._take(hit, history, at_end=at_end):
                self.waiting = hit
                return
            if self.skipping and not self._skip(history):
                return
        self.searched = max(self.searched, min(self.clear_until.get(marker, 0) for marker in self.markers))

    def _first_hit(self, history: _History, start: int, end: int) -> int:
        """The first hit of any marker at or after `start`; each marker is searched past a point once."""
        first = -1
        for marker in self.markers:
            hit = self.next_hit.get(marker, -1)
            if hit < start:
                since = max(start, self.clear_until.get(marker, 0))
                until = end if self.stop is None else min(end, self.stop + len(marker) - 1)
                hit = history.find(marker, since, until)
                self.next_hit[marker] = hit
                if hit == -1:
                    self.clear_until[marker] = max(since, until - len(marker) + 1)
            if hit != -1 and (first == -1 or hit < first):
                first = hit
        return first

    def _take(self, hit: int, history: _History, *, at_end: bool) -> bool:
        """Keep (or count) the line around `hit`, and go on past it; False: its end is not read yet."""
        newline = history.find(b"\n", hit, min(history.end, hit + RECORD_LINE_MAX))
        if newline == -1 and not at_end and history.end - hit < RECORD_LINE_MAX:
            return False
        before_start = max(history.start, hit - RECORD_LINE_MAX)
        line_start = history.rfind_newline(before_start, hit) + 1
        too_long = newline == -1 and history.end - hit >= RECORD_LINE_MAX or not (line_start > 0 or before_start == 0)
        if too_long:
            self.not_kept += 1  # no line its writer wrote: counted once, and searched again after its end
            self.searched, self.skipping = hit, True
            return True
        end = history.end if newline == -1 else newline + 1
        self.searched = end
        self._found(line_start, end, history)
        if end - line_start > self.budget_left:
            self.not_kept += 1
            return True
        self.budget_left -= end - line_start
        text = history.slice(line_start, end).decode("utf-8", "replace")
        self.kept.append(Excerpt(self.reading.name, self.reading.rank_hint, line_start, text))
        return True

    def _found(self, start: int, end: int, history: _History) -> None:
        """A whole line [start, end) holding a marker, kept or not."""

    def _skip(self, history: _History) -> bool:
        """Move past the end of the long line; False: it goes on in bytes not read yet."""
        newline = history.find(b"\n", max(self.searched, history.start), history.end)
        if newline == -1:
            self.searched = history.end
            return False
        self.searched, self.skipping = newline + 1, False
        return True


class _DumpLines(_MarkedLines):
    """A start-up dump: its title and end lines, which hold the frame marker, and between them the
    lines holding the argument marker. Outside a dump that marker is not looked for: runs of dots
    stand elsewhere in a log too, and a second search of every byte costs more than the first."""

    def __init__(self, reading: Reading, budget: int, first: int, stop: int | None) -> None:
        self.argument, self.frame, self.end = reading.dump_markers or (b"", b"", b"")
        super().__init__(reading, (self.frame,) if self.frame else (), budget, first, stop)

    def _found(self, start: int, end: int, history: _History) -> None:
        if history.find(self.frame, start, end) == -1:
            return  # an argument line
        inside = history.find(self.end, start, end) == -1  # a title opens a dump, its end line closes it
        self.markers = (self.frame, self.argument) if inside else (self.frame,)


# --- excerpts -----------------------------------------------------------------------------------


def _excerpt(buf: bytes, size: int, reading: Reading, *, offset: int) -> Excerpt:
    """Whole lines of buf: a line cut by the window's edge is dropped, not half-parsed.

    `offset` is the absolute position of buf[0] in the input; `size` is where the input ends within
    buf (a line reaching it is whole).
    """
    start, end = 0, len(buf)
    if offset:
        newline = buf.find(b"\n")
        start = end if newline == -1 else newline + 1
    if end < size:
        newline = buf.rfind(b"\n", start, end)
        end = start if newline == -1 else newline + 1
    return Excerpt(reading.name, reading.rank_hint, offset + start, buf[start:end].decode("utf-8", "replace"))


def _marker_lines(buf: bytes, offset: int, end: int, reading: Reading) -> list[Excerpt]:
    """The whole line around every marker hit in buf[:end], once each, in input order. All markers are
    looked for in one pass, by RE2 (a search per marker, over the 32 MB before a hit, took twice as long)."""
    line_starts: set[int] = set()
    if reading.markers:
        for hit in _any_of(tuple(reading.markers)).finditer(buf, 0, end):
            line_starts.add(buf.rfind(b"\n", 0, hit.start()) + 1)  # markers hold no newline: one hit per line is enough
    lines = []
    for line_start in sorted(line_starts):
        line_end = buf.find(b"\n", line_start)
        line_end = len(buf) if line_end == -1 else line_end + 1
        text = buf[line_start:line_end].decode("utf-8", "replace")
        lines.append(Excerpt(reading.name, reading.rank_hint, offset + line_start, text))
    return lines


@functools.cache
def _any_of(markers: tuple[bytes, ...]) -> Any:
    """One RE2 pattern for all the markers, found wherever one starts (leftmost first)."""
    return re2.compile(b"|".join(re2.escape(marker) for marker in markers))


def _fact_lines(buf: bytes, offset: int, reading: Reading, *, at_input_end: bool) -> list[Excerpt]:
    """For each fact marker, the whole line around its last hit in buf, in input order.

    `offset` is the absolute position of buf[0]. A line must lie inside the span (or begin the
    input, or end it when the span reaches the input's end), so a window's lines do not depend on where
    the reader's buffers happen to end.
    """
    lines = []
    for marker in reading.fact_markers:
        hit = stringzilla.rfind(buf, marker)
        if hit == -1:
            continue
        line_start = buf.rfind(b"\n", 0, hit) + 1
        if line_start == 0 and offset > 0:
            continue  # the line began before the span
        line_end = buf.find(b"\n", hit)
        if line_end == -1 and not at_input_end:
            continue  # the line runs on past the span
        line_end = len(buf) if line_end == -1 else line_end + 1
        text = buf[line_start:line_end].decode("utf-8", "replace")
        lines.append(Excerpt(reading.name, reading.rank_hint, offset + line_start, text))
    return sorted(lines, key=lambda line: line.start)
