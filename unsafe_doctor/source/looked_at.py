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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class LookedAt:
    files: dict[str, bytes | None] = field(default_factory=dict)  # path -> digest of the bytes read; None: unreadable
    folders: dict[str, bytes | None] = field(default_factory=dict)  # path -> digest of its entries (`entries_digest`)
    complete: bool = True  # False once a tree had more than MAX_TREE_FOLDERS folders: not all were recorded
    unwatched: str | None = None  # an absolute folder never recorded (the cache's own, which each run writes)

    def merge(self, other: LookedAt) -> None:
        """What another process read (the first record of a path stands)."""
        self.files = other.files | self.files
        self.folders = other.folders | self.folders
        self.complete = self.complete and other.complete

    def unchanged(self, read: Callable[[str], bytes | None]) -> bool:
        """Whether every folder has the same entries and every file, as `read` reads it now, the
        same bytes as recorded."""
        return all(entries_digest(_entries(path)) == recorded for path, recorded in self.folders.items()) and all(
            _digest_of(read(path)) == recorded for path, recorded in self.files.items()
        )


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


def note_read(path: str | os.PathLike[str], data: bytes | None) -> None:
    """A file read (None: it could not be), with its folder, while recording."""
    if _recording is None:
        return
    name = os.fspath(path)
    if name not in _recording.files:
        _recording.files[name] = _digest_of(data)
        note_folder(os.path.dirname(name) or ".")


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
    for count, (folder, subfolders, names) in enumerate(os.walk(root)):
        if count == MAX_TREE_FOLDERS:
            _recording.complete = False
            return
        note_folder(folder, subfolders + names)
        subfolders[:] = [name for name in subfolders if name.isidentifier() and name != "__pycache__"]


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


def _entries(path: str) -> list[str] | None:
    try:
        return os.listdir(path)
    except OSError:
        return None
