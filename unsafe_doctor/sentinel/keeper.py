"""The traceback keeper: MindIO's own log line for the unsafe-data error, with the error's traceback.

Since mind-cluster v7.3.0, MindIO's ``tft_exception_handler`` (``framework_ttp/ttp_decorator.py``)
answers the unsafe-data RuntimeError of a step with one warning, ``rank:N catch OTHER exception, …
ex instance:There is unsafe data in the input tensor.``, and no traceback: the log cannot say which
tensor the step read. It logs that warning inside its ``except`` block, where ``sys.exc_info()``
still holds the error, so the traceback can be added to the line there.

MindIO's ``LOGGER`` (``controller_ttp/ttp_logger.py``) is no ``logging.Logger``, so a logging
filter never sees its lines: each of its methods formats the text itself (``[tid][PYH
file.py:line] message % args``, the file and line read two frames up) and hands it to MindIO's C++
logger through one function of the SWIG module, ``ttp_c2python_api.log(level, text)``, which writes
it to ``logs/ttp_log.log.<pid>`` (or stdout, with ``TTP_LOG_STDOUT=1``); its ``exception()``
appends ``traceback.format_exc()`` to the text. The keeper wraps that one function, not the
LOGGER's methods (a frame more would point the ``PYH`` tag at this file): a text holding
torch_npu's unsafe-data message, logged while that error is being handled, gets the error's
traceback appended as ``exception()`` appends it. Every other text passes unchanged, and an error
whose traceback a text already carries (the first public release's ``LOGGER.exception``) is not
given a second one.

Installed with the sentinel, in the same block at the end of the rollback, so that it is in place
before the first step after the recovery. It never raises into the job.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unsafe_doctor.npu.messages import UNSAFE_DATA

# A top-level module: `mindio_ttp.controller_ttp` puts its own folder on sys.path, and both
# `ttp_logger` and `ttp_decorator` import it by this name.
SINK_MODULE = "ttp_c2python_api"
TRACEBACK_HEADER = "Traceback (most recent call last):"
_SHOWN = "_unsafe_doctor_traceback_logged"  # set on an error once a MindIO line carried its traceback


@dataclass(frozen=True)
class Kept:
    """MindIO's log function is wrapped now: its next unsafe-data line carries the traceback."""


@dataclass(frozen=True)
class AlreadyKept:
    """An earlier call wrapped it (the block runs at every rollback)."""


@dataclass(frozen=True)
class NoMindIO:
    """MindIO's log function is not loaded in this process: nothing to wrap."""


@dataclass(frozen=True)
class NotKept:
    """It could not be wrapped; the job goes on without the keeper."""

    reason: str


KeeperOutcome = Kept | AlreadyKept | NoMindIO | NotKept


class _TracebackKeeper:
    """Stands where MindIO's `log(level, text)` was, and calls it with the text it should have had."""

    def __init__(self, log: Callable[[object, object], object]) -> None:
        self.log = log

    def __call__(self, level: object, text: object) -> object:
        return self.log(level, _with_traceback(text))


def keep_tracebacks() -> KeeperOutcome:
    """Wrap MindIO's log function (once per process) so that its unsafe-data line carries the traceback."""
    try:
        sink: Any = sys.modules.get(SINK_MODULE)  # MindIO's module, untyped
        log = getattr(sink, "log", None)
        if sink is None or not callable(log):
            return NoMindIO()
        if isinstance(log, _TracebackKeeper):
            return AlreadyKept()
        sink.log = _TracebackKeeper(log)
        return Kept()
    except Exception as error:  # the rollback must go on whatever this process holds
        return NotKept(f"{SINK_MODULE}.log could not be wrapped: {type(error).__name__}: {error}")


def _with_traceback(text: object) -> object:
    """`text` with the traceback of the unsafe-data error being handled, when it names that error
    and no MindIO line carried its traceback yet; else `text` itself."""
    try:
        error = sys.exc_info()[1]
        if not isinstance(text, str) or UNSAFE_DATA not in text or error is None or UNSAFE_DATA not in str(error):
            return text
        if getattr(error, _SHOWN, False):
            return text
        with contextlib.suppress(Exception):  # an error that takes no attribute may get its traceback twice
            setattr(error, _SHOWN, True)
        if TRACEBACK_HEADER in text:  # LOGGER.exception appended it already
            return text
        return text + "\n" + traceback.format_exc()
    except Exception:  # a text MindIO logs must never be lost to this
        return text
