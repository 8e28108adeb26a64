"""The uses code makes of holders: one statement's use of one holder, as the walkers in `walk`
record them, and the sites reports name them by."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from unsafe_doctor.recovery_code.flow_scope import TensorPlace
from unsafe_doctor.recovery_code.index import ModuleInfo, Span
from unsafe_doctor.recovery_code.model import Site
from unsafe_doctor.recovery_code.refs import ClassKey
from unsafe_doctor.source.syntax import source_segment

MAX_CODE = 100  # characters of a statement kept in a site

UseKind = Literal["rebind", "store", "augment", "method", "delete", "read", "import", "argument"]


@dataclass(slots=True)
class Use:
    """One statement's use of a holder (or, as evidence, the statement that keeps a tensor)."""

    kind: UseKind
    element: bool  # of an entry, field or value computed from the holder, not the holder itself
    module: ModuleInfo
    statement: Span  # where the statement lies: its nodes are let go with the module's tree
    line: int
    function: str | None
    in_init: bool
    via: tuple[str, ...]  # helpers called on the way from a recovery function
    place: TensorPlace | None = None  # the tensor it stores, when it stores one
    instance_of: ClassKey | None = None  # rebound to, stored or added an instance of this class
    method: str | None = None
    callee: str | None = None  # the function it is passed to
    reads_data: bool = False  # the use reads the tensor's data (unsafe on unsafe memory)
    value_reads_holder: bool = False  # the value stored or copied in is computed from the holder's data
    empty: bool = False  # rebound to an empty container or None
    module_level: bool = False

    def site(self) -> Site:
        code = (source_segment(self.module.text, self.statement) or "").strip().splitlines()
        return Site(self.module.shown, self.line, self.function, shortened(code[0]) if code else "")


def shortened(line: str) -> str:
    """A statement's first line on one line, at most MAX_CODE characters."""
    text = " ".join(line.split())
    return text if len(text) <= MAX_CODE else text[: MAX_CODE - 3] + "..."


def sites(uses: Sequence[Use]) -> tuple[Site, ...]:
    """The uses' sites, one per line."""
    seen: dict[tuple[str, int], Site] = {}
    for use in uses:
        site = use.site()
        seen.setdefault((site.file, site.line), site)
    return tuple(seen.values())
