"""Writing a plan's edits: atomically, each file's backup beside it (`backup_of`), owner, group, mode
and extended attributes kept, each file locked against a second writer, and never over a file that
changed since the plan read it. Nothing here prints or exits: refusals raise UsageError.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from unsafe_doctor.adaptor.plan import Plan
from unsafe_doctor.adaptor.splice import FileEdit
from unsafe_doctor.errors import UsageError, os_reason
from unsafe_doctor.source.files import shown_path, write_over

BACKUP_SUFFIX = ".unsafe-doctor.bak"


@dataclass(frozen=True)
class Written:
    path: Path
    backup: Path  # the file as it was before this write (`backup_of`)
    links: int  # names the file has; above 1 it was written in place, so that they all see the fix
    in_place: bool  # written into the file, not renamed over it: other links, or an owner only the file could keep
    owner: tuple[int, int]  # the file's user and group id, kept
    backup_owner: tuple[int, int]  # the backup's: the file's, unless this user may not give them to a new file


def backup_of(path: Path) -> Path:
    """Where a write keeps the file as it was just before it: `x.py.unsafe-doctor.bak` beside the file
    (symlinks resolved), one per file, which the next write replaces; one `.gitignore` line,
    `*.unsafe-doctor.bak`, keeps them all out of git."""
    target = path.resolve()
    return target.with_name(target.name + BACKUP_SUFFIX)


def apply(plan: Plan) -> tuple[Written, ...]:
    """Write every edit: each file's backup beside it, then its new content by an atomic rename, or in
    place where a rename would lose something (`_replace_all`); the file's owner, group, mode and
    extended attributes kept.

    Each file is locked (flock) from the last look at its content to its write, so a second writer
    (another fix, a sentinel install) is refused rather than interleaved. Refuses (before writing
    anything) a read-only file, and any file whose content is no longer what was read when the plan
    was made. Every backup and every new content is on disk before the first file is replaced, so a
    full disk leaves every file and backup as it was."""
    with contextlib.ExitStack() as locks:
        for edit in plan.edits:
            locks.enter_context(_locked(edit))
            _check_unchanged(edit)
            _check_writable(edit)
        staged: list[_Staged] = []
        try:
            for edit in plan.edits:
                staged.append(_stage(edit))
            for item in staged:
                _check_unchanged(item.edit)  # last look, right before the replace
        except BaseException:
            for item in staged:
                item.discard()
            raise
        return _replace_all(staged)


@contextlib.contextmanager
def _locked(edit: FileEdit) -> Iterator[None]:
    """The file locked (flock, an exclusive lock every unsafe-doctor that writes it takes) until the
    `with` ends; refused at once when another holds it: its write may be half done."""
    try:
        handle = os.open(edit.path.resolve(), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise UsageError(f"cannot read {edit.path} again: {os_reason(error)}") from None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                f"{edit.path} is being written by another command (it holds the file's lock): nothing written; "
                "run this one again once that one ends"
            ) from None
        yield
    finally:
        os.close(handle)


@dataclass(frozen=True)
class _Staged:
    """An edit on disk beside its file, not yet in its place: the backup and the new content."""

    edit: FileEdit
    target: Path  # the file itself, symlinks resolved
    owner: tuple[int, int]  # the file's user and group
    backup: Path  # temporary names, until `_replace_all`
    temporary: Path

    def discard(self) -> None:
        self.temporary.unlink(missing_ok=True)
        self.backup.unlink(missing_ok=True)


def _stage(edit: FileEdit) -> _Staged:
    """The backup first, whole; then the new content, whole; both beside the file under temporary names."""
    target = edit.path.resolve()
    try:
        status = target.stat()
        backup = _whole_file(target, edit.original, status)
        try:
            temporary = _whole_file(target, edit.updated, status)
        except BaseException:
            backup.unlink(missing_ok=True)
            raise
    except OSError as error:
        raise UsageError(f"cannot write {edit.path}: {error.strerror or error}: nothing written") from None
    return _Staged(edit, target, _owner(status), backup, temporary)


def _replace_all(staged: Sequence[_Staged]) -> tuple[Written, ...]:
    """Each backup, then each new content, renamed into its place (a rename needs no space). A file
    is written in place instead when a rename would lose something: the file's other hard links, or
    an owner or group this user cannot give a new file (a group member's fix keeps the file its
    owner's). Where a rename is refused (a sticky folder), that file and those after it are left as
    they were."""
    written: list[Written] = []
    for index, item in enumerate(staged):
        backup = backup_of(item.target)
        try:
            links = os.stat(item.target).st_nlink
            in_place = links > 1 or _owner(os.stat(item.temporary)) != item.owner
            os.replace(item.backup, backup)
            if in_place:
                _write_in_place(item.target, item.edit.updated)
                item.temporary.unlink()
            else:
                os.replace(item.temporary, item.target)
        except OSError as error:
            for other in staged[index:]:
                other.discard()
            done = "".join(f"; {earlier.path} was written (backup: {earlier.backup})" for earlier in written)
            raise UsageError(f"cannot replace {item.edit.path}: {error.strerror or error}: left as it was{done}") from None
        _sync_folder(item.target.parent)
        written.append(Written(item.edit.path, shown_path(backup), links, in_place, item.owner, _owner(os.stat(backup))))
    return tuple(written)


def _write_in_place(target: Path, data: bytes) -> None:
    """The new content written into the file (`write_over`): a full disk fails before a byte
    changes, and the backup is already on disk."""
    handle = os.open(target, os.O_WRONLY | os.O_CLOEXEC)
    try:
        write_over(handle, data)
    finally:
        os.close(handle)


def _owner(status: os.stat_result) -> tuple[int, int]:
    return status.st_uid, status.st_gid


def _check_writable(edit: FileEdit) -> None:
    target = edit.path.resolve()
    if not target.stat().st_mode & stat.S_IWUSR or not os.access(target, os.W_OK):
        raise UsageError(f"{edit.path} is read-only: nothing written")
    if not os.access(target.parent, os.W_OK):
        raise UsageError(f"{target.parent} is not writable (the backup is written beside the file): nothing written")


def _check_unchanged(edit: FileEdit) -> None:
    try:
        current = edit.path.resolve().read_bytes()
    except OSError as error:
        raise UsageError(f"cannot read {edit.path} again: {error.strerror or error}") from None
    if hashlib.sha256(current).hexdigest() != edit.digest:
        raise UsageError(f"{edit.path} changed since it was read: nothing written; run the command again")


def _whole_file(target: Path, data: bytes, status: os.stat_result) -> Path:
    """`data` in a new temporary file beside `target`, on disk (fsync), with its mode, and its owner
    and group where this user may give them: root both, a member of the file's group that group
    (`_replace_all` compares what it got)."""
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    temporary = Path(name)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        with contextlib.suppress(PermissionError):
            os.chown(temporary, status.st_uid if os.geteuid() == 0 else -1, status.st_gid)
        os.chmod(temporary, stat.S_IMODE(status.st_mode))  # after chown, which clears set-id bits
        _copy_attributes(target, temporary)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return temporary


def _copy_attributes(source: Path, copy: Path) -> None:
    """The file's extended attributes (its ACL and security label among them) on the copy; one that
    cannot be kept stops the write (OSError), as losing it silently would change who may read the file."""
    try:
        names = os.listxattr(source)
    except OSError as error:
        if error.errno in (errno.ENOTSUP, errno.ENOSYS):  # a file system without them
            return
        raise
    for name in names:
        os.setxattr(copy, name, os.getxattr(source, name))


def _sync_folder(folder: Path) -> None:
    """The rename itself on disk."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
