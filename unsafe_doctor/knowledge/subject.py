"""What classify, the source heuristics and the fixer are about: one global tensor and the code that read it.

A log gives it through `locate` (the culprit frame of a traceback); an audit knows it from the
source (a module global, a class attribute, a cache) and builds it with `Subject.of_global`. Neither
needs the other's objects: no traceback, rank or log message is part of a subject.
"""

from __future__ import annotations

from dataclasses import dataclass

from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.log.tracebacks import Frame


@dataclass(frozen=True, slots=True)
class TensorRef:
    expression: str  # 'parallel_state._MOE_AUX_LOSSES_LOGGING_TRACKER[name]'
    # The global, as far as known: its variable None when the line does not name it (a local, a rule's
    # pattern), its module None when unknown, its owner the class when the tensor is an object's attribute.
    name: GlobalName[str | None, str | None]
    cached: bool = False  # the variable is an lru-cached function (or the owner's method) and the tensor its result
    runs_as_main: bool = False  # the module is the job's entry script, run as `__main__`: its globals live there


@dataclass(frozen=True)
class Subject:
    tensor: TensorRef | None  # None when the frame's statement names no tensor that could be resolved
    frame: Frame | None  # the frame that read it: a log's culprit, or a site in the audited source
    source_file: str | None  # the local file read for that frame, if any
    source_differs: bool = False  # that file is not the one that ran: its lines differ from the log's

    @classmethod
    def of_global(
        cls,
        name: GlobalName[str, str],
        file: str,
        line: int | None,
        *,
        function: str = "<module>",
        code: str | None = None,
        cached: bool = False,
    ) -> Subject:
        """A global known from the source, read at file:line (the source file is that file)."""
        return cls(TensorRef(name.qualname, name, cached), Frame(file, line, function, code), file)


@dataclass(frozen=True)
class Evidence:
    """A place in the source that says something about a subject: a reset, an update, a cache decorator."""

    file: str  # as shown to the user: relative to a source root when under one
    line: int
    text: str  # what was seen there

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"
