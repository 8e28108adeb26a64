"""One stage of the audit on two cores: this process and a forked copy of it share out the stage's
items, each claiming an item before it works on it, so that neither waits for the other while
items are left and none is done twice. The copy starts with everything this process has read, so
it needs no setup; it sends back a byte per item done, for the progress, then its result, pickled,
with what it read while this process records it (`source.looked_at`).
Where there is no `fork` or a single core, or where the copy fails, this process does the items
the copy had claimed too: a result never depends on where it was computed."""

from __future__ import annotations

import mmap
import os
import pickle
import select
import signal
import warnings
from collections.abc import Callable
from functools import partial
from typing import NoReturn, TypeVar

from unsafe_doctor.source import looked_at

HalfResult = TypeVar("HalfResult")

_DONE = b"."  # an item done, then
_RESULT = b"R"  # the pickled result, up to the end of the stream


class Worker:
    """One of the two processes, as the work sees it: which one it is (the copy may go through the
    items in another order), and its claims."""

    def __init__(self, *, copy: bool, claim: Callable[[int], bool], tick: Callable[[], None]):
        self.copy = copy
        self._claim = claim
        self.tick = tick  # an item done
        self.claimed: set[int] = set()

    def claim(self, item: int) -> bool:
        """Whether this process takes the item: no other took it before."""
        if item in self.claimed:
            return False
        if self._claim(item):
            self.claimed.add(item)
            return True
        return False


def shared_out(count: int, work: Callable[[Worker], HalfResult], progress: Callable[[int], None]) -> list[HalfResult]:
    """The results of `work` in each process that did some of the `count` items (this one's first);
    `progress` is told how many items both have done so far, rising."""
    if count < 2 or not _two_cores():  # one item is not shared out
        return [work(_Alone(progress).worker())]
    claims = _Claims(count)
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns of a fork beside threads: a progress bar's, which the copy never touches
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os.close(read_end)
        parent = os.getppid()
        claims.other_gone = lambda: os.getppid() != parent
        _work_as_copy(Worker(copy=True, claim=claims.claim, tick=lambda: _write_all(write_end, _DONE)), work, write_end)
    os.close(write_end)
    claims.other_gone = partial(_has_ended, pid)
    copy = _Copy(pid, read_end)
    try:
        done = 0

        def tick() -> None:
            nonlocal done
            done += 1
            progress(done + copy.poll())

        worker = Worker(copy=False, claim=claims.claim, tick=tick)
        mine = work(worker)
        payload = copy.finish(lambda theirs: progress(done + theirs))
    finally:
        copy.close()
        claims.close()
    if payload is None:  # the copy failed: what it had claimed is done here, from the start
        again = _Alone(progress, done, worker.claimed, copy.poll())
        return [mine, work(again.worker())]
    theirs, read = pickle.loads(payload)
    if read is not None and (here := looked_at.recorded()) is not None:
        here.merge(read)
    return [mine, theirs]


def _two_cores() -> bool:
    if not hasattr(os, "fork"):
        return False
    try:
        return len(os.sched_getaffinity(0)) >= 2  # the cores this process may run on (taskset, a container's limit)
    except AttributeError:  # no affinity on this system
        return (os.cpu_count() or 1) >= 2


class _Alone:
    """This process on its own: every item is its to claim, except those it did already (`excluded`,
    `done` of them); `shown`: the items of a failed copy the progress counted, which it counts once."""

    def __init__(self, progress: Callable[[int], None], done: int = 0, excluded: set[int] | None = None, shown: int = 0):
        self.progress = progress
        self.done = done
        self.excluded = excluded or set()
        self.shown = shown
        self.redone = 0

    def worker(self) -> Worker:
        return Worker(copy=False, claim=lambda item: item not in self.excluded, tick=self._tick)

    def _tick(self) -> None:
        self.redone += 1
        if self.redone > self.shown:
            self.progress(self.done + self.redone)


class _Claims:
    """Which items are taken, in memory both processes share; a byte in a pipe is the lock around it
    (taken by reading it, given back by writing it), which needs no shared-memory semaphore."""

    def __init__(self, count: int):
        self.taken = mmap.mmap(-1, max(count, 1))  # anonymous and shared: the copy sees this process's writes
        self.lock_read, self.lock_write = os.pipe()
        os.write(self.lock_write, b"L")
        self.other_gone: Callable[[], bool] = lambda: False

    def claim(self, item: int) -> bool:
        locked = self._lock()
        try:
            if self.taken[item]:
                return False
            self.taken[item] = 1
            return True
        finally:
            if locked:
                os.write(self.lock_write, b"L")

    def _lock(self) -> bool:
        """Take the lock; False when the other process ended holding it (killed): none is needed then."""
        while not _readable(self.lock_read, 1.0):
            if self.other_gone():
                return False
        os.read(self.lock_read, 1)
        return True

    def close(self) -> None:
        self.taken.close()
        os.close(self.lock_read)
        os.close(self.lock_write)


def _readable(descriptor: int, seconds: float) -> bool:
    """Whether the descriptor can be read within `seconds`: by poll, as select takes no descriptor
    past 1,023 (a process that inherited many has those only)."""
    waiting = select.poll()
    waiting.register(descriptor, select.POLLIN)
    return bool(waiting.poll(seconds * 1000))


def _has_ended(pid: int) -> bool:
    """Whether the child has ended, leaving it to be waited for (never known where there is no `waitid`)."""
    if not hasattr(os, "waitid"):
        return False
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _work_as_copy(worker: Worker, work: Callable[[Worker], HalfResult], out: int) -> NoReturn:
    """The forked copy: its share, sent back; it leaves without running the exit handlers or
    flushing the buffers of the process it was copied from."""
    status = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends the copy at once: the parent handles it
        result = (work(worker), looked_at.recorded())
        _write_all(out, _RESULT + pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        status = 0
    except BaseException:  # noqa: BLE001 - any failure is the parent's to redo; it knows nothing of the copy's
        status = 1
    finally:
        os._exit(status)


def _write_all(out: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(out, view) :]


class _Copy:
    """The forked copy as the parent sees it: the items it has done, then its result."""

    def __init__(self, pid: int, stream: int):
        self.pid = pid
        self.stream = stream
        self.received = bytearray()
        self.ended = False
        self.status: int | None = None

    def poll(self) -> int:
        """Items done so far, read without waiting."""
        while not self.ended and _readable(self.stream, 0):
            self._read()
        return self._ticks()

    def finish(self, progress: Callable[[int], None]) -> bytes | None:
        """The pickled result, once the copy is done (`progress` told of its items meanwhile); None
        when it failed."""
        told = self._ticks()
        while not self.ended:
            self._read()
            if self._ticks() != told:
                told = self._ticks()
                progress(told)
        _, status = os.waitpid(self.pid, 0)
        self.status = status
        result = self.received.find(_RESULT)
        if os.waitstatus_to_exitcode(status) != 0 or result < 0:
            return None
        return bytes(self.received[result + 1 :])

    def close(self) -> None:
        """The copy ended, whatever happened here (an interrupt, an error in this process's share)."""
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self.pid, 0)
        os.close(self.stream)

    def _read(self) -> None:
        chunk = os.read(self.stream, 1 << 20)
        if chunk:
            self.received += chunk
        else:
            self.ended = True

    def _ticks(self) -> int:
        result = self.received.find(_RESULT)
        return len(self.received) if result < 0 else result
