"""Tasks run in worker processes, one per core, with the bytes they read added up for a progress bar.

Workers are forked where the system can (they start at once, with what is loaded); the tasks and
their results travel pickled. Only `inputs` uses this, and only for inputs large enough to pay.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from multiprocessing.sharedctypes import Synchronized
from typing import Any, TypeVar

from unsafe_doctor.log.reading import Progress

Result = TypeVar("Result")

_read_so_far: Synchronized[int] | None = None  # bytes read by all workers, set before they fork


def run(
    task: Callable[..., Result], arguments: Sequence[tuple[Any, ...]], processes: int, progress: Progress | None
) -> list[Result]:
    """`task(*arguments[i], None, add)` for every i, in `processes` workers; results in order."""
    global _read_so_far
    context = multiprocessing.get_context("fork")  # Linux and macOS; spawn would re-import everything
    _read_so_far = context.Value("q", 0)
    reported = 0
    with context.Pool(processes) as pool:
        pending = pool.starmap_async(_counted, [(task, *each) for each in arguments], chunksize=1)
        while not pending.ready():
            pending.wait(0.1)
            if progress is not None:
                reported = _report(progress, reported)
        results = pending.get()
    if progress is not None:
        _report(progress, reported)
    return results


def _counted(task: Callable[..., Result], *arguments: Any) -> Result:
    return task(*arguments, None, _add)


def _add(count: int) -> None:
    assert _read_so_far is not None
    with _read_so_far.get_lock():
        _read_so_far.value += count


def _report(progress: Progress, reported: int) -> int:
    assert _read_so_far is not None
    now = _read_so_far.value
    if now > reported:
        progress(now - reported)
    return now
