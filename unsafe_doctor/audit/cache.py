"""The audit's cache: what an audit found, kept for the next audit of the same paths, as pre-commit
and CI repeat it. An entry is the audit of one invocation (the paths, the adaptor, the rule files'
contents, the working folder, `sys.path`, this Python and this release of unsafe-doctor, its own
files included), with what the audit read (`source.looked_at`): a digest of every file it read,
in the trees and in installed packages, and of the entries of every folder under the trees' import
roots, of every folder it listed and of each `sys.path` entry. It is used while every one of these
is unchanged; a single difference runs the audit again.

An entry is whole, not per file: one file's scan reads the names of other modules (on megatron-core
0.16.1, three scans in four look into another module), and the classification reads the folders in
scope, so a part kept per file would need what each part read, which is the same record, per part.

Entries are pickles, written only by this user, into a folder only this user can write: an entry
is trusted as the `.pyc` files beside the source are. One not owned by this user, or that others
may write, is never read. A corrupt or unreadable entry is a miss; a full or unwritable folder
leaves the audit as it was, with the reason said (`CacheUse`). Two audits at once each write a whole
entry and rename it into place: the later one stands."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import stat
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import unsafe_doctor
from unsafe_doctor.errors import os_reason
from unsafe_doctor.knowledge.loading import shipped_knowledge_dir
from unsafe_doctor.recovery_code.model import Audit, CacheOutcome
from unsafe_doctor.source.files import source_bytes
from unsafe_doctor.source.looked_at import LookedAt, digest

ENTRY_FORMAT = 1  # changed with the entry's shape: (ENTRY_FORMAT, key, LookedAt), then the Audit, two pickles
MAX_ENTRIES = 32  # the oldest go beyond these: one per tree audited, in practice


class AuditCache:
    """The entries in one folder: the user's cache folder, or `--cache-dir`."""

    def __init__(self, folder: Path):
        self.folder = folder

    def prepare(self) -> None:
        """The folder made before the audit reads anything: where it lies in a folder the audit
        watches (`--cache-dir` beside the project), that folder's entries already hold it."""
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            pass  # said when the entry cannot be written

    def key(self, paths: list[Path], adaptor: Path | None, rule_paths: list[Path]) -> str:
        """The invocation, as the name of its entry."""
        described = {
            "format": ENTRY_FORMAT,
            "python": [sys.version, sys.implementation.cache_tag],
            "tool": [unsafe_doctor.__version__, _tool_files()],
            "cwd": os.getcwd(),
            "paths": [[str(path), os.path.abspath(path)] for path in paths],
            "adaptor": None if adaptor is None else [str(adaptor), os.path.abspath(adaptor)],
            "rules": [[str(path), _contents(path)] for path in rule_paths],
            "sys.path": sys.path,
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode("utf-8", "surrogateescape")).hexdigest()

    def load(self, key: str) -> Audit | None:
        """The entry's audit, when there is one that this user wrote and nothing it read has changed."""
        try:
            with open(self._entry(key), "rb") as handle:
                if not (_trusted(os.fstat(handle.fileno())) and _trusted(os.stat(self.folder))):
                    return None
                form, stored_key, looked = pickle.load(handle)  # what was read, checked before the audit is loaded
                if form != ENTRY_FORMAT or stored_key != key or not looked.unchanged(source_bytes):
                    return None
                remembered = pickle.load(handle)  # the audit, its knowledge with it
        except Exception:  # noqa: BLE001 - missing, corrupt or from another release: a miss, never a failure
            return None
        return replace(remembered, cache=CacheOutcome("hit"))

    def store(self, key: str, looked: LookedAt, result: Audit) -> CacheOutcome:
        try:
            data = pickle.dumps((ENTRY_FORMAT, key, looked), protocol=pickle.HIGHEST_PROTOCOL)
            data += pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as error:
            return CacheOutcome("not stored", f"the audit could not be kept ({type(error).__name__})")
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            descriptor, temporary = tempfile.mkstemp(dir=self.folder, prefix=".entry-", suffix=".tmp")
            try:
                with os.fdopen(descriptor, "wb") as handle:
                    handle.write(data)
                os.replace(temporary, self._entry(key))
            except BaseException:
                os.unlink(temporary)
                raise
        except OSError as error:
            return CacheOutcome("not stored", f"{self.folder}: {os_reason(error)}")
        self._prune()
        return CacheOutcome("stored")

    def _entry(self, key: str) -> Path:
        return self.folder / f"audit-{key}.pickle"

    def _prune(self) -> None:
        """Only the latest MAX_ENTRIES entries kept, and no temporary file a killed audit left an
        hour ago; another audit removing one first is no matter."""
        try:
            entries = [(path.stat().st_mtime_ns, path) for path in self.folder.glob("audit-*.pickle")]
            hour_ago = time.time_ns() - 3600 * 10**9
            left = [path for path in self.folder.glob(".entry-*.tmp") if path.stat().st_mtime_ns < hour_ago]
        except OSError:
            return
        for path in [path for _, path in sorted(entries, reverse=True)[MAX_ENTRIES:]] + left:
            try:
                path.unlink()
            except OSError:
                pass


def _trusted(status: os.stat_result) -> bool:
    """Owned by this user, and writable by no one else."""
    return status.st_uid == os.getuid() and not status.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _tool_files() -> list[tuple[str, str]]:
    """A digest of each file of this package and its shipped knowledge: a checkout or an editable
    install changes without a new version, and a fresh install of the same one (a CI job's) has
    new times but the same bytes."""
    found = []
    for top in dict.fromkeys([Path(unsafe_doctor.__file__).parent, shipped_knowledge_dir()]):
        for folder, subfolders, names in os.walk(top):
            subfolders[:] = sorted(name for name in subfolders if name != "__pycache__")
            for name in sorted(names):
                path = os.path.join(folder, name)
                try:
                    with open(path, "rb") as handle:
                        found.append((os.path.relpath(path, top), digest(handle.read()).hex()))
                except OSError:
                    continue
    return found


def _contents(path: Path) -> list[tuple[str, str]]:
    """A rule file's, or a rule folder's files', digests (the knowledge loaded them already: a
    file that cannot be read here is named without one)."""
    files = sorted(candidate for candidate in path.rglob("*") if candidate.is_file()) if path.is_dir() else [path]
    result = []
    for file in files:
        try:
            result.append((str(file), digest(file.read_bytes()).hex()))
        except OSError:
            result.append((str(file), ""))
    return result
