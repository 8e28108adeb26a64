"""Inputs (stdin, files, folders, gzip) -> the few excerpts worth parsing.

Each input is read once, front to back, by `reading` (windows around unsafe-data hits, recovery
context and facts before the first, the sentinel's record lines, a start-up dump). Large inputs are
read in worker processes, one per core: a folder's files one each, a single file in parts. The
budgets hold across all inputs, applied here in input order, so memory stays
bounded whatever the size or number of inputs (later hits are counted, not parsed).

One input that cannot be read (a truncated `.gz`, a core dump in a log folder, a file that vanished)
does not stop the others: it is returned as a `SkippedInput` with its reason; only when nothing is
left to read is that an error.
"""

from __future__ import annotations

import fcntl
import io
import os
import re
import stat
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

from unsafe_doctor.errors import UsageError, os_reason
from unsafe_doctor.log import reading
from unsafe_doctor.log.reading import BytesProgress, Excerpt, LinesRead, Part, Reading, Unreadable, Window, WindowsRead

__all__ = ["BytesProgress", "Excerpt", "InputInfo", "Scan", "SkippedInput", "scan"]

PIPE_SIZE = 1 << 20  # Linux's default /proc/sys/fs/pipe-max-size
PARALLEL_MIN = 64 << 20  # regular files smaller than this together are read in this process: forking costs more
PART_MIN = 32 << 20  # a file is read in parts no smaller than this
STDIN_FILE = "/proc/self/fd/0"  # opened, a new reader of what stdin reads, from its start (each worker its own)
LOG_SUFFIXES = (".log", ".txt", ".out")


