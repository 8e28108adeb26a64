"""Tasks run in worker processes, one per core, with the bytes they read added up for a progress bar.

Workers are forked (they start at once, with what is loaded); the tasks and their results travel
pickled. A worker that dies (killed, out of memory) loses no task: what it had not sent back is run
again in this process. Only `inputs` uses this, and only for inputs large enough to pay.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.sharedctypes import Synchronized
from typing import Any, TypeVar

from unsafe_doctor.log.reading import BytesProgress

TaskResult = TypeVar("TaskResult")

_read_so_far: Synchronized[int] | None = None  # bytes read by all workers, set before they fork


def run_in_workers(
    task: Callable[..., TaskResult], arguments: Sequence[tuple[Any, ...]], processes: int, progress: BytesProgress | None
) -> list[TaskResult]:
    """`task(*arguments[i], None, add)` for every i, in `processes` workers; results in order."""
    global _read_so_far
    context = multiprocessing.get_context("fork")  # Linux and macOS; spawn would import everything again
    _read_so_far = context.Value("q", 0)
    reported = 0
    with ProcessPoolExecutor(processes, mp_context=context) as pool:
        futures = [pool.submit(_counted, task, *each) for each in arguments]
        while wait(futures, timeout=0.1, return_when=FIRST_EXCEPTION).not_done:
            if progress is not None:
                reported = _report(progress, reported)
            if any(future.done() and future.exception() for future in futures):
                break
    results = [_result(future, task, each, progress) for future, each in zip(futures, arguments, strict=True)]
    if progress is not None:
        _report(progress, reported)
    return results


def _result(
    future: Future[TaskResult], task: Callable[..., TaskResult], arguments: tuple[Any, ...], progress: BytesProgress | None
) -> TaskResult:
    """The worker's result; the task run here when its worker died before sending one."""
    try:
        return future.result()
    except BrokenProcessPool:
        return task(*arguments, None, progress)


def _counted(task: Callable[..., TaskResult], *arguments: Any) -> TaskResult:
    return task(*arguments, None, _add)


def _add(count: int) -> None:
    assert _read_so_far is not None
    with _read_so_far.get_lock():
        _read_so_far.value += count


def _report(progress: BytesProgress, reported: int) -> int:
    assert _read_so_far is not None
    now = _read_so_far.value
    if now > reported:
        progress(now - reported)
    return now
