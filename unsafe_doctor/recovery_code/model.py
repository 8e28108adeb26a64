"""What an audit reports: each holder found, how recovery covers it, and how it classifies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from unsafe_doctor.knowledge.classify import Classification, Classified
from unsafe_doctor.knowledge.context import RunContext
from unsafe_doctor.knowledge.render.template import FixPlan
from unsafe_doctor.knowledge.subject import Subject
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.recovery_code.stale import StaleReset

InstanceHolderKind = Literal["singleton", "registry"]
HolderKind = Literal["module-global", "class-attribute", InstanceHolderKind, "lru-cache", "buffer"]
Placement = Literal["device", "unknown"]
Status = Literal["covered", "unsafe", "uncovered"]
How = Literal["reset", "rebuilt", "repaired"]
Role = Literal["rollback", "send", "recv"]
Stage = Literal["reading", "scanning", "judging"]  # files read for their names, files parsed and scanned, holders judged
AuditProgress = Callable[[Stage, int, int], None]  # (stage, done, total): told after each file or holder


@dataclass(frozen=True, slots=True)
class Site:
    file: str  # as the user named it: under an audited path, the adaptor's path, else relative or absolute
    line: int
    function: str | None  # 'TopKRouter._apply_expert_bias'; None at module level
    code: str  # the statement's first line, shortened


@dataclass(frozen=True)
class Holder:
    kind: HolderKind
    name: GlobalName[str, str]  # its module always known; its owner the class, for class attributes, buffers and cached methods
    placement: Placement
    definition: Site
    evidence: tuple[Site, ...]  # where tensors land in it
    writers: tuple[Site, ...]
    readers: tuple[Site, ...]
    importers: tuple[Site, ...]  # `from module import variable` at module level in another module


@dataclass(frozen=True)
class Coverage:
    status: Status
    how: How | None
    function: str | None  # the adaptor function that handles (or mishandles) it
    via: tuple[str, ...]  # helpers it calls on the way: ('parallel_state.destroy_global_memory_buffer',)
    sites: tuple[Site, ...]  # the statements that do it
    why: str


@dataclass(frozen=True)
class AuditedHolder:
    holder: Holder
    coverage: Coverage
    classification: Classification | None  # None: covered and no rule names it
    subject: Subject  # the holder at the site classification read it: what classify and fix take


CacheUse = Literal["off", "hit", "stored", "not stored"]


@dataclass(frozen=True)
class CacheOutcome:
    """What the audit's cache did (`audit.cache`)."""

    use: CacheUse
    why: str = ""  # for "not stored": the reason, as a note's phrase


@dataclass(frozen=True)
class Audit:
    paths: tuple[Path, ...]
    files: int  # Python files read
    unreadable: tuple[str, ...]  # files that could not be parsed
    holders: tuple[AuditedHolder, ...]  # uncovered first, then unsafe, then covered; by name within
    context: RunContext  # the knowledge, the scan's workspace and the environment the holders were judged with
    stale: tuple[StaleReset, ...]
    notes: tuple[str, ...]
    conversion_only: tuple[str, ...]  # globals left out: only a checkpoint converter uses them (`holders.conversion_only`)
    cache: CacheOutcome = CacheOutcome("off")

    @property
    def uncovered(self) -> tuple[AuditedHolder, ...]:
        """Holders recovery leaves unsafe: not covered, or covered in a way that fails."""
        return tuple(item for item in self.holders if item.coverage.status != "covered")

    @property
    def fixable(self) -> tuple[AuditedHolder, ...]:
        """The holders nothing covers that have a fix to write (an unsafe reset is the user's to change)."""
        return tuple(
            item
            for item in self.holders
            if item.coverage.status == "uncovered"
            and isinstance(item.classification, Classified)
            and isinstance(item.classification.fix, FixPlan)
        )
