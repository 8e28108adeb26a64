"""torch_npu's error texts, defined once: what locate looks for in a log, what the emulation raises.

No torch here: the log path imports this module. Texts follow torch_npu's ``TORCH_CHECK`` with
``PTA_ERROR(ErrCode::...)`` (``NPUException.cpp``'s ``formatErrorCode``).
"""

from __future__ import annotations

import datetime
import os
import re

UNSAFE_DATA = "There is unsafe data in the input tensor."

ERR_VALUE = "ERR00003 PTA invalid value"
ERR_MEMORY = "ERR00006 PTA memory error"
ERR_ACL = "ERR00100 PTA call acl api failed"
ERR_HCCL = "ERR02200 DIST call hccl api failed"


def pta_error(code: str, device: int) -> str:
    """The ``PTA_ERROR`` suffix: a newline and ``[ERROR] <time> (PID:p, Device:d, RankID:r) <code>``."""
    now = datetime.datetime.now().strftime("%Y-%m-%d-%H:%M:%S")
    return f"\n[ERROR] {now} (PID:{os.getpid()}, Device:{device}, RankID:{rank_id()}) {code}"


def unsafe_data_message(device: int) -> str:
    """What torch_npu raises when an op reads an unsafe block, text for text."""
    return UNSAFE_DATA + pta_error(ERR_VALUE, device)


def rank_id() -> int:
    """torch_npu reads RANK with ``strtol``: leading digits, 0 when there are none, -1 unset."""
    value = os.environ.get("RANK")
    if value is None:
        return -1
    digits = re.match(r"\s*[+-]?\d+", value)
    return int(digits.group()) if digits else 0
