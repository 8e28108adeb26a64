"""What a run read of the file system, while it is recorded: a digest of each file's bytes as they
were read, and of the entries of each folder whose listing can change what the run finds (a module
added, an adaptor found, a package installed). A result made from these is still right while each
file holds the same bytes and each folder the same entries: the audit's cache keeps its entries by
this. Contents, not times: a `git checkout` that rewrites a file with the same bytes changes
nothing, and no timestamp's granularity can hide a change.

Recording is one process-wide switch rather than a parameter, because the files are read deep in
every stage that parses (`read_source`) and in the forked copy of the audit (`audit.halves` sends its
record back and `merge` adds it here)."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass
class LookedAt:
    files: dict[str, bytes | None] = field(default_factory=dict)  # path -> digest of its bytes read as source; None: not
    wholes: dict[str, bytes | None] = field(default_factory=dict)  # path -> digest of its bytes read whole; None: unreadable
    sizes: dict[str, int | None] = field(default_factory=dict)  # path -> its size, where only the size was read
    links: dict[str, str] = field(default_factory=dict)  # a path as found -> the file it resolved to
    folders: dict[str, bytes | None] = field(default_factory=dict)  # path -> digest of its entries (`entries_digest`)
    complete: bool = True  # False: something was not recorded (`MAX_TREE_FOLDERS`; a file read twice, differently)
    unwatched: str | None = None  # an absolute folder never recorded (the cache's own, which each run writes)

    def merge(self, other: LookedAt) -> None:
        """What another process read; a file it read other bytes of than this one did changed while
        the run read it: the record is incomplete."""
        agreed = [
            _merged(self.files, other.files),
            _merged(self.wholes, other.wholes),
            _merged(self.sizes, other.sizes),
            _merged(self.links, other.links),
            _merged(self.folders, other.folders),
        ]
        self.complete = self.complete and other.complete and all(agreed)

    def unchanged(self, read_source: Callable[[str], bytes | None]) -> bool:
        """Whether every folder has the same entries, every link the same file, every file read as
        source (`read_source`) or whole the same bytes, and every file only sized the same size."""
        return (
            all(entries_digest(_entries(path)) == recorded for path, recorded in self.folders.items())
            and all(_resolved(path) == target for path, target in self.links.items())
            and all(_size(path) == size for path, size in self.sizes.items())
            and all(_digest_of(read_source(path)) == recorded for path, recorded in self.files.items())
            and all(_digest_of(regular_bytes(path)) == recorded for path, recorded in self.wholes.items())
        )


def _merged(mine: dict[str, T], theirs: dict[str, T]) -> bool:
    """`theirs` added to `mine`; whether the two agree where both hold a path."""
    agreed = all(mine[key] == value for key, value in theirs.items() if key in mine)
    mine.update((key, value) for key, value in theirs.items() if key not in mine)
    return agreed


_recording: LookedAt | None = None
MAX_TREE_FOLDERS = 20_000  # a tree's folders recorded at most: past them, stating each again costs more than it saves


@contextmanager
def recording(unwatched: str | os.PathLike[str] | None = None) -> Iterator[LookedAt]:
    """Record what is read until the block ends (nested: the inner block records alone), but in
    `unwatched` and below."""
    global _recording
    outer, _recording = _recording, LookedAt(unwatched=None if unwatched is None else os.path.abspath(unwatched))
    try:
        yield _recording
    finally:
        _recording = outer


def recorded() -> LookedAt | None:
    """The record being kept in this process, if any."""
    return _recording


def note_read(path: str | os.PathLike[str], data: bytes | None, *, whole: bool = False) -> None:
    """A file read (None: it could not be, or was not for its size), with its folder, while
    recording; `whole`: read in full (else as source, up to its limit: `files.source_bytes`)."""
    if _recording is None:
        return
    name = os.fspath(path)
    kept = _recording.wholes if whole else _recording.files
    if name not in kept:
        kept[name] = _digest_of(data)
        note_folder(os.path.dirname(name) or ".")


def note_size(path: str | os.PathLike[str], size: int | None) -> None:
    """A file whose size alone was read (whether to read it at all), while recording."""
    if _recording is not None:
        _recording.sizes.setdefault(os.fspath(path), size)


def note_link(path: str | os.PathLike[str], resolved: str | os.PathLike[str]) -> None:
    """A path found that resolved to another, while recording: a link pointed elsewhere changes
    which file it is, even where the bytes are the same."""
    if _recording is not None:
        _recording.links.setdefault(os.fspath(path), os.fspath(resolved))


def note_folder(path: str | os.PathLike[str], entries: list[str] | None = None) -> None:
    """A folder whose entries the run read or depends on, while recording: as they are now, before
    the run goes on, so that a change made while it runs is one the next run sees. `entries`: as a
    walk just listed them (else listed here)."""
    if _recording is not None:
        name = os.fspath(path)
        if name not in _recording.folders and not _is_unwatched(name):
            _recording.folders[name] = entries_digest(_entries(name) if entries is None else entries)


def _is_unwatched(path: str) -> bool:
    unwatched = _recording.unwatched if _recording is not None else None
    if unwatched is None:
        return False
    absolute = os.path.abspath(path)
    return absolute == unwatched or absolute.startswith(unwatched + os.sep)


def note_tree(root: str | os.PathLike[str]) -> None:
    """Every folder under an import root that a dotted name can lead into (named as an identifier),
    while recording: a module added anywhere under it changes what names resolve to."""
    if _recording is None:
        return
    for count, (folder, subfolders, names) in enumerate(os.walk(root, onerror=note_unlisted)):
        if count == MAX_TREE_FOLDERS:
            _recording.complete = False
            return
        note_folder(folder, subfolders + names)
        subfolders[:] = [name for name in subfolders if name.isidentifier() and name != "__pycache__"]


def note_unlisted(error: OSError) -> None:
    """A folder a walk could not list (`os.walk`'s onerror): recorded as such, so that it being
    listable later is a change."""
    if error.filename is not None:
        note_folder(error.filename)


def regular_bytes(path: str | os.PathLike[str], limit: int | None = None) -> bytes | None:
    """The bytes of a regular file, read at most `limit` of them; None for anything else, or for a
    file past the limit. Opened without blocking and checked once open: a FIFO in its place would
    otherwise hang the run."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        with os.fdopen(descriptor, "rb") as handle:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode) or (limit is not None and status.st_size > limit):
                return None
            data = handle.read() if limit is None else handle.read(limit + 1)  # it may have grown since the fstat
    except OSError:
        return None
    return data if limit is None or len(data) <= limit else None


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _digest_of(data: bytes | None) -> bytes | None:
    return digest(data) if data is not None else None


def entries_digest(entries: list[str] | None) -> bytes | None:
    """A digest of a folder's entries (None: it cannot be listed), but `__pycache__`, which any
    import of a module there may add."""
    if entries is None:
        return None
    kept = sorted(name for name in entries if name != "__pycache__")
    return digest("\0".join(kept).encode("utf-8", "surrogateescape"))


def _size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _resolved(path: str) -> str | None:
    try:
        return os.path.realpath(path)
    except (OSError, RuntimeError):
        return None


def _entries(path: str) -> list[str] | None:
    try:
        return os.listdir(path)
    except OSError:
        return None