def is_regular(path: Path) -> bool:
    """A regular file (links followed): never a FIFO that would block a reader, nor a device."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


@dataclass(frozen=True, slots=True)
class InputInfo:
    name: str
    bytes: int  # bytes read (decompressed size for gzip)
    rank_hint: int | None  # rank from the file name or torchrun folder, when it tells one


@dataclass(frozen=True, slots=True)
class SkippedInput:
    name: str
    reason: str  # why it was not read: "corrupt gzip data (...)", "not a text log (binary data)"


@dataclass(frozen=True)
class Scan:
    inputs: tuple[InputInfo, ...]
    windows: tuple[Excerpt, ...]  # text around unsafe-data hits
    context: tuple[Excerpt, ...]  # single lines holding a recovery marker, before the first hit
    tails: tuple[Excerpt, ...]  # ends of inputs without hits (only when no input has a hit)
    hits: int  # unsafe-data markers found
    hits_not_parsed: int  # hits past the excerpt budget or the count of hits parsed
    # Per input and fact marker, the last whole line holding it: before the first hit, in the span
    # searched for context; in an input without a hit, in its last BEFORE bytes.
    facts: tuple[Excerpt, ...] = ()
    skipped: tuple[SkippedInput, ...] = ()  # inputs not read, each with its reason
    records: tuple[Excerpt, ...] = ()  # every whole line holding a record marker, anywhere, in input order
    records_not_kept: int = 0  # record lines past RECORD_BUDGET, or longer than RECORD_LINE_MAX
    dumps: tuple[Excerpt, ...] = ()  # every whole line holding a dump marker, anywhere, in input order
    ranks_tagged: frozenset[int] = frozenset()  # the N of every `[rankN]:` in the whole of every input


def scan(
    paths: Sequence[str],
    context_markers: Sequence[bytes],
    *,
    fact_markers: Sequence[bytes] = (),
    record_markers: Sequence[bytes] = (),
    dump_markers: tuple[bytes, bytes, bytes] | tuple[()] = (),
    stdin: BinaryIO | None = None,
    progress: BytesProgress | None = None,
) -> Scan:
    """Read every input once and keep only what later stages parse. No paths means stdin.

    `fact_markers` mark a setting the run logs at start-up or every step: only the latest line of
    each is worth keeping. `record_markers` mark lines that each tell something on their own
    (the sentinel's): every one is kept, wherever it stands. `dump_markers` mark the lines of a
    start-up dump (Megatron's arguments: its frame and what lies between), kept the same way under a budget of their own. An input
    that cannot be read is skipped with its reason; a UsageError only when none can be.
    """
    sources = _expand(paths) if paths else [("<stdin>", None, None)]
    if stdin is None:
        sources = [_stdin_source() if path is None else (name, path, rank) for name, path, rank in sources]
    markers = Reading("", None, context_markers, fact_markers, record_markers, dump_markers)
    return _within_budgets(sources, _read_all(sources, markers, stdin, progress))


# A source: (display name, path or None for stdin, rank hint).
_Source = tuple[str, "str | None", "int | None"]


@dataclass(frozen=True)
class _Task:
    """One source to read, or one part of a large regular file: both passes at once (two processes
    reading the same pages slow each other down; different parts of a file do not)."""

    source: int  # index into the sources
    name: str
    path: str | None
    rank_hint: int | None
    part: Part | None = None


# What reading one source (or part) gave: both passes, or why it cannot be read.
_Found = tuple[WindowsRead, LinesRead] | Unreadable


def _read_all(
    sources: Sequence[_Source], markers: Reading, stdin: BinaryIO | None, progress: BytesProgress | None
) -> list[_Found]:
    """Each source's passes, in order: in worker processes, one per core, when the files are large enough to pay."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    tasks = _tasks(sources, cores)
    if cores > 1 and len(tasks) > 1 and sum(_size(path) for _, path, _ in sources if path) >= PARALLEL_MIN:
        from unsafe_doctor.log import workers  # multiprocessing loads only when it is used

        found = workers.run_in_workers(_read_task, [(task, markers) for task in tasks], min(cores, len(tasks)), progress)
    else:
        found = [_read_task(task, markers, stdin, progress) for task in tasks]
    per_source = []
    for index, (name, path, rank_hint) in enumerate(sources):
        parts = [part for task, part in zip(tasks, found, strict=True) if task.source == index]
        joined = _joined(parts, path, replace(markers, name=name, rank_hint=rank_hint)) if len(parts) > 1 else parts[0]
        per_source.append(joined)
    return per_source


def _tasks(sources: Sequence[_Source], cores: int) -> list[_Task]:
    """A task per source; a large regular file in parts when there are fewer files than cores."""
    tasks = []
    for index, (name, path, rank_hint) in enumerate(sources):
        size = _size(path) if path is not None else 0
        count = min(cores // len(sources), size // PART_MIN) if path is not None and _splittable(path) else 1
        if count < 2:
            tasks.append(_Task(index, name, path, rank_hint))
            continue
        cuts = [size * k // count for k in range(count + 1)]
        tasks += [_Task(index, name, path, rank_hint, Part(cuts[k], cuts[k + 1], size)) for k in range(count)]
    return tasks


def _splittable(path: str) -> bool:
    """A regular file that is not gzip: one that can be read from the middle."""
    if not is_regular(Path(path)):
        return False  # never opened here: a FIFO would block until a writer came
    try:
        with open(path, "rb") as handle:
            return handle.read(2) != reading.GZIP_MAGIC
    except (OSError, ValueError):
        return False  # read as a whole, which says why it cannot be


def _read_task(task: _Task, markers: Reading, stdin: BinaryIO | None = None, progress: BytesProgress | None = None) -> _Found:
    """Files, pipes, `<(cmd)`, `/dev/stdin` and stdin alike: read front to back, never rewound."""
    one = replace(markers, name=task.name, rank_hint=task.rank_hint, progress=progress)
    try:
        if task.path is None:
            return reading.read(_stdin(stdin), one)
        try:
            handle = open(task.path, "rb")
        except (OSError, ValueError) as error:
            raise Unreadable(os_reason(error)) from None
        with handle:
            return reading.read(handle, one, regular=stat.S_ISREG(os.fstat(handle.fileno()).st_mode), part=task.part)
    except Unreadable as error:
        return error


def _joined(parts: Sequence[_Found], path: str | None, one: Reading) -> _Found:
    """The parts of one file as one reader would have read it: windows that meet across two parts cut
    again as one (it may pass WINDOW_MAX, where one reader would have started another: the same lines,
    once each), a line found by both kept once, the context of the first hit, the tail of the last part."""
    unreadable = next((part for part in parts if isinstance(part, Unreadable)), None)
    if unreadable is not None or path is None:
        return unreadable or parts[0]
    reads = [part for part in parts if not isinstance(part, Unreadable)]
    size = min(found.size for found, _ in reads)  # a file that shrank while it was read
    windows: list[Window] = []
    for window in (window for found, _ in reads for window in found.windows):
        last = windows[-1] if windows else None
        if last and window.first_hit - reading.BEFORE <= last.span[1]:  # one reader would have joined them
            with open(path, "rb") as handle:
                data = os.pread(handle.fileno(), window.span[1] - last.span[0], last.span[0])
            excerpt = reading.cut(data, last.span[0], size, one)
            span = (last.span[0], window.span[1])
            window = Window(excerpt, last.hits + window.hits, last.charge + window.charge, last.first_hit, span)
            windows[-1] = window
            continue
        windows.append(window)
    # The context and facts before the first hit; with no hit, the facts and tail at the end of the last part.
    first = next((found for found, _ in reads if found.windows), reads[-1][0])
    hits = sum(found.hits for found, _ in reads)
    joined_windows = WindowsRead(
        windows,
        first.context,
        first.facts,
        reads[-1][0].tail if not hits else None,
        hits,
        sum(found.hits_not_parsed for found, _ in reads),
        size,
        set().union(*(found.ranks for found, _ in reads)),
    )
    lines = LinesRead(
        _once([line for _, found in reads for line in found.records]),
        sum(found.records_not_kept for _, found in reads),
        _once([line for _, found in reads for line in found.dumps]),
    )
    return joined_windows, lines


def _once(lines: list[Excerpt]) -> list[Excerpt]:
    """A line across the edge of two parts is found by both: kept once, where it first came."""
    kept: dict[int, Excerpt] = {}
    for line in lines:
        kept.setdefault(line.start, line)
    return list(kept.values())


def _stdin_source() -> _Source:
    """Stdin; a regular file a shell redirected into it (`< train.log`), still at its start, is read
    as that file (in parts, again where a window needs): Linux reopens it through STDIN_FILE."""
    try:
        if (
            sys.stdin is not None
            and sys.stdin.fileno() == 0
            and stat.S_ISREG(os.fstat(0).st_mode)
            and os.lseek(0, 0, os.SEEK_CUR) == 0
            and os.path.exists(STDIN_FILE)
        ):
            return ("<stdin>", STDIN_FILE, None)
    except (OSError, ValueError, io.UnsupportedOperation):
        pass  # no descriptor (a test's replacement), or none to seek: a stream
    return ("<stdin>", None, None)


def _stdin(stdin: BinaryIO | None) -> BinaryIO:
    stream = stdin if stdin is not None else (sys.stdin.buffer if sys.stdin is not None else None)
    if stream is None:
        raise UsageError("stdin is closed: name a log file or folder, or pipe a log in")
    if stream.isatty():  # each Ctrl-D ends one read: read up to the first, then from memory (a pasted log)
        return io.BufferedReader(io.BytesIO(stream.read()))
    _widen_pipe(stream)
    return stream if hasattr(stream, "peek") else io.BufferedReader(stream)  # type: ignore[type-var]


def _widen_pipe(stream: BinaryIO) -> None:
    """A 1 MB pipe buffer instead of 64 KB cuts the syscalls of `cat big.log | unsafe-doctor` by 16."""
    try:
        if stat.S_ISFIFO(os.fstat(stream.fileno()).st_mode):
            fcntl.fcntl(stream.fileno(), fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass  # not a pipe, not Linux, or the system caps the size lower: the default still works


# --- the budgets across inputs ------------------------------------------------------------------


def _within_budgets(sources: Sequence[_Source], found: Sequence[_Found]) -> Scan:
    """Each input was read with every budget whole; here they are spent in input order, as one reader would."""
    infos: list[InputInfo] = []
    skipped: list[SkippedInput] = []
    windows: list[Excerpt] = []
    context: list[Excerpt] = []
    facts: list[Excerpt] = []
    tails: list[tuple[_Source, Excerpt | reading.Unread]] = []
    hits = hits_not_parsed = 0
    ranks: set[int] = set()
    excerpt_left, hits_left = reading.EXCERPT_BUDGET, reading.HITS_PARSED
    records = _Spender(reading.RECORD_BUDGET)
    dumps = _Spender(reading.DUMP_BUDGET)
    for source, part in zip(sources, found, strict=True):
        name, _, rank_hint = source
        if isinstance(part, Unreadable):
            skipped.append(SkippedInput(name, str(part)))
            continue
        windows_read, lines_read = part
        infos.append(InputInfo(name, windows_read.size, rank_hint))
        hits += windows_read.hits
        hits_not_parsed += windows_read.hits_not_parsed
        ranks |= windows_read.ranks
        if not windows_read.windows:
            facts += windows_read.facts  # an input without a hit: the facts at its end
        for index, window in enumerate(windows_read.windows):
            if excerpt_left <= 0 or hits_left <= 0:
                hits_not_parsed += window.hits
                continue
            if index == 0:  # context and facts come with an input's first window, as one reader would read them
                context += windows_read.context
                facts += windows_read.facts
            windows.append(window.excerpt)
            excerpt_left -= window.charge
            hits_left -= window.hits
        if windows_read.tail is not None:
            tails.append((source, windows_read.tail))
        records.spend(lines_read.records)
        records.not_kept += lines_read.records_not_kept
        dumps.spend(lines_read.dumps)
    if not infos:
        raise UsageError(_nothing_readable(skipped))
    if sum(info.bytes for info in infos) == 0:
        raise UsageError("no log text to read: " + ("stdin is empty" if sources[0][0] == "<stdin>" else "the inputs are empty"))
    return Scan(
        inputs=tuple(infos),
        windows=tuple(windows),
        context=tuple(context),
        tails=() if hits else _tails(tails),
        hits=hits,
        hits_not_parsed=hits_not_parsed,
        facts=tuple(facts),
        skipped=tuple(skipped),
        records=tuple(records.kept),
        records_not_kept=records.not_kept,
        dumps=tuple(dumps.kept),
        ranks_tagged=frozenset(ranks),
    )


def _tails(tails: Sequence[tuple[_Source, Excerpt | reading.Unread]]) -> tuple[Excerpt, ...]:
    """The ends of inputs without a hit, as text: a regular file's end is read now, once it is known
    that no input has a hit; one that can no longer be read as it was has none."""
    text = []
    for (name, path, rank_hint), tail in tails:
        if isinstance(tail, Excerpt):
            text.append(tail)
            continue
        assert path is not None  # only a file's end is left unread
        try:
            text.append(reading.tail_of(path, tail, Reading(name, rank_hint)))
        except Unreadable:
            continue
    return tuple(text)


class _Spender:
    """Lines kept under a byte budget in input order; a line that does not fit is counted, a shorter later one may."""

    def __init__(self, budget: int) -> None:
        self.left = budget
        self.kept: list[Excerpt] = []
        self.not_kept = 0

    def spend(self, lines: Sequence[Excerpt]) -> None:
        for line in lines:
            size = len(line.text.encode())  # the bytes read, but where they were not UTF-8
            if size > self.left:
                self.not_kept += 1
                continue
            self.left -= size
            self.kept.append(line)


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
            path = Path(parent, name)
            if is_log_name(name) and is_regular(path):
                yield path


def is_log_name(name: str) -> bool:
    """A file a folder's walk reads: named like a log, gzipped or not."""
    return name.lower().removesuffix(".gz").endswith(LOG_SUFFIXES)


def _natural_key(path: Path) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]
