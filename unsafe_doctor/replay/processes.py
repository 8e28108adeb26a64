"""What a forked replay's processes leave behind, kept bounded: the tail of each one's output, read
from a pipe (a rank that prints for ever fills no disk and no memory), and no process that outlives
the replay, even one its rank started in a session of its own (`start_new_session=True`), which a
kill of the ranks' group does not reach.

Linux keeps those in reach: this process becomes the *subreaper* of what it starts while the
replay runs, so that a process whose parent dies is handed to it, not to init, and is killed here.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import select
import signal
from collections.abc import Iterator, Sequence

TAIL_BYTES = 8 << 10  # of each process's output, kept for the error report (which shows 2,000 characters)
_PIPE_BYTES = 1 << 20  # a rank blocks on a full pipe until it is read: a larger one lets it print faster
_PR_SET_CHILD_SUBREAPER = 36


class OutputTails:
    """One pipe per process (the launcher, each rank): the process writes its stdout and stderr
    into it, this process reads it and keeps its last TAIL_BYTES."""

    def __init__(self, names: Sequence[str]) -> None:
        self._pipes = {name: os.pipe() for name in names}
        self._tails = {name: bytearray() for name in names}

    def write_here(self, name: str) -> None:
        """In a forked process: stdout and stderr into `name`'s pipe; every read end closed."""
        for reading, _ in self._pipes.values():
            with contextlib.suppress(OSError):
                os.close(reading)
        writing = self._pipes[name][1]
        os.dup2(writing, 1)
        os.dup2(writing, 2)

    def close_writers(self, keep: Sequence[str] = ()) -> None:
        """The write ends this process holds, but those it will hand on (`keep`)."""
        for name, (_, writing) in self._pipes.items():
            if name not in keep:
                with contextlib.suppress(OSError):
                    os.close(writing)

    def start_reading(self) -> None:
        """In this process, once the launcher is forked: only the read ends, which never block."""
        self.close_writers()
        for reading, _ in self._pipes.values():
            os.set_blocking(reading, False)
            with contextlib.suppress(OSError, AttributeError):  # Linux only; the default 64 KB otherwise
                fcntl.fcntl(reading, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)

    def read(self, wait: float) -> None:
        """What the processes wrote since the last read, waiting at most `wait` seconds for any."""
        readers = {reading: name for name, (reading, _) in self._pipes.items()}
        waiting = select.poll()  # not select.select: it takes no descriptor past 1,023, and many may be inherited
        for reading in readers:
            waiting.register(reading, select.POLLIN)
        for reading, _ in waiting.poll(wait * 1000):
            tail = self._tails[readers[reading]]
            with contextlib.suppress(BlockingIOError, OSError):
                while chunk := os.read(reading, 1 << 16):
                    tail += chunk
                    del tail[:-TAIL_BYTES]

    def text(self, name: str, limit: int) -> str:
        return self._tails[name].decode("utf-8", errors="replace")[-limit:]

    def close(self) -> None:
        for reading, _ in self._pipes.values():
            with contextlib.suppress(OSError):
                os.close(reading)


@contextlib.contextmanager
def adopting_orphans() -> Iterator[None]:
    """While the replay runs, this process adopts what its descendants leave behind; on the way
    out every process adopted (or forked and not yet reaped) is killed and reaped, until none is left."""
    before = set(_children())
    adopting = _set_subreaper(on=True)
    try:
        yield
    finally:
        if adopting:
            _kill_adopted(before)
            _set_subreaper(on=False)


def _kill_adopted(before: set[int]) -> None:
    """Kill and reap each child that was not there before; the ones a dying child leaves come to
    this process as it dies, so ask again until none is left."""
    while orphans := [pid for pid in _children() if pid not in before]:
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in orphans:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _set_subreaper(*, on: bool) -> bool:
    """Whether this process now adopts orphans (Linux's prctl; elsewhere it cannot)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _children() -> Iterator[int]:
    """This process's children, zombies included, read from /proc."""
    me = os.getpid()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    with open(f"/proc/{name}/stat", "rb") as stat:
                        if int(stat.read().rsplit(b")", 1)[1].split()[1]) == me:
                            yield int(name)
