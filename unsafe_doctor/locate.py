"""Stage 4: unsafe-data tracebacks -> findings (culprit frame, global tensor), folded across ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from unsafe_doctor.tracebacks import Frame, Traceback

UNSAFE_MESSAGE = "There is unsafe data in the input tensor."


@dataclass(frozen=True, slots=True)
class TensorRef:
    expression: str  # 'parallel_state._MOE_AUX_LOSSES_LOGGING_TRACKER[name]'
    variable: str | None  # '_MOE_AUX_LOSSES_LOGGING_TRACKER'; None when the line does not name it
    module: str | None  # 'megatron.core.parallel_state'; None when unknown
    owner: str | None  # class name when the tensor is an attribute of an object


@dataclass(frozen=True)
class Finding:
    ranks: tuple[int, ...]  # sorted
    traceback: Traceback  # first occurrence in log order (the whole chain)
    unsafe: Traceback  # the link of that chain whose message is the unsafe-data error
    culprit: Frame | None
    tensor: TensorRef | None
    source_file: str | None  # the local file read for context, if any
    notes: tuple[str, ...]  # e.g. "read megatron/core/... from site-packages; version may differ"


def is_unsafe_error(traceback: Traceback) -> bool:
    return UNSAFE_MESSAGE.rstrip(".") in traceback.message


def locate(tracebacks: Sequence[Traceback], source_roots: Sequence[Path] = ()) -> list[Finding]:
    """Findings for every traceback whose chain holds the unsafe-data error, folded across ranks."""
    raise NotImplementedError
